"""LoRABatch: which adapter slot each row of a step's forward uses, as the LoRA kernels read it.

One per rank, shared by every adapted projection. ``prepare(token_slots, token_rows)`` takes the
slot of each of the step's tokens (-1: the base model) and, where the forward lays tokens out
with padding (a verification graph), the row each token sits at; it writes ``rows`` (the rows
of adapter tokens grouped by slot), ``counts`` and ``starts`` (per slot) into one device buffer
whose address never changes, so CUDA graphs captured over it serve every step: a graph's LoRA
kernels read the counts each replay, and zero counts make them return at once. The host side is
one pinned buffer and one non-blocking copy per step that has adapter tokens (or follows one),
guarded by an event as ``InputBuilder``'s is.

``launches`` says whether the projections run the LoRA ops this forward: on the GPU always
(the kernels of a step without adapter tokens return at once; so the warm-up compiles them and
every graph captures them), on the CPU only for a step with adapter tokens.
"""

from __future__ import annotations

import numpy as np
import torch


class LoRABatch:
    def __init__(self, num_slots: int, capacity: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.capacity = capacity  # rows a forward may have
        size = 2 * num_slots + capacity
        self.cuda = device.type == "cuda"
        self.device_buffer = torch.zeros(size, dtype=torch.int32, device=device)
        with torch.inference_mode(False):
            self.host = (torch.zeros(size, dtype=torch.int32, pin_memory=True) if self.cuda
                         else self.device_buffer)
        self.host_np = self.host.numpy()
        self.counts = self.device_buffer[:num_slots]
        self.starts = self.device_buffer[num_slots:2 * num_slots]
        self.rows = self.device_buffer[2 * num_slots:]
        self.copy_done = torch.cuda.Event() if self.cuda else None
        self.has_tokens = False  # this step has adapter tokens
        self.counts_written = False  # the device counts may be non-zero

    @property
    def launches(self) -> bool:
        return self.has_tokens or self.cuda

    def prepare(self, token_slots: list[int] | None, token_rows: list[int] | None = None) -> None:
        """The step's tokens' slots (-1: base), in step order, and their rows in the forward
        (None: token i at row i)."""
        slots = np.asarray(token_slots if token_slots else (), dtype=np.int64)
        adapted = slots >= 0
        self.has_tokens = bool(adapted.any())
        if not self.has_tokens and not self.counts_written:
            return
        if self.copy_done is not None:
            self.copy_done.synchronize()  # the previous step's copy has left the host buffer
        s, a = self.num_slots, self.host_np
        if not self.has_tokens:
            a[:s] = 0
            self._upload(s)
            self.counts_written = False
            return
        rows = np.arange(len(slots)) if token_rows is None else np.asarray(token_rows)
        slots, rows = slots[adapted], rows[adapted]
        order = np.argsort(slots, kind="stable")
        counts = np.bincount(slots, minlength=s)
        a[:s] = counts
        a[s:2 * s] = np.cumsum(counts) - counts
        a[2 * s:2 * s + len(rows)] = rows[order]
        self._upload(2 * s + len(rows))
        self.counts_written = True

    def _upload(self, n: int) -> None:
        if self.cuda:
            self.device_buffer[:n].copy_(self.host[:n], non_blocking=True)
            self.copy_done.record()  # type: ignore[union-attr]
