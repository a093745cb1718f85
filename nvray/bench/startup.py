"""``python -m nvray.bench startup``: seconds from a new process to a ready engine, started as a
user starts it.

Every run is a new process, so its imports count, and so do the caches a second start on the
node finds (Triton's kernels, the page cache, Python bytecode where the host keeps it):

- ``LLM(model, max_model_len=...)`` for each of ``--runtimes`` (``inprocess``, ``ray``), timed
  in that process from its first line to ``LLM()``'s return, with the engine's phases
  (``stats()["startup"]``);
- with ``--serve``, ``serve run deployments:build_app model=... max_model_len=...`` until
  ``GET /health`` answers 200 on 127.0.0.1:8000, timed from the command's start, with the
  engine's own ``nvray_startup_total_seconds`` from ``/metrics``.

``--cluster own``: each run starts Ray as it would alone (``LLM()`` and ``serve run`` join the
cluster recorded on the machine if one answers, else start a local one). ``--cluster head``:
``ray start --head`` before each run (timed), which the run joins, and ``ray stop --force``
after it. Runs alternate over ``--rounds``. One JSON line per run (``"startup_run"``), then the
medians by what ran.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

RUNTIMES = ("inprocess", "ray")
SERVE_URL = "http://127.0.0.1:8000"
_RUN_TIMEOUT_S = 600.0
_REPORT = "STARTUP_REPORT "
_LLM_CHILD = f"""
import json, sys, time
t0 = time.perf_counter()
from nvray import LLM
args = json.loads(sys.argv[1])
llm = LLM(args["model"], runtime=args["runtime"], max_model_len=args["max_model_len"])
wall = time.perf_counter() - t0
print({_REPORT!r} + json.dumps({{"wall_s": round(wall, 3), "startup": llm.stats()["startup"]}}),
      flush=True)
llm.shutdown()
"""


def time_llm(model: str, runtime: str, max_model_len: int) -> dict[str, Any]:
    """``LLM()`` in a new process: its wall seconds and the engine's start-up phases."""
    args = json.dumps({"model": model, "runtime": runtime, "max_model_len": max_model_len})
    done = subprocess.run([sys.executable, "-c", _LLM_CHILD, args], capture_output=True,
                          text=True, timeout=_RUN_TIMEOUT_S, check=False)
    for line in done.stdout.splitlines():
        if line.startswith(_REPORT):
            return json.loads(line[len(_REPORT):])
    raise RuntimeError(f"LLM(runtime={runtime!r}) did not start (exit {done.returncode}): "
                       f"{done.stderr.strip()[-2000:]}")


def _app_dir() -> str:
    """The directory ``serve run`` finds ``deployments`` in."""
    import deployments  # noqa: PLC0415 - only the serve runs need it

    return str(Path(deployments.__file__).resolve().parents[1])


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.read().decode() if response.status == 200 else None
    except (urllib.error.URLError, OSError):
        return None


def _engine_total_s(metrics: str | None) -> float | None:
    for line in (metrics or "").splitlines():
        if line.startswith("nvray_startup_total_seconds"):
            return float(line.rsplit(" ", 1)[1])
    return None


def _stop(process: subprocess.Popen) -> None:
    """Ctrl-C to ``serve run`` (it shuts its app down); its whole process group if it lingers."""
    try:
        os.killpg(process.pid, signal.SIGINT)
        process.wait(timeout=60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=30)


def time_serve_run(model: str, max_model_len: int) -> dict[str, Any]:
    """``serve run deployments:build_app`` until ``/health`` answers 200; then it is stopped."""
    if _get(f"{SERVE_URL}/health") is not None:
        raise RuntimeError(f"{SERVE_URL} already answers: stop that app first")
    serve = shutil.which("serve") or os.path.join(os.path.dirname(sys.executable), "serve")
    command = [serve, "run", "deployments:build_app", f"model={model}",
               f"max_model_len={max_model_len}"]
    t0 = time.perf_counter()
    process = subprocess.Popen(command, cwd=_app_dir(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        while _get(f"{SERVE_URL}/health") is None:
            if process.poll() is not None:
                raise RuntimeError(f"serve run exited ({process.returncode}): "
                                   f"{process.stderr.read()[-2000:]}")
            if time.perf_counter() - t0 > _RUN_TIMEOUT_S:
                raise RuntimeError(f"no /health 200 in {_RUN_TIMEOUT_S:.0f} s")
            time.sleep(0.2)
        wall = time.perf_counter() - t0
        return {"wall_s": round(wall, 3),
                "engine_s": _engine_total_s(_get(f"{SERVE_URL}/metrics"))}
    finally:
        _stop(process)


def _ray(*args: str) -> None:
    ray = shutil.which("ray") or os.path.join(os.path.dirname(sys.executable), "ray")
    subprocess.run([ray, *args], check=True, capture_output=True, timeout=300)


def one_run(target: str, args: argparse.Namespace) -> dict[str, Any]:
    run: dict[str, Any] = {"startup_run": target, "cluster": args.cluster}
    if args.cluster == "head":
        t0 = time.perf_counter()
        _ray("start", "--head", "--disable-usage-stats")
        run["ray_start_s"] = round(time.perf_counter() - t0, 3)
    try:
        if target == "serve":
            run.update(time_serve_run(args.model, args.max_model_len))
        else:
            run.update(time_llm(args.model, target, args.max_model_len))
    finally:
        if args.cluster == "head":
            _ray("stop", "--force")
    return run


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    medians: dict[str, Any] = {}
    for target in dict.fromkeys(r["startup_run"] for r in runs):
        walls = [r["wall_s"] for r in runs if r["startup_run"] == target]
        medians[target] = {"wall_s_median": round(statistics.median(walls), 3),
                           "runs": len(walls)}
    return {"startup_medians": medians}


def parse_runtimes(text: str) -> list[str]:
    runtimes = [r.strip() for r in text.split(",") if r.strip()]
    unknown = [r for r in runtimes if r not in RUNTIMES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown runtime(s) {', '.join(unknown)}: choose from "
                                         f"{', '.join(RUNTIMES)}")
    return runtimes


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be >= 1")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runtimes", type=parse_runtimes, default=list(RUNTIMES),
                   help="comma-separated LLM() runtimes to start (inprocess, ray); empty: none")
    p.add_argument("--serve", action="store_true",
                   help="also time serve run deployments:build_app to /health 200 (port 8000)")
    p.add_argument("--cluster", choices=("own", "head"), default="own",
                   help="own: each run starts or joins Ray as it would; head: ray start --head "
                        "before each run and ray stop --force after")
    p.add_argument("--max-model-len", type=positive_int, default=4096)
    p.add_argument("--rounds", type=positive_int, default=2)


def run(args: argparse.Namespace) -> dict[str, Any]:
    targets = [*args.runtimes, *(["serve"] if args.serve else [])]
    if not targets:
        raise SystemExit("nothing to start: give --runtimes or --serve")
    runs = []
    for _ in range(args.rounds):
        for target in targets:
            runs.append(one_run(target, args))
            print(json.dumps(runs[-1]), flush=True)
    return summarize(runs)
