"""App options end to end: API keys, autoscaling whole engines, start-up argument errors,
/health while an app deploys, and an app built without warnings."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import requests
from ray import serve

from deployments import build_app
from deployments.args import AppArgs, parse_args
from nvray.config import SERVE_MAX_NUM_BATCHED_TOKENS, EngineConfig

COMPLETION = {"model": "tiny", "prompt": "hello", "max_tokens": 3}


def test_importing_the_app_module_builds_nothing_until_app_is_asked_for(tmp_path):
    """``import deployments`` resolves no device and binds no deployment; ``deployments.app``
    (what ``serve run deployments:app`` reads) is the tiny-model app, built on first access,
    and building it loads no torch (seconds of ``serve run``'s start on a GPU host), even with
    the tiny model not built yet (a cold cache: the replicas build it)."""
    code = ("import deployments, ray, sys\n"
            "assert 'app' not in vars(deployments), 'the app was built at import'\n"
            "assert not ray.is_initialized()\n"
            "from ray.serve import Application\n"
            "assert isinstance(deployments.app, Application)\n"
            "assert deployments.app is deployments.app\n"
            "assert 'torch' not in sys.modules, 'building the app imported torch'\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NVRAY_CACHE_DIR": str(tmp_path)})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize("gpus, visible, device", [
    (4, None, "cuda"), (4, "0,1", "cuda"), (4, "", "cpu"), (0, "0,1", "cpu"), (0, None, "cpu")])
def test_device_auto_before_connecting_counts_gpus_as_ray_would(gpus, visible, device):
    """Before Ray is up, device 'auto' is what a node started here would have: the GPUs NVML
    sees, at most as many as CUDA_VISIBLE_DEVICES lists. (This machine has none, so the child
    process gives Ray's NVML probe ``gpus`` devices.)"""
    code = ("from ray._private.accelerators import NvidiaGPUAcceleratorManager as nvidia\n"
            f"nvidia.get_current_node_num_accelerators = staticmethod(lambda: {gpus})\n"
            "from nvray.config import EngineConfig\n"
            "from nvray.runtime.cluster import resolve_device\n"
            "print(resolve_device(EngineConfig(model='tiny')).device)")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "CUDA_VISIBLE_DEVICES")}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == device


def test_app_defaults_are_the_engines_except_the_documented_step_budget():
    engine = EngineConfig()
    args = AppArgs()
    shared = set(AppArgs.model_fields) & {f.name for f in dataclasses.fields(EngineConfig)}
    assert {"max_num_seqs", "gpu_memory_utilization", "kvcache_block_size"} <= shared
    differing = {name for name in shared if getattr(args, name) != getattr(engine, name)}
    assert differing == {"max_num_batched_tokens"}
    assert args.max_num_batched_tokens == SERVE_MAX_NUM_BATCHED_TOKENS
    assert args.engine_config().max_num_batched_tokens == SERVE_MAX_NUM_BATCHED_TOKENS


def test_unknown_or_invalid_args_fail_at_start_up_naming_them():
    with pytest.raises(ValueError, match="tensor_parallel_size.*modle|modle.*tensor_parallel_size"):
        build_app({"modle": "x", "tensor_parallel_size": "two"})
    with pytest.raises(ValueError, match="unknown engine option.*bogus"):
        build_app({"engine_options": {"bogus": 1}})
    with pytest.raises(ValueError, match="min_replicas=3 > max_replicas=2"):
        build_app({"min_replicas": 3, "max_replicas": 2})
    with pytest.raises(ValueError, match="quantization.*kv_cache_dtype|kv_cache_dtype.*quantization"):
        build_app({"quantization": "int4", "kv_cache_dtype": "fp16"})


def test_two_replicas_share_a_gpu_through_num_gpus_per_rank():
    from deployments import _engine_options  # the Serve options each engine replica gets

    args = AppArgs(device="cuda", num_gpus_per_rank=0.5, gpu_memory_utilization=0.45)
    config = args.engine_config()
    assert (config.num_gpus_per_rank, config.gpu_memory_utilization) == (0.5, 0.45)
    assert _engine_options(args, config)["placement_group_bundles"][0]["GPU"] == 0.5
    with pytest.raises(ValueError, match="num_gpus_per_rank"):
        build_app({"num_gpus_per_rank": 1.5})


def test_building_the_app_warns_nothing_and_keeps_the_metrics_interval():
    """Ray 2.60 deprecates AutoscalingConfig's ``metrics_interval_s`` (one DeprecationWarning
    per app built: 115 in a test run) for environment variables it does not read yet; the app
    still sets it, silently, so a burst is seen within ``metrics_interval_s``."""
    from deployments import _engine_options

    for shape in ({}, {"max_replicas": 2}):  # one deployment, prefix-routed
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            build_app({"metrics_interval_s": 2.5, **shape})
        # (a ResourceWarning is the garbage collector's about an earlier test's socket,
        # whenever it runs: not the app's)
        assert [str(w.message) for w in caught if w.category is not ResourceWarning] == []
    args = AppArgs(metrics_interval_s=2.5)
    autoscaling = _engine_options(args, args.engine_config())["autoscaling_config"]
    assert autoscaling.metrics_interval_s == 2.5 and autoscaling.look_back_period_s == 10.0


def test_parallelism_app_arguments_reach_the_engine_config_or_are_refused_by_name():
    from deployments import _engine_options

    config = parse_args({"tensor_parallel_size": "2", "enable_expert_parallel": "true",
                         "all_reduce": "nccl", "pipeline_parallel_size": "2"}).engine_config()
    assert (config.tensor_parallel_size, config.enable_expert_parallel, config.all_reduce,
            config.pipeline_parallel_size) == (2, True, "nccl", 2)
    bundles = _engine_options(AppArgs(), config)["placement_group_bundles"]
    assert len(bundles) == 4  # a bundle per rank: two stages of two
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        parse_args({"pipeline_parallel_size": 0})
    assert AppArgs().engine_config().all_reduce == EngineConfig().all_reduce == "auto"
    with pytest.raises(ValueError, match="all_reduce"):
        parse_args({"all_reduce": "mpi"})


def test_fp8_app_arguments_reach_the_engine_config():
    config = AppArgs(quantization="fp8", kv_cache_dtype="fp8").engine_config()
    assert (config.quantization, config.kv_cache_dtype) == ("fp8", "fp8")


def test_an_fp8_app_serves_what_an_fp8_llm_generates(serve_http):
    """quantization=fp8 kv_cache_dtype=fp8 as app arguments: the model card says so, and the
    completion is the offline LLM's with the same options (CPU: the reference FP8 path)."""
    options = {"quantization": "fp8", "kv_cache_dtype": "fp8", "max_model_len": 256}
    serve.run(build_app(options), name="fp8", route_prefix="/fp8")
    base = f"{serve_http}/fp8"
    try:
        [card] = requests.get(f"{base}/v1/models", timeout=60).json()["data"]
        assert card["dtypes"]["weights"].startswith("fp8 e4m3 (on-the-fly")
        assert card["parallelism"] == {"tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                                       "expert_parallel": False,
                                       "all_reduce": "none"}
        assert card["dtypes"]["kv_cache"] == "fp8 e4m3 (scale 1)"
        body = requests.post(f"{base}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "The engine schedules", "max_tokens": 12,
            "temperature": 0, "ignore_eos": True}).json()
    finally:
        serve.delete("fp8")
    from nvray import LLM, SamplingParams

    offline = LLM("tiny", runtime="inprocess", **options).generate(
        "The engine schedules", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        use_tqdm=False)[0]
    plain = LLM("tiny", runtime="inprocess", max_model_len=256).generate(
        "The engine schedules", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        use_tqdm=False)[0]
    assert body["choices"][0]["text"] == offline.text
    assert offline.token_ids != plain.token_ids  # FP8 changed this continuation: not a no-op


def test_api_key_is_required_on_v1_but_health_stays_open(serve_http):
    serve.run(build_app({"api_key": "s3cret", "max_model_len": 256}), name="secure",
              route_prefix="/secure")
    base = f"{serve_http}/secure"
    try:
        missing = requests.post(f"{base}/v1/completions", json=COMPLETION, timeout=60)
        assert missing.status_code == 401
        assert missing.json()["error"]["type"] == "authentication_error"
        for token in ("s3cre7", "s3cre", "", "s3cret2"):  # wrong, a prefix, empty, longer
            wrong = requests.post(f"{base}/v1/completions", json=COMPLETION, timeout=60,
                                  headers={"Authorization": f"Bearer {token}"})
            assert wrong.status_code == 401, token
        assert requests.get(f"{base}/v1/models", timeout=60).status_code == 401
        ok = requests.post(f"{base}/v1/completions", json=COMPLETION, timeout=60,
                           headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
        assert requests.get(f"{base}/health", timeout=60).status_code == 200
    finally:
        serve.delete("secure")


def wait_for_route(serve_http: str, route: str) -> None:
    """Until Serve's proxy routes ``route`` to its app (before, a path under it reaches the
    app at "/", if one runs)."""
    deadline = time.monotonic() + 60
    while True:
        routes = requests.get(f"{serve_http}/-/routes", timeout=30)  # 503 until the proxy is up
        if routes.status_code == 200 and route in routes.json():
            return
        assert time.monotonic() < deadline, f"{route} never became a route"
        time.sleep(0.05)


@pytest.mark.parametrize("shape", [{}, {"prefix_routing": True}],
                         ids=["engine-in-ingress", "prefix-routed"])
def test_health_answers_503_while_the_engine_starts_then_200(serve_http, shape):
    """While an app deploys, its /health answers (it used to hang until the engine was up):
    503 ``engine_starting`` in OpenAI's shape, then 200 once the engine is up; a completion
    sent meanwhile waits for the engine and succeeds."""
    name = "starting-" + ("prefix" if shape else "ingress")
    base = f"{serve_http}/{name}"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        deploying = pool.submit(serve.run, build_app(
            {"max_model_len": 256, "num_cpus_per_rank": 0.5, **shape}),
            name=name, route_prefix=f"/{name}")
        try:
            wait_for_route(serve_http, f"/{name}")
            answers: list[requests.Response] = []
            early = None
            deadline = time.monotonic() + 120
            while not answers or answers[-1].status_code != 200:
                assert time.monotonic() < deadline, "the engine never came up"
                answers.append(requests.get(f"{base}/health", timeout=60))
                if early is None:  # sent while the engine starts
                    early = pool.submit(requests.post, f"{base}/v1/completions",
                                        json=COMPLETION, timeout=120)
                time.sleep(0.1)
            deploying.result(timeout=120)
            assert early.result().status_code == 200, early.result().text
        finally:
            serve.delete(name)
    statuses = [r.status_code for r in answers]
    assert statuses[0] == 503 and statuses[-1] == 200, statuses
    assert set(statuses[:-1]) == {503}, statuses
    for starting in answers[:-1]:
        assert starting.json()["error"]["code"] == "engine_starting"
        assert starting.json()["error"]["type"] == "service_unavailable"
    assert answers[-1].json() == {"status": "ok"}


def running_replicas(app: str) -> int:
    """Running engine replicas (NvrayEngine when prefix-routed, else NvrayServer)."""
    deployments = serve.status().applications[app].deployments
    status = deployments.get("NvrayEngine") or deployments["NvrayServer"]
    return status.replica_states.get("RUNNING", 0)


def test_a_burst_scales_to_a_second_engine_and_every_request_succeeds(serve_http, ray_cluster):
    serve.run(build_app({"max_model_len": 256, "min_replicas": 1, "max_replicas": 2,
                         "target_ongoing_requests": 1, "upscale_delay_s": 0,
                         "downscale_delay_s": 600, "num_cpus_per_rank": 0.5}),
              name="scaled", route_prefix="/scaled")
    url = f"{serve_http}/scaled/v1/completions"
    body = {"model": "tiny", "prompt": "burst", "max_tokens": 48, "ignore_eos": True}
    deadline = time.monotonic() + 150
    statuses: list[int] = []

    def keep_asking() -> None:
        while time.monotonic() < deadline and running_replicas("scaled") < 2:
            statuses.append(requests.post(url, json=body, timeout=120).status_code)

    try:
        assert running_replicas("scaled") == 1
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            for f in [pool.submit(keep_asking) for _ in range(6)]:
                f.result()
        assert running_replicas("scaled") == 2
        assert statuses and set(statuses) == {200}
        # both engines answer
        after = [requests.post(url, json=body, timeout=120).status_code for _ in range(4)]
        assert set(after) == {200}
    finally:
        serve.delete("scaled")


def test_overload_nine_requests_against_two_ongoing_and_two_queued(serve_http):
    """max_ongoing_requests 2 + max_queued_requests 2: of nine requests sent at once, four are
    taken (two run, two wait) and the overflow is refused at once with a 503 in OpenAI's JSON
    shape; the four succeed, and so does the next request."""
    serve.run(build_app({"max_model_len": 256, "max_ongoing_requests": 2, "max_queued_requests": 2}),
              name="tight", route_prefix="/tight")
    url = f"{serve_http}/tight/v1/completions"
    body = {"model": "tiny", "prompt": "queue", "max_tokens": 200, "ignore_eos": True}

    def ask(i: int) -> tuple[int, float, requests.Response]:
        start = time.monotonic()
        response = requests.post(url, json={**body, "stream": i % 2 == 1}, timeout=120)
        return response.status_code, time.monotonic() - start, response

    try:
        with concurrent.futures.ThreadPoolExecutor(9) as pool:
            results = list(pool.map(ask, range(9)))
        statuses = sorted(status for status, _, _ in results)
        # all nine arrive within milliseconds, while the first two run for a second or more
        assert statuses.count(200) >= 4 and 503 in statuses and set(statuses) == {200, 503}
        slowest_ok = max(t for status, t, _ in results if status == 200)
        for status, elapsed, response in results:
            if status == 503:
                assert elapsed < slowest_ok / 2  # refused at once, not after waiting
                error = response.json()["error"]
                assert error["code"] == "engine_overloaded" and "overloaded" in error["message"]
                assert error["type"] == "service_unavailable"
                assert response.headers["retry-after"] == "1"
            elif response.headers["content-type"].startswith("text/event-stream"):
                assert response.text.rstrip().endswith("data: [DONE]")
                assert '"finish_reason":"length"' in response.text.replace(" ", "")
            else:
                assert response.json()["usage"]["completion_tokens"] == 200
        assert requests.get(f"{serve_http}/tight/health", timeout=60).status_code == 200
        for _ in range(2):  # streams whose clients leave early give their slots back
            with requests.post(url, json={**body, "stream": True}, stream=True, timeout=120) as r:
                next(r.iter_lines())
        time.sleep(1.0)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            again = list(pool.map(lambda i: ask(2 * i)[0], range(4)))  # two run, two wait
        assert again == [200] * 4
    finally:
        serve.delete("tight")
