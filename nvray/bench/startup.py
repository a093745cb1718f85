"""``python -m nvray.bench startup``: seconds from a new process to a ready engine, started as a
user starts it.

Every run is a new process, so its imports count, and so do the caches a second start on the
node finds (Triton's kernels, the page cache, Python bytecode where the environment keeps it):

- ``LLM(model, max_model_len=...)`` for each of ``--runtimes`` (``inprocess``, ``ray``), timed
  in that process from its first line to ``LLM()``'s return, with the engine's phases
  (``stats()["startup"]``);
- with ``--serve``, ``serve run deployments:build_app model=... max_model_len=...`` until
  ``GET /health`` answers 200 on 127.0.0.1:8000, timed from the command's start, with the
  engine's own ``nvray_startup_total_seconds`` from ``/metrics``; then Ctrl-C stops it.

``--cluster own``: each run starts Ray as it would alone (``LLM()`` joins the cluster recorded on
the machine if one answers, else starts a local one). ``--cluster head``: ``ray start --head``
(timed) before each Ray run, which the run joins, and ``ray stop --force`` after it. Because
``ray stop`` stops every Ray process of the machine and ``serve run``'s Ctrl-C shuts Serve down
on the cluster it joined, ``--cluster head`` and ``--serve`` refuse to run while Ray runs on the
machine, and ``--serve`` while anything answers on port 8000. Runs alternate over ``--rounds``.
One JSON line per run (``"startup_run"``), then the medians by what ran.
"""

from __future__ import annotations

import argparse
import http.client
import importlib.util
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from nvray.bench.checkpoints import QWEN3_SHAPES
from nvray.bench.http_load import metric_value

RUNTIMES = ("inprocess", "ray")
SERVE_HOST, SERVE_PORT = "127.0.0.1", 8000
SERVE_URL = f"http://{SERVE_HOST}:{SERVE_PORT}"
_RUN_TIMEOUT_S = 600.0
_REPORT = "STARTUP_REPORT "
_RAY_DAEMONS = ("gcs_server", "raylet")
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


# ------------------------------------------------------------------ processes
def _tail(path: str, chars: int = 2000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-chars:].strip()


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass  # unkillable (uninterruptible sleep): leave it to the OS


_CTRL_C_ENABLED = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                   "os.execvp(sys.argv[1], sys.argv[1:])")


def ctrl_c_enabled(command: list[str]) -> list[str]:
    """``command`` as a terminal starts it: with SIGINT at its default disposition. A shell that
    runs a job in the background (``&``, ``nohup``, some CI runners) starts it with SIGINT
    ignored, which a child inherits, and a Python child then never sees Ctrl-C (the
    KeyboardInterrupt that makes ``serve run`` shut its app down). A small Python step (isolated:
    no ``PYTHONPATH``, no working directory on its path) resets the signal and execs ``command``
    with the environment unchanged (no ``preexec_fn``: that is unsafe in a parent with threads)."""
    return [sys.executable, "-I", "-S", "-c", _CTRL_C_ENABLED, *command]


def _stop(process: subprocess.Popen) -> None:
    """Ctrl-C to the process group (``serve run`` shuts its app down); SIGKILL if it lingers."""
    try:
        os.killpg(process.pid, signal.SIGINT)
        process.wait(timeout=60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        _kill_group(process)


def _ray_daemons() -> list[int]:
    """Pids of this machine's Ray daemons (what ``ray stop`` would stop); empty without /proc."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                program = f.read().split(b"\0", 1)[0].decode(errors="replace")
        except OSError:
            continue
        if os.path.basename(program) in _RAY_DAEMONS:
            pids.append(int(pid))
    return pids


def _cli(name: str) -> str:
    """A console script of this environment (``ray``, ``serve``)."""
    return shutil.which(name) or os.path.join(os.path.dirname(sys.executable), name)


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, port)) == 0


def check_machine(targets: list[str], cluster: str) -> None:
    """Refuse runs that would stop or replace what someone else runs on this machine."""
    if (cluster == "head" and any(t != "inprocess" for t in targets)) or "serve" in targets:
        if pids := _ray_daemons():
            why = ("--cluster head stops Ray after each run (ray stop --force stops every Ray "
                   "process here)" if cluster == "head" else
                   "--serve's serve run would join it, and its Ctrl-C shuts Serve down there")
            raise SystemExit(f"startup: Ray is running on this machine (pids {pids[:4]}): {why}; "
                             "stop it first (ray stop)")
    if "serve" in targets and _port_open(SERVE_HOST, SERVE_PORT):
        raise SystemExit(f"startup: {SERVE_HOST}:{SERVE_PORT} is taken; --serve's serve run "
                         "needs it: stop what listens there first")


# ------------------------------------------------------------------ the runs
def time_llm(model: str, runtime: str, max_model_len: int) -> dict[str, Any]:
    """``LLM()`` in a new process: its wall seconds and the engine's start-up phases."""
    args = json.dumps({"model": model, "runtime": runtime, "max_model_len": max_model_len})
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        child = subprocess.Popen([sys.executable, "-c", _LLM_CHILD, args], stdout=subprocess.PIPE,
                                 stderr=log, text=True, start_new_session=True)
        try:
            out, _ = child.communicate(timeout=_RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _kill_group(child)
            out = ""
        for line in out.splitlines():
            if line.startswith(_REPORT):
                return json.loads(line[len(_REPORT):])
        raise RuntimeError(f"LLM(runtime={runtime!r}) did not start (exit {child.returncode}; "
                           f"limit {_RUN_TIMEOUT_S:.0f} s): {_tail(log.name)}")


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.read().decode() if response.status == 200 else None
    except (urllib.error.URLError, http.client.HTTPException, OSError):
        return None


def app_dir() -> str:
    """The directory ``serve run`` finds ``deployments`` in (without importing it)."""
    spec = importlib.util.find_spec("deployments")
    if spec is None or spec.origin is None:
        raise SystemExit("startup --serve: the deployments package is not importable here")
    return str(Path(spec.origin).resolve().parents[1])


def time_serve_run(model: str, max_model_len: int, cwd: str) -> dict[str, Any]:
    """``serve run deployments:build_app`` until ``/health`` answers 200; then it is stopped."""
    command = [_cli("serve"), "run", "deployments:build_app", f"model={model}",
               f"max_model_len={max_model_len}"]
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        t0 = time.perf_counter()
        process = subprocess.Popen(ctrl_c_enabled(command), cwd=cwd, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while _get(f"{SERVE_URL}/health") is None:
                if process.poll() is not None:
                    raise RuntimeError(f"serve run exited ({process.returncode}): "
                                       f"{_tail(log.name)}")
                if time.perf_counter() - t0 > _RUN_TIMEOUT_S:
                    raise RuntimeError(f"no /health 200 in {_RUN_TIMEOUT_S:.0f} s: "
                                       f"{_tail(log.name)}")
                time.sleep(0.2)
            wall = time.perf_counter() - t0
            return {"wall_s": round(wall, 3),
                    "engine_s": metric_value(_get(f"{SERVE_URL}/metrics") or "",
                                             "nvray_startup_total_seconds")}
        finally:
            _stop(process)


def _ray(*args: str, check: bool = True) -> None:
    done = subprocess.run([_cli("ray"), *args], capture_output=True, text=True, timeout=300,
                          check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"ray {' '.join(args)} failed ({done.returncode}): "
                           f"{(done.stderr or done.stdout).strip()[-2000:]}")


def one_run(target: str, args: argparse.Namespace, cwd: str | None) -> dict[str, Any]:
    run: dict[str, Any] = {"startup_run": target, "cluster": args.cluster}
    head = args.cluster == "head" and target != "inprocess"
    if head:
        t0 = time.perf_counter()
        _ray("start", "--head", "--disable-usage-stats")
        run["ray_start_s"] = round(time.perf_counter() - t0, 3)
    try:
        if target == "serve":
            run.update(time_serve_run(args.model, args.max_model_len, cwd or "."))
        else:
            run.update(time_llm(args.model, target, args.max_model_len))
    finally:
        if head:
            _ray("stop", "--force", check=False)  # a failure here must not hide the run's
    return run


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median wall time per target, and every run as it was printed (with its phases)."""
    medians: dict[str, Any] = {}
    for target in dict.fromkeys(r["startup_run"] for r in runs):
        walls = [r["wall_s"] for r in runs if r["startup_run"] == target]
        medians[target] = {"wall_s_median": round(statistics.median(walls), 3),
                           "runs": len(walls)}
    return {"startup_medians": medians, "runs": runs}


# ------------------------------------------------------------------ arguments
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
    p.add_argument("--model", default=None,
                   help="checkpoint path or 'tiny' (default: a random checkpoint of --shape, "
                        "built on first use: GPU-sized; give 'tiny' on a CPU)")
    p.add_argument("--shape", default="0.6b", choices=sorted(QWEN3_SHAPES))
    p.add_argument("--runtimes", type=parse_runtimes, default=list(RUNTIMES),
                   help="comma-separated LLM() runtimes to start (inprocess, ray); empty: none")
    p.add_argument("--serve", action="store_true",
                   help="also time serve run deployments:build_app to /health 200 (port 8000)")
    p.add_argument("--cluster", choices=("own", "head"), default="own",
                   help="own: each run starts or joins Ray as it would; head: ray start --head "
                        "before each Ray run and ray stop --force after")
    p.add_argument("--max-model-len", type=positive_int, default=4096)
    p.add_argument("--rounds", type=positive_int, default=2)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """``args.model``: a checkpoint path or ``tiny``; None builds the ``--shape`` checkpoint."""
    targets = [*args.runtimes, *(["serve"] if args.serve else [])]
    if not targets:
        raise SystemExit("startup: nothing to start: give --runtimes or --serve")
    check_machine(targets, args.cluster)
    cwd = app_dir() if args.serve else None
    if args.model is None:
        from nvray.bench.checkpoints import default_checkpoint  # noqa: PLC0415

        args.model = default_checkpoint(args.shape)
    elif os.path.exists(args.model):
        args.model = os.path.abspath(args.model)  # serve run runs in the app's directory
    runs = []
    for _ in range(args.rounds):
        for target in targets:
            runs.append(one_run(target, args, cwd))
            print(json.dumps(runs[-1]), flush=True)
    return summarize(runs)
