"""LoRABatch: which adapter slot each row of a step's forward uses, as the LoRA kernels read it.

One per rank, shared by every adapted projection. ``prepare(token_slots, token_rows)`` takes the
slot of each of the step's tokens (-1: the base model) and, where the forward lays tokens out
with padding (a verification graph), the row each token sits at. It writes:

- ``rows``: the rows of the adapter tokens, grouped by slot;
- ``tiles`` (``[3, max_tiles]``): the work of the kernels, in tiles of at most ``TILE_ROWS``
  rows of one slot: each tile's slot (-1: no work), its first entry in ``rows`` and its number
  of rows. A step of T rows has at most ``max_tiles_for(T)`` tiles (each slot's last tile may
  be partial), so the kernels launch that many programs along the rows whatever the mix;

into one device buffer whose address never changes, so CUDA graphs captured over it serve
every step: a replay's LoRA kernels read the tiles of its step, and a step without adapter
tokens has none (every tile -1). The host side is one pinned buffer and one non-blocking copy
per step that has adapter tokens (or follows one), guarded by an event as ``InputBuilder``'s is.

``launches`` says whether the projections run the LoRA ops this forward: on the GPU always
(the kernels of a step without adapter tokens return at once; so the warm-up compiles them and
every graph captures them), on the CPU only for a step with adapter tokens.
"""

from __future__ import annotations

import numpy as np
import torch

TILE_ROWS = 16  # rows of one slot a kernel program takes (the kernels' BLOCK_M)


def max_tiles_for(num_rows: int, num_slots: int) -> int:
    return -(-num_rows // TILE_ROWS) + num_slots


class LoRABatch:
    def __init__(self, num_slots: int, capacity: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.capacity = capacity  # rows a forward may have
        self.max_tiles = max_tiles_for(capacity, num_slots)
        size = 3 * self.max_tiles + capacity
        self.cuda = device.type == "cuda"
        self.device_buffer = torch.zeros(size, dtype=torch.int32, device=device)
        self.device_buffer[:self.max_tiles] = -1
        with torch.inference_mode(False):
            self.host = (torch.zeros(size, dtype=torch.int32, pin_memory=True) if self.cuda
                         else self.device_buffer)
            self.host[:self.max_tiles] = -1
        self.host_np = self.host.numpy()
        self.tiles = self.device_buffer[:3 * self.max_tiles].view(3, self.max_tiles)
        self.rows = self.device_buffer[3 * self.max_tiles:]
        self.copy_done = torch.cuda.Event() if self.cuda else None
        self.has_tokens = False  # this step has adapter tokens
        self.num_tiles = 0  # tiles written (the device's first num_tiles tile slots are >= 0)

    def tiles_for(self, num_rows: int) -> torch.Tensor:
        """The tiles a forward of ``num_rows`` rows reads (as many as it can have)."""
        return self.tiles[:, :max_tiles_for(num_rows, self.num_slots)]

    @property
    def launches(self) -> bool:
        return self.has_tokens or self.cuda

    def prepare(self, token_slots: list[int] | None, token_rows: list[int] | None = None) -> None:
        """The step's tokens' slots (-1: base), in step order, and their rows in the forward
        (None: token i at row i)."""
        slots = np.asarray(token_slots if token_slots else (), dtype=np.int64)
        adapted = slots >= 0
        self.has_tokens = bool(adapted.any())
        if not self.has_tokens and not self.num_tiles:
            return
        if self.copy_done is not None:
            self.copy_done.synchronize()  # the previous step's copy has left the host buffer
        m, a = self.max_tiles, self.host_np
        old = self.num_tiles
        if not self.has_tokens:
            a[:old] = -1
            self.num_tiles = 0
            self._upload(0)
            return
        rows = np.arange(len(slots)) if token_rows is None else np.asarray(token_rows)
        slots, rows = slots[adapted], rows[adapted]
        order = np.argsort(slots, kind="stable")
        counts = np.bincount(slots, minlength=self.num_slots)
        starts = np.cumsum(counts) - counts
        per_slot = -(-counts // TILE_ROWS)  # tiles of each slot
        tile_slot = np.repeat(np.arange(self.num_slots), per_slot)
        first_tile = np.cumsum(per_slot) - per_slot
        within = np.arange(len(tile_slot)) - np.repeat(first_tile, per_slot)  # tile index in slot
        tile_start = np.repeat(starts, per_slot) + within * TILE_ROWS
        tile_len = np.minimum(TILE_ROWS, np.repeat(counts, per_slot) - within * TILE_ROWS)
        n = len(tile_slot)
        a[:n], a[m:m + n], a[2 * m:2 * m + n] = tile_slot, tile_start, tile_len
        a[n:old] = -1  # the previous step's tiles past these
        a[3 * m:3 * m + len(rows)] = rows[order]
        self.num_tiles = n
        self._upload(len(rows))

    def _upload(self, num_rows: int) -> None:
        """The tiles and the first ``num_rows`` rows, in one copy."""
        if self.cuda:
            n = 3 * self.max_tiles + num_rows
            self.device_buffer[:n].copy_(self.host[:n], non_blocking=True)
            self.copy_done.record()  # type: ignore[union-attr]
