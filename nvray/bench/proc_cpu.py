"""CPU time of this machine's Ray actor processes, from Linux ``/proc``: what the ``idle`` and
``serve`` benchmarks report as cores in use per process or per role.

A Ray actor process is titled ``ray::<ClassName>...`` (``ray::ServeReplica:app:deployment``,
``ray::ProxyActor``, ``ray::EngineDriver``, ``ray::RankWorker``); a role is one of those names
and covers every live process whose title starts with it.
"""

from __future__ import annotations

import os
import time

ENGINE_PROCESSES = ("EngineDriver", "RankWorker")
SERVING_PROCESSES = ("ProxyActor", "ServeReplica", "EngineDriver", "RankWorker")


def _title_and_cpu_seconds(pid: str, ticks: int) -> tuple[str, float] | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            title = f.read().split(b"\0")[0].decode(errors="replace")
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:  # the process is gone
        return None
    return title, (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


def process_cpu_seconds(names: tuple[str, ...] = ENGINE_PROCESSES) -> dict[int, tuple[str, float]]:
    """(role, CPU seconds) of each live Ray actor process whose title starts with
    ``ray::<name>`` for one of ``names``, by pid."""
    ticks, found = os.sysconf("SC_CLK_TCK"), {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        seen = _title_and_cpu_seconds(pid, ticks)
        if seen is None or not seen[0].startswith("ray::"):
            continue
        role = next((n for n in names if seen[0].startswith(f"ray::{n}")), None)
        if role is not None:
            found[int(pid)] = (role, seen[1])
    return found


def cores_by_process(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
                     window_s: float) -> dict[int, float]:
    """Cores each process that lived through the window used in it."""
    return {pid: round((after[pid][1] - before[pid][1]) / window_s, 3)
            for pid in before if pid in after}


def cores_by_role(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
                  window_s: float) -> dict[str, float]:
    """Cores each role's processes used in the window, summed per role (busiest process in
    ``<role>_max``)."""
    out: dict[str, float] = {}
    for pid, cores in cores_by_process(before, after, window_s).items():
        role = before[pid][0]
        out[role] = round(out.get(role, 0.0) + cores, 3)
        out[f"{role}_max"] = max(out.get(f"{role}_max", 0.0), cores)
    return out


def cores_in_use(window_s: float, names: tuple[str, ...] = ENGINE_PROCESSES) -> dict[int, float]:
    """Cores each process of ``names`` uses over the next ``window_s`` seconds."""
    before = process_cpu_seconds(names)
    time.sleep(window_s)
    return cores_by_process(before, process_cpu_seconds(names), window_s)
