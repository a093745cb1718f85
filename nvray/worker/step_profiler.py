"""StepProfiler: a kernel-time profile of a window of a rank's steps, asked for by the
environment (a developer's tool; the bench's ``--profile DIR`` sets it).

``NVRAY_PROFILE_DIR=DIR`` profiles the device work of steps ``[start, start + count)`` of every
rank (``NVRAY_PROFILE_STEPS=start:count``, default ``200:20``: past start-up and the first
prefills) with torch's profiler, CUDA activity only, and writes ``DIR/rank{r}.txt``: the
kernels by total device time (``rank{r}.2.txt`` and on for the later engines of one process,
e.g. the bench's base and LoRA runs). Without the variable it does nothing but count.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)
_DIR_ENV, _STEPS_ENV = "NVRAY_PROFILE_DIR", "NVRAY_PROFILE_STEPS"


class StepProfiler:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.dir = os.environ.get(_DIR_ENV) or None
        start, count = (os.environ.get(_STEPS_ENV) or "200:20").split(":")
        self.start, self.stop = int(start), int(start) + int(count)
        self.steps = 0
        self.profile: Any = None

    def step(self) -> None:
        """Call once before each step's device work is queued."""
        if self.dir is None:
            return
        if self.steps == self.start:
            self.profile = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CUDA])
            self.profile.__enter__()
        elif self.steps == self.stop and self.profile is not None:
            self._write()
        self.steps += 1

    def _write(self) -> None:
        torch.cuda.synchronize()
        self.profile.__exit__(None, None, None)
        table = self.profile.key_averages().table(sort_by="cuda_time_total", row_limit=30,
                                                  max_name_column_width=70)
        path = _free_path(Path(self.dir), f"rank{self.rank}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"steps {self.start}..{self.stop - 1} of rank {self.rank}\n{table}\n")
        logger.warning("profile of steps %d..%d written to %s", self.start, self.stop - 1, path)
        self.profile = None


def _free_path(folder: Path, stem: str) -> Path:
    """``folder/stem.txt``, or ``stem.2.txt``, ``stem.3.txt``... if taken (never overwrites)."""
    path, n = folder / f"{stem}.txt", 1
    while path.exists():
        n += 1
        path = folder / f"{stem}.{n}.txt"
    return path
