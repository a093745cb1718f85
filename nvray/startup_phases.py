"""Where an engine's start-up seconds go: named phases, timed where they run.

``StartupPhases`` adds up the wall seconds of each named phase (``with phases.phase(name):``)
in the order the phases first ran. A rank times its own phases (the model and its weights,
compiling kernels ahead, the memory profile, the KV cache, kernel warm-up, CUDA graph
capture); the engine's assembly (``bootstrap.create_engine``) times the tokenizer and the
executor, and on Ray the executor times starting its rank actors and compiling its graph, with
rank 0's phases inside. The engine reports them (``LLMEngine.counters.startup``: ``phases_s``,
``total_s`` and ``other_s``, the seconds no phase covers; ``beside_s``, phases that ran in a
thread beside the others, such as the tokenizer while the Ray ranks start) in ``stats()`` and
one INFO line.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator


class StartupPhases:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}  # phases one after the other
        self.beside: dict[str, float] = {}  # phases that ran beside those (in a thread)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def add(self, seconds: dict[str, float]) -> None:
        """Phases timed elsewhere (a rank's), counted as they are."""
        for name, value in seconds.items():
            self.seconds[name] = self.seconds.get(name, 0.0) + value

    def add_within(self, inner: dict[str, float], wall: float, rest: str) -> None:
        """``inner`` phases timed elsewhere inside a span of ``wall`` seconds; what they leave
        of it is the phase ``rest``."""
        self.add(inner)
        self.seconds[rest] = max(0.0, wall - sum(inner.values()))


def describe(phases: dict[str, float], total: float | None = None) -> str:
    """``12.3 s: weights 4.1, memory_profile 2.0, ...`` (the INFO line's text)."""
    parts = ", ".join(f"{name} {seconds:.1f}" for name, seconds in phases.items())
    return parts if total is None else f"{total:.1f} s: {parts}"
