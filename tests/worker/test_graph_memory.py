"""The CUDA-graph memory estimate (``nvray/worker/memory.py``) and the graphs it captures for
it (``trial_graph_sizes`` in ``nvray/worker/startup.py``). The GPU tier checks the estimate
against real captures; here a stand-in device whose use grows by a set amount per capture pins
the count: the graphs that set the shared pool are counted once, every other graph (the
smallest included) at the smallest's cost."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nvray.worker import memory
from nvray.worker.startup import trial_graph_sizes

SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def _runner(scratch: dict[int, int], sizes: list[int] = SIZES) -> SimpleNamespace:
    return SimpleNamespace(graph_sizes=sizes, decode_scratch_bytes=lambda b: scratch.get(b, 0))


def test_the_graph_with_the_most_split_scratch_is_captured_between_largest_and_smallest():
    assert trial_graph_sizes(_runner({16: 5, 32: 9, 64: 12})) == [256, 64, 1]


@pytest.mark.parametrize("scratch,sizes", [({}, SIZES), ({1: 7}, SIZES), ({256: 7}, SIZES),
                                           ({}, [1])])
def test_no_third_graph_without_scratch_beyond_the_largest_and_smallest(scratch, sizes):
    assert trial_graph_sizes(_runner(scratch, sizes)) == [sizes[-1], sizes[0]]


@pytest.mark.parametrize("trials,expected", [
    ([256, 64, 1], 100 + 40 + 18 * 2),  # 2 graphs set the pool, 18 cost the smallest's 2
    ([256, 1], 100 + 19 * 2),
])
def test_estimate_counts_the_pool_once_and_the_smallest_for_every_other_graph(
        monkeypatch, trials, expected):
    used, cost = [1000], {256: 100, 64: 40, 1: 2}
    monkeypatch.setattr(memory, "measure_used", lambda device: used[0])
    monkeypatch.setattr(memory, "free_cached_memory", lambda: None)

    def capture_one(size: int) -> None:
        used[0] += cost[size]

    assert memory.graph_memory_estimate(capture_one, trials, 20, "cuda") == expected
