"""GPU tier fixtures: a Qwen3-0.6B-shaped random bf16 checkpoint (real vocabulary of 151936)
and a local Ray cluster that owns the GPU. The bf16 oracle lives in ``gpu_oracle.py``."""

from __future__ import annotations

import os
import time

import pytest
import torch


@pytest.fixture(scope="session")
def qwen3_06b_path(tmp_path_factory) -> str:
    from nvray.bench.checkpoints import random_qwen3_checkpoint

    return random_qwen3_checkpoint(str(tmp_path_factory.mktemp("qwen3-0.6b")), "0.6b")


@pytest.fixture(scope="session")
def gpu_ray():
    """A local Ray cluster that owns the GPU (rank actors get it through their bundles)."""
    import ray

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if not ray.is_initialized():
        ray.init(num_cpus=8, num_gpus=torch.cuda.device_count(), include_dashboard=False,
                 log_to_driver=False, runtime_env={"env_vars": {
                     "NVRAY_CACHE_DIR": os.environ.get("NVRAY_CACHE_DIR", ""),
                     "TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()


# -- one line per file as each finishes, so a cut run still says what passed ---------------------

_FILE_RESULTS: dict[str, dict[str, float]] = {}


def pytest_runtest_logreport(report) -> None:  # noqa: ANN001 - pytest's TestReport
    if "tests/gpu/" not in report.nodeid:
        return
    tally = _FILE_RESULTS.setdefault(report.nodeid.split("::")[0], {"start": time.monotonic()})
    if report.when == "call" or report.outcome != "passed":
        outcome = "error" if report.when != "call" and report.outcome == "failed" else report.outcome
        tally[outcome] = tally.get(outcome, 0) + 1


def pytest_runtest_protocol(item, nextitem):  # noqa: ANN001, ANN201 - pytest's hook
    path = item.nodeid.split("::")[0]
    if "tests/gpu/" not in path:  # this conftest's hooks see every test of the session
        return (yield)
    _FILE_RESULTS.setdefault(path, {"start": time.monotonic()})
    result = yield
    if nextitem is None or nextitem.nodeid.split("::")[0] != path:
        tally = _FILE_RESULTS.get(path)
        if tally is not None:
            counts = ", ".join(f"{int(v)} {k}" for k, v in tally.items() if k != "start")
            reporter = item.config.pluginmanager.get_plugin("terminalreporter")
            reporter.write_line(f"\n[gpu tier] {path}: {counts} in "
                                f"{time.monotonic() - tally['start']:.1f} s")
    return result


pytest_runtest_protocol = pytest.hookimpl(wrapper=True)(pytest_runtest_protocol)
