"""Cancellation through the Serve app: streams cut at random points, a flood of requests whose
clients time out, and cancelled handle calls all end their engine requests as aborted (not by
running to their length: each asks for hundreds of tokens more than it reads) and free every KV
block within a bound, and a canary request then succeeds promptly with its known text."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from serve_helpers import MAX_MODEL_LEN, assert_counters_balance, greedy, metric

CANARY = "after the storm"
DRAIN_S = 30
MAX_TOKENS_LEFT = MAX_MODEL_LEN - 32  # a unary call the engine is still running when cancelled


def wait_engine_idle(base_url: str) -> None:
    deadline = time.monotonic() + DRAIN_S
    while time.monotonic() < deadline:
        if (metric(base_url, "nvray_num_requests_running") == 0
                and metric(base_url, "nvray_num_requests_waiting") == 0
                and metric(base_url, "nvray_kv_cache_usage_ratio") == 0.0):
            assert_counters_balance(base_url)
            return
        time.sleep(0.2)
    raise AssertionError("the engine still holds requests or KV blocks after the clients left")


def finished_counts(base_url: str) -> dict[str, float]:
    return {reason: metric(base_url, "nvray_requests_finished_total", reason=reason)
            for reason in ("abort", "length")}


def assert_aborted(base_url: str, before: dict[str, float], num_cancelled: int,
                   num_completed: int = 0, lost: int = 0) -> None:
    """Since ``before``, the engine ended exactly ``num_cancelled`` requests as aborted while
    they still had tokens to generate, and ``num_completed`` ran to their length; ``lost``: up
    to that many cancelled ones may have run to their length instead (see the test below)."""
    after = finished_counts(base_url)
    aborted = after["abort"] - before["abort"]
    assert num_cancelled - lost <= aborted <= num_cancelled
    assert after["length"] - before["length"] == num_completed + num_cancelled - aborted


def assert_canary(base_url: str, offline) -> None:
    start = time.monotonic()
    out = requests.post(f"{base_url}/v1/completions", timeout=30, json={
        "prompt": CANARY, "max_tokens": 8, "temperature": 0, "ignore_eos": True}).json()
    assert time.monotonic() - start < 10
    assert out["choices"][0]["text"] == offline.generate(CANARY, greedy(8), use_tqdm=False)[0].text


def cut_stream(base_url: str, seed: int) -> int:
    rng = random.Random(seed)
    lines_to_read = rng.randrange(0, 12)
    with requests.post(f"{base_url}/v1/completions", stream=True, timeout=60, json={
            "prompt": f"cut me {seed}", "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        read = 0
        for _ in zip(range(lines_to_read), r.iter_lines()):
            read += 1
    return read  # leaving the with-block closes the connection mid-stream


def test_streams_cut_at_random_points_free_everything(base_url, offline):
    before = finished_counts(base_url)
    with ThreadPoolExecutor(12) as pool:
        list(pool.map(lambda s: cut_stream(base_url, s), range(12)))
    wait_engine_idle(base_url)
    # Known issue (docs/reliability.md): now and then (about one run in three on a 2-core
    # machine, at the session's start too) one of the 12 disconnects never reaches the replica
    # through Serve's proxy and its request runs to its length; the others must be aborted
    assert_aborted(base_url, before, 12, lost=1)
    assert_canary(base_url, offline)


def test_a_flood_of_timed_out_clients_leaves_the_engine_idle(base_url, offline):
    def impatient(i: int) -> bool:
        try:
            requests.post(f"{base_url}/v1/completions", timeout=0.5, json={
                "prompt": f"flood {i}", "max_tokens": 400, "ignore_eos": True})
        except requests.exceptions.Timeout:
            return True
        return False

    before = finished_counts(base_url)
    with ThreadPoolExecutor(16) as pool:
        timed_out = list(pool.map(impatient, range(16)))
    assert sum(timed_out) >= 8  # 400 tokens each do not fit in half a second here
    wait_engine_idle(base_url)
    assert_aborted(base_url, before, sum(timed_out), len(timed_out) - sum(timed_out))
    assert_canary(base_url, offline)


def test_cancelled_handle_calls_free_their_requests(base_url, ray_cluster, offline):
    ray = ray_cluster

    @ray.remote(num_cpus=0.1)
    def start_and_cancel(metrics_url: str, accepted_before: float) -> int:
        import re  # noqa: PLC0415

        from ray import serve as s  # noqa: PLC0415

        def accepted() -> float:
            text = requests.get(metrics_url, timeout=30).text
            line = r"^nvray_requests_accepted_total(?:\{[^}]*\})? (\S+)$"
            return float(re.search(line, text, re.M).group(1))

        handle = s.get_app_handle("default")
        stream = handle.options(stream=True).generate_stream.remote(
            "cancel my stream", {"max_tokens": 400, "ignore_eos": True})
        got = sum(1 for _ in zip(range(3), stream))
        stream.cancel()
        # the unary call is cancelled once the engine has it (a fixed wait let a fast moment
        # finish it first: 'aborted 1 of 2'), with far more tokens left than the poll takes
        unary = handle.generate.remote("cancel my call", {"max_tokens": MAX_TOKENS_LEFT,
                                                          "ignore_eos": True})
        deadline = time.monotonic() + 10
        while accepted() < accepted_before + 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        unary.cancel()
        return got

    before = finished_counts(base_url)
    accepted = metric(base_url, "nvray_requests_accepted_total")
    assert ray.get(start_and_cancel.remote(f"{base_url}/metrics", accepted), timeout=60) == 3
    wait_engine_idle(base_url)
    reached = metric(base_url, "nvray_requests_accepted_total") - accepted
    assert reached == 2, "both calls reach the engine before they are cancelled"
    assert_aborted(base_url, before, int(reached))
    assert_canary(base_url, offline)
