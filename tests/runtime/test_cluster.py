"""Joining Ray: an asked-for address where nothing answers fails within seconds, naming it; a
cluster record left by a killed head starts a local cluster with a warning instead of hanging;
an engine the whole cluster can never hold is refused at once; a TP=2 engine fits 2 CPUs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def dead_address() -> str:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def run_python(code: str, timeout: float, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    full_env.update(env, PYTHONPATH=REPO + os.pathsep + full_env.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=REPO)


def test_an_asked_for_address_with_no_cluster_fails_fast_naming_it():
    address = dead_address()
    start = time.monotonic()
    proc = run_python("import sys; sys.argv = ['generate', 'Hello']\n"
                      "from nvray.generate import main; main()", timeout=60, RAY_ADDRESS=address)
    assert time.monotonic() - start < 30
    assert proc.returncode != 0
    assert f"RAY_ADDRESS={address}: no Ray cluster answers there" in proc.stderr


def test_a_stale_cluster_record_starts_a_local_cluster_with_a_warning():
    code = f"""
import ray
from ray._private import services
services.find_bootstrap_address = lambda temp_dir=None: {dead_address()!r}  # a killed head's record
from nvray.runtime.cluster import ensure_ray
ensure_ray()
print("NODES", len(ray.nodes()), ray.get_runtime_context().gcs_address)
ray.shutdown()
"""
    start = time.monotonic()
    proc = run_python(code, timeout=120, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert time.monotonic() - start < 90
    assert "NODES 1" in proc.stdout
    assert "its head does not answer" in proc.stderr and "starting a local cluster" in proc.stderr


def test_a_head_started_with_ray_defaults_is_joined_with_its_token(tmp_path):
    """Once ~/.ray/auth_token exists (a first local run writes it), a plain `ray start --head`
    turns Ray's token authentication on; an engine started beside it (RAY_AUTH_MODE unset)
    joins that cluster instead of failing with "Authentication token is missing"."""
    from ray_nodes import default_auth_env, start_head_with_default_auth

    home = tmp_path / "home"
    home.mkdir()
    head = start_head_with_default_auth(tmp_path, home, num_cpus=1)
    try:
        assert "Token authentication is enabled" in head.log.read_text()
        code = f"""
import ray
from ray._private import services
services.find_bootstrap_address = lambda temp_dir=None: {head.gcs_address!r}  # `ray start`'s record
from nvray.runtime.cluster import ensure_ray
ensure_ray()
print("JOINED", ray.get_runtime_context().gcs_address, ray.cluster_resources().get("CPU"))
ray.shutdown()
"""
        env = default_auth_env(home)
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, env=env, cwd=REPO)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"JOINED {head.gcs_address} 1.0" in proc.stdout
    finally:
        head.stop()


def test_an_engine_the_cluster_can_never_hold_is_refused_at_once(ray_cluster):
    from nvray import EngineConfig
    from nvray.runtime import start_engine

    total = ray_cluster.cluster_resources()["CPU"]
    start = time.monotonic()
    with pytest.raises(ValueError, match="the whole cluster has only"):
        start_engine(EngineConfig(model="tiny", tensor_parallel_size=int(total) + 1, device="cpu"))
    assert time.monotonic() - start < 10


def test_a_tp2_engine_runs_on_a_two_cpu_cluster_with_default_options():
    code = """
import ray
ray.init(address="local", num_cpus=2, include_dashboard=False)
from nvray import LLM, SamplingParams
llm = LLM("tiny", tensor_parallel_size=2, max_model_len=128)
out = llm.generate("two cores", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
print("FINISHED", out.finish_reason, len(out.token_ids))
llm.shutdown()
"""
    proc = run_python(code, timeout=240, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "FINISHED length 4" in proc.stdout


def test_an_llm_script_prints_no_ray_notice_at_its_start_or_end(tmp_path):
    """A script's ``LLM()`` on a local cluster of its own, Ray's authentication at its defaults:
    neither Ray's notice that token authentication is on (its default, at every start) nor the
    five lines Ray logs as the engine's compiled graph is torn down (at every script's end)
    reach the console; Ray's own start line and the script's output do."""
    from ray_nodes import default_auth_env

    code = """
from nvray.runtime import cluster
cluster.recorded_cluster_address = lambda: None  # none on this machine: LLM() starts its own
from nvray import LLM, SamplingParams
llm = LLM("tiny", max_model_len=128)
out = llm.generate("hello", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
print("FINISHED", len(out.token_ids))
"""
    home = tmp_path / "home"
    home.mkdir()
    env = default_auth_env(home)
    env.update(PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""),
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=env, cwd=REPO)
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-3000:]
    assert "FINISHED 4" in proc.stdout and "Started a local Ray instance" in console
    assert "Token authentication is enabled" not in console
    assert "compiled DAG" not in console and "Teardown complete" not in console, console[-3000:]


def _hold_all_but(ray_module, keep: float):  # noqa: ANN001, ANN202
    """A placement group holding every free CPU of the session's cluster but ``keep`` (once a
    group the test before removed has given its CPUs back)."""
    from ray.util.placement_group import placement_group, placement_group_table

    deadline = time.monotonic() + 10
    while True:
        live = sum(b.get("CPU", 0.0) for g in placement_group_table().values()
                   if g["state"] != "REMOVED" for b in g["bundles"].values())
        free = ray_module.available_resources().get("CPU", 0.0)
        if free + live >= ray_module.cluster_resources()["CPU"] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    group = placement_group([{"CPU": round(free - keep, 3)}])
    ray_module.get(group.ready(), timeout=30)
    return group


def test_resources_a_live_group_holds_fail_a_start_at_once_naming_them(ray_cluster):
    from ray.util.placement_group import remove_placement_group

    from nvray import EngineConfig
    from nvray.runtime.placement import check_engines_fit

    group = _hold_all_but(ray_cluster, keep=0.5)  # an engine at TP=1 needs 1.0
    try:
        start = time.monotonic()
        with pytest.raises(ValueError, match="are free now .*live placement groups hold"):
            check_engines_fit(EngineConfig(model="tiny"), use_gpu=False, free_now=True)
        assert time.monotonic() - start < 10  # no wait for what a live group holds
    finally:
        remove_placement_group(group)


def test_a_start_right_after_a_group_is_removed_waits_for_its_resources(ray_cluster):
    """An app stopped a moment ago: its groups are removed before their CPUs come back. The
    check waits for them (bounded) instead of refusing the start (the README's batch job
    submitted right after Ctrl-C of the app was refused this way)."""
    from ray.util.placement_group import remove_placement_group

    from nvray import EngineConfig
    from nvray.runtime.placement import check_engines_fit

    for _ in range(3):  # the removal and the check race: each round one chance to lose it
        remove_placement_group(_hold_all_but(ray_cluster, keep=0.5))
        check_engines_fit(EngineConfig(model="tiny"), use_gpu=False, free_now=True)


def test_resources_outside_any_group_are_waited_for_then_named(ray_cluster):
    from nvray import EngineConfig
    from nvray.runtime.placement import check_engines_fit

    free = ray_cluster.available_resources()["CPU"]

    @ray_cluster.remote(num_cpus=round(free - 0.5, 3))
    class Holder:
        def ready(self) -> bool:
            return True

    holder = Holder.remote()
    ray_cluster.get(holder.ready.remote(), timeout=30)
    try:
        start = time.monotonic()
        with pytest.raises(ValueError, match="nothing gave them back within 1 s"):
            check_engines_fit(EngineConfig(model="tiny"), use_gpu=False, free_now=True,
                              release_wait_s=1.0)
        assert 1.0 <= time.monotonic() - start < 10
    finally:
        ray_cluster.kill(holder)
