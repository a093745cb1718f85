"""The batched LoRA delta of one projection: ``y[t] += (x[t] @ A[slot(t)].T) @ B[slot(t)].T``.

``add_lora(x, y, weights, batch)`` adds every token's delta through its adapter's slot
(``batch``: the step's token -> slot map, ``batch.py``; ``weights``: the projection's slots,
``weights.py``), every slice of a fused projection in one expand, in place, and returns ``y``.
On CUDA tensors it runs the Triton shrink/expand kernels (``kernels/lora.py``, which CUDA graphs
capture); elsewhere ``shrink_torch`` / ``expand_torch`` (a slot's rows at once).
On the CPU a step without adapter tokens skips it all; on the GPU the kernels always run (and
return at once without adapter tokens), so CUDA graphs hold them and read each replay's counts.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from nvray.lora.batch import TILE_ROWS, LoRABatch

_triton: Any = None  # kernels.lora, imported on the first CUDA call


def _groups(rows: torch.Tensor, tiles: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """Each slot's rows, from the tiles (a slot's tiles are consecutive in ``rows``)."""
    runs: dict[int, list[int]] = {}
    for slot, start, n in zip(*tiles.tolist()):
        if slot >= 0:
            run = runs.setdefault(slot, [start, start])
            run[1] = start + n
    for slot, (start, end) in runs.items():
        yield slot, rows[start:end].long()


def shrink_torch(x: torch.Tensor, a: torch.Tensor, h: torch.Tensor, rows: torch.Tensor,
                 tiles: torch.Tensor) -> None:
    """``h[0, t] = x[t] @ a[slot(t)].T`` (float32) for the grouped rows, the other parts zero
    (``h``: [splits, T, N] partial sums)."""
    h[1:] = 0
    for slot, idx in _groups(rows, tiles):
        h[0, idx] = x[idx].float() @ a[slot].float().T


def expand_torch(h: torch.Tensor, b: torch.Tensor, y: torch.Tensor, rows: torch.Tensor,
                 tiles: torch.Tensor, slices: list[tuple[int, int, int]]) -> None:
    """For each ``(h_col, y_col, width)`` of ``slices``:
    ``y[t, y_col:+width] += h.sum(0)[t, h_col:+R] @ b[slot(t), y_col:+width].T``, rounded once."""
    r = b.shape[2]
    for slot, idx in _groups(rows, tiles):
        hs = h[:, idx].sum(0)
        for h_col, y_col, width in slices:
            delta = hs[:, h_col:h_col + r] @ b[slot, y_col:y_col + width].float().T
            y[idx, y_col:y_col + width] = (y[idx, y_col:y_col + width].float()
                                           + delta).to(y.dtype)


def add_lora(x: torch.Tensor, y: torch.Tensor, weights: Any, batch: LoRABatch) -> torch.Tensor:
    """``weights``: a projection's ``LoRAWeights`` (its ``a``, ``b`` and ``slices``)."""
    if not batch.launches:
        return y
    global _triton
    if x.is_cuda and _triton is None:
        import kernels.lora as _triton  # noqa: PLC0415
    rows, tiles = batch.rows, batch.tiles_for(x.shape[0])
    splits = _triton.shrink_splits(x.shape[0], x.shape[1], TILE_ROWS) if x.is_cuda else 1
    h = torch.empty(splits, x.shape[0], weights.a.shape[1], dtype=torch.float32,
                    device=x.device)
    if x.is_cuda:
        _triton.lora_shrink(x, weights.a, h, rows, tiles, TILE_ROWS)
        _triton.lora_expand(h, weights.b, y, rows, tiles, weights.slices, TILE_ROWS)
        return y
    shrink_torch(x, weights.a, h, rows, tiles)
    expand_torch(h, weights.b, y, rows, tiles, weights.slices)
    return y
