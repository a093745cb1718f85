"""Faults through the Serve app, on an app of their own (the shared one stays untouched).

- A killed EngineDriver: every in-flight request ends within seconds — a non-streamed one with a
  503 in OpenAI's shape, a stream with an SSE error event and then ``[DONE]`` — ``/health``
  answers 503, Serve replaces the replica with a whole new engine, service returns within
  ``RECOVERY_S``, and no actor of the dead engine is left behind.
- Graceful shutdown: deleting an app while requests run lets them finish (complete answers),
  and leaves none of its actors.
- One of two engine replicas of a prefix-routed app killed under a steady load of short
  requests: at most 1% of the requests fail (those on the killed engine at that moment); the
  other replica carries on.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import ray
import requests
from ray import serve

from deployments import build_app
from ray_state import live_actors
from serve_helpers import metric

RECOVERY_S = 120
FAIL_FAST_S = 10
NVRAY_CLASSES = ("EngineDriver", "RankWorker", "ServeReplica:faulty:NvrayServer",
                 "ServeReplica:faulty:NvrayEngine", "ServeReplica:leaving:NvrayServer")
BODY = {"model": "tiny", "prompt": "keep going", "max_tokens": 230, "ignore_eos": True}


def live_nvray_actors() -> set[str]:
    """Ids of the live engine actors and of these tests' replicas."""
    return set(live_actors(NVRAY_CLASSES))


def wait_running(base: str, n: int) -> None:
    deadline = time.monotonic() + 60
    while metric(base, "nvray_num_requests_running") < n:
        assert time.monotonic() < deadline, f"{n} requests never ran together"
        time.sleep(0.1)


def post(url: str, body: dict) -> tuple[int, float, str]:
    response = requests.post(url, json=body, timeout=120)
    return response.status_code, time.monotonic(), response.text


def test_a_killed_driver_fails_requests_fast_and_serve_brings_a_new_engine(serve_http):
    before = live_nvray_actors()
    serve.run(build_app({"max_model_len": 256, "num_cpus_per_rank": 0.5}), name="faulty",
              route_prefix="/faulty")
    base, url = f"{serve_http}/faulty", f"{serve_http}/faulty/v1/completions"
    try:
        engine = serve.get_app_handle("faulty").engine_client.remote().result(timeout_s=60)
        first_engine = live_nvray_actors() - before
        with ThreadPoolExecutor(4) as pool:
            calls = [pool.submit(post, url, {**BODY, "stream": i % 2 == 1}) for i in range(4)]
            wait_running(base, 4)
            ray.kill(engine.driver, no_restart=True)
            killed = time.monotonic()
            health = requests.get(f"{base}/health", timeout=30)
            results = [c.result() for c in calls]
        assert health.status_code == 503
        assert health.json()["error"]["code"] == "engine_unavailable"
        for i, (status, ended, text) in enumerate(results):
            assert ended - killed < FAIL_FAST_S
            if i % 2:  # a stream: its 200 went out first, so an error event, then [DONE]
                assert status == 200
                events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
                assert events[-1] == "[DONE]"
                assert json.loads(events[-2])["error"]["code"] == "engine_unavailable"
            else:
                assert status == 503
                assert json.loads(text)["error"]["code"] == "engine_unavailable"
        deadline = time.monotonic() + RECOVERY_S
        while post(url, {**BODY, "max_tokens": 4})[0] != 200:
            assert time.monotonic() < deadline, f"no new engine within {RECOVERY_S} s"
            time.sleep(1.0)
        recovery_s = time.monotonic() - killed
        print(f"service returned {recovery_s:.1f} s after the driver was killed")
        assert not first_engine & live_nvray_actors(), "an actor of the dead engine lives on"
    finally:
        serve.delete("faulty")
    assert live_nvray_actors() <= before


def test_deleting_an_app_lets_its_running_requests_finish(serve_http):
    before = live_nvray_actors()
    serve.run(build_app({"max_model_len": 256, "num_cpus_per_rank": 0.5}), name="leaving",
              route_prefix="/leaving")
    base, url = f"{serve_http}/leaving", f"{serve_http}/leaving/v1/completions"
    with ThreadPoolExecutor(3) as pool:
        calls = [pool.submit(post, url, {**BODY, "max_tokens": 120, "stream": i == 2})
                 for i in range(3)]
        wait_running(base, 3)
        serve.delete("leaving", _blocking=True)
        results = [c.result() for c in calls]
    for i, (status, _, text) in enumerate(results):
        assert status == 200
        if i == 2:
            assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text
        else:
            assert json.loads(text)["usage"]["completion_tokens"] == 120
    deadline = time.monotonic() + 30
    while live_nvray_actors() - before:
        assert time.monotonic() < deadline, "the deleted app's engine outlived it"
        time.sleep(0.5)


def test_killing_one_of_two_replicas_under_steady_load_loses_under_one_percent(serve_http):
    serve.run(build_app({"max_model_len": 256, "num_cpus_per_rank": 0.5, "min_replicas": 2,
                         "max_replicas": 2}), name="faulty", route_prefix="/faulty")
    url = f"{serve_http}/faulty/v1/completions"
    statuses: list[int] = []
    stop_at = time.monotonic() + 40

    def steady() -> None:
        while time.monotonic() < stop_at:
            statuses.append(post(url, {**BODY, "max_tokens": 4})[0])

    try:
        with ThreadPoolExecutor(4) as pool:
            clients = [pool.submit(steady) for _ in range(4)]
            time.sleep(8)
            [replica, _] = live_actors(("ServeReplica:faulty:NvrayEngine",)).values()
            ray.kill(ray.get_actor(replica.name, namespace="serve"), no_restart=True)
            killed_after = len(statuses)
            for c in clients:
                c.result()
        failures = len(statuses) - statuses.count(200)
        print(f"{len(statuses)} requests, {failures} failed, {killed_after} before the kill")
        assert len(statuses) - killed_after >= 100, "too little load after the kill to judge"
        assert failures <= 0.01 * len(statuses), statuses
    finally:
        serve.delete("faulty")
