"""GPU tier fixtures: a Qwen3-0.6B-shaped random bf16 checkpoint (real vocabulary of 151936)
built once per run, and a local Ray cluster that owns the GPU; and the tier's progress lines,
one per file as its last test ends (``bash tests/gpu/run_tier.sh`` runs the tier side by side
with pytest-xdist: the lines then come from the controller, counted from what the workers
collected). The bf16 oracle lives in ``gpu_oracle.py``."""

from __future__ import annotations

import collections
import contextlib
import fcntl
import os
import time

import pytest
import torch


@contextlib.contextmanager
def _exclusive(lock_path: str):
    """Held by one process at a time (the xdist workers of a run build a checkpoint once)."""
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def run_dir(tmp_path_factory) -> str:
    """A directory of this run that every xdist worker shares (this process's own otherwise)."""
    base = tmp_path_factory.getbasetemp()
    return str(base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base)


@pytest.fixture(scope="session")
def qwen3_06b_path(tmp_path_factory) -> str:
    from nvray.bench.checkpoints import random_qwen3_checkpoint

    root = run_dir(tmp_path_factory)
    with _exclusive(os.path.join(root, "qwen3-0.6b.lock")):
        return random_qwen3_checkpoint(os.path.join(root, "qwen3-0.6b"), "0.6b")


@pytest.fixture(scope="session")
def gpu_ray():
    """A local Ray cluster that owns the GPU (rank actors get it through their bundles). Tests
    that start one carry ``xdist_group("ray")``: one worker of a side-by-side run holds it."""
    import ray

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if not ray.is_initialized():
        ray.init(num_cpus=8, num_gpus=torch.cuda.device_count(), include_dashboard=False,
                 log_to_driver=False, runtime_env={"env_vars": {
                     "NVRAY_CACHE_DIR": os.environ.get("NVRAY_CACHE_DIR", ""),
                     "TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()


# -- one line per file as its last test ends, so a cut run still says what passed ---------------

_TIER_START = time.monotonic()
_LEFT: dict[str, int] = {}  # tests of each tests/gpu file not yet ended
_FILES: dict[str, dict] = {}  # file -> {"start": t, "counts": Counter of outcomes}
_OUTCOMES: dict[str, str] = {}  # nodeid -> its outcome so far
_CONFIG: list = []


def pytest_configure(config) -> None:  # noqa: ANN001 - pytest's Config
    _CONFIG[:] = [config]


def _is_xdist_worker(config) -> bool:  # noqa: ANN001
    return hasattr(config, "workerinput")


def _expect(nodeids) -> None:  # noqa: ANN001 - an iterable of test ids
    if _LEFT:
        return  # every xdist worker collects the same tests: the first one's list is enough
    for nodeid in nodeids:
        path = nodeid.split("::")[0]
        if "tests/gpu/" in path:
            _LEFT[path] = _LEFT.get(path, 0) + 1


def pytest_collection_finish(session) -> None:  # noqa: ANN001 - pytest's Session
    if not _is_xdist_worker(session.config):  # an xdist controller collects nothing itself
        _expect(item.nodeid for item in session.items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids) -> None:  # noqa: ANN001 - xdist's
    _expect(ids)


def pytest_runtest_logreport(report) -> None:  # noqa: ANN001 - pytest's TestReport
    path = report.nodeid.split("::")[0]
    if path not in _LEFT or (_CONFIG and _is_xdist_worker(_CONFIG[0])):
        return
    tally = _FILES.setdefault(path, {"start": time.monotonic(), "counts": collections.Counter()})
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _OUTCOMES[report.nodeid] = ("error" if report.when == "setup" and report.failed
                                    else report.outcome)
    elif report.when == "teardown" and report.failed:
        _OUTCOMES[report.nodeid] = "error"
    if report.when != "teardown":
        return
    tally["counts"][_OUTCOMES.pop(report.nodeid, "passed")] += 1
    _LEFT[path] -= 1
    if _LEFT[path] == 0:
        now = time.monotonic()
        counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(tally["counts"].items()))
        reporter = _CONFIG[0].pluginmanager.get_plugin("terminalreporter")
        reporter.ensure_newline()
        reporter.write_line(f"[gpu tier] {path}: {counts} in {now - tally['start']:.1f} s "
                            f"(at {now - _TIER_START:.0f} s)")
