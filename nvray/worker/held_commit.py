"""HeldCommit: applies the kept rows of held chunks (``held_chunks.py`` says which) to every
recurrent layer's state before a step's forward (``GatedDeltaNet.commit_held``).

Eagerly, a commit is two kernels a layer (``kernels/gdn_commit.py``): 48 launches a step on
Qwen3.5-9B, on the host's critical path between speculative steps. On a GPU with CUDA graphs
they are one graph instead, captured with the step graphs (``capture``) for each of ``sizes``
entries (the verification graphs' batch sizes: a step commits one entry a sequence that drafted
in the step before, and no more sequences draft at once) over one static list; a step replays
the smallest that holds its entries, copied in from a pinned host buffer (reused once its last
copy is done), the rest count 0, which the kernels skip. Elsewhere (the CPU, ``enforce_eager``,
more entries than the largest size) the commits run eagerly over the step's entries.
"""

from __future__ import annotations

import bisect
from typing import Any

import torch

from nvray.worker.device_lists import to_device


class HeldCommit:
    def __init__(self, layers: list[Any], sizes: tuple[int, ...], device: torch.device) -> None:
        self.layers = layers  # the recurrent layers (GatedDeltaNet)
        self.sizes = sorted(sizes)  # entries of the graphs to capture (none: eager)
        self.device = device
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.lists: torch.Tensor | None = None  # [3, max size] int32: slots, starts, counts
        self.host: torch.Tensor | None = None  # its pinned twin
        self.copied: torch.cuda.Event | None = None  # the host buffer's last copy, done
        self.num_replays = 0

    def apply(self, commits: list[tuple[int, int, int]]) -> None:
        """Apply each ``(slot, start, count)``'s first ``count`` held rows to its slot."""
        if not commits:
            return
        at = bisect.bisect_left(self.sizes, len(commits))
        if not self.graphs or at == len(self.sizes):
            self._run(*to_device(list(zip(*commits)), self.device, torch.int32))
            return
        assert self.host is not None and self.lists is not None
        if self.copied is not None:
            self.copied.synchronize()  # the last step's entries are on the device
        self.host[2].zero_()
        self.host[:, :len(commits)] = torch.tensor(commits, dtype=torch.int32).T
        self.lists.copy_(self.host, non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()
        self.graphs[self.sizes[at]].replay()
        self.num_replays += 1

    def warm(self) -> None:
        """Compile the commit's kernels now, not at the first verified step (entries of the
        scratch row that keep nothing, laid out as the graphs' list is: the same alignment)."""
        if self._has_state():
            self._run(*self._padding(max(self.sizes, default=1)).to(self.device))

    def capture(self, pool: Any = None) -> None:
        """Capture every layer's commit as one graph for each size, over the static list (a
        GPU, after the states are allocated; the warm-up compiled the kernels)."""
        if not self.sizes or not self._has_state():
            return
        padding = self._padding(self.sizes[-1])
        self.lists, self.host = padding.to(self.device), padding.pin_memory()
        torch.cuda.synchronize(self.device)
        for size in self.sizes:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._run(*self.lists[:, :size])
            self.graphs[size] = graph

    def release(self) -> None:
        """Drop the graphs (the states they read are about to go)."""
        self.graphs = {}
        self.lists = self.host = self.copied = None

    def _has_state(self) -> bool:
        return bool(self.layers) and self.layers[0].conv_state.numel() > 0

    def _padding(self, num: int) -> torch.Tensor:
        """``num`` entries that keep nothing: the scratch row, count 0."""
        scratch = self.layers[0].conv_state.shape[0] - 1
        return torch.tensor([[scratch] * num, [1] * num, [0] * num], dtype=torch.int32)

    def _run(self, slots: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor) -> None:
        for layer in self.layers:
            layer.commit_held(slots, starts, counts)
