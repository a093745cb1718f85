"""LoRAWeights: one projection's adapter slots, sharded as the projection is.

For a projection fusing ``n`` checkpoint modules (q/k/v, gate/up; one for the others) and
``max_loras`` slots of rank up to ``R``:

- ``a``: ``[max_loras, n * R, in]``, slice ``j``'s A in rows ``j*R .. j*R + r`` (zeros past its
  rank, and for a module the adapter leaves alone);
- ``b``: ``[max_loras, out, R]``, slice ``j``'s B (times its scaling) in the rows of the
  projection's output that slice fills.

``slices`` are ``(h_col, y_col, width)`` for the expand of each slice (``ops.py``).

Under tensor parallelism the slots split as the weight does: a column-parallel projection
(q/k/v, gate/up) keeps A whole and its rank's rows of B (the projection's own ``weight_loader``
cuts them, so KV heads replicated over ranks get the same rows as the weight); a row-parallel
one (o_proj, down_proj) keeps its rank's columns of A and B whole, and its delta, computed from
the rank's part of the input, is a partial sum that the reduction of the projection's output
adds up with the rest.
"""

from __future__ import annotations

import torch

from nvray.layers.linear import (ColumnParallelLinear, LinearBase, MergedColumnParallelLinear,
                                 QKVParallelLinear, RowParallelLinear)
from nvray.lora.batch import LoRABatch
from nvray.lora.ops import add_lora


def slice_ids(layer: LinearBase) -> list[object]:
    """The ``shard_id`` of each fused part, in output order (None: a single module)."""
    if type(layer) is QKVParallelLinear:
        return ["q", "k", "v"]
    if type(layer) is MergedColumnParallelLinear:
        return list(range(len(layer.output_sizes)))
    return [None]


def full_shape(layer: LinearBase, shard_id: object) -> tuple[int, int]:
    """(in, out) features of the checkpoint module of ``shard_id``, unsharded."""
    if type(layer) is QKVParallelLinear:
        heads = layer.total_num_heads if shard_id == "q" else layer.total_num_kv_heads
        return layer.weight.shape[1], heads * layer.head_dim
    if type(layer) is MergedColumnParallelLinear:
        return layer.weight.shape[1], layer.output_sizes[shard_id]  # type: ignore[index]
    if type(layer) is ColumnParallelLinear:
        return layer.weight.shape[1], layer.full_out
    assert type(layer) is RowParallelLinear
    return layer.full_in, layer.weight.shape[0]


def _local_widths(layer: LinearBase) -> list[int]:
    if type(layer) is QKVParallelLinear:
        q, kv = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
        return [q, kv, kv]
    if type(layer) is MergedColumnParallelLinear:
        return list(layer.local_sizes)
    return [layer.weight.shape[0]]


class LoRAWeights:
    def __init__(self, layer: LinearBase, max_loras: int, max_rank: int, batch: LoRABatch
                 ) -> None:
        self.layer = layer
        self.batch = batch
        self.rank = max_rank
        self.row_parallel = type(layer) is RowParallelLinear
        self.shard_ids = slice_ids(layer)
        widths = _local_widths(layer)
        out_local, in_local = layer.weight.shape
        n, dtype, device = len(widths), layer.weight.dtype, layer.weight.device
        self.a = torch.zeros(max_loras, n * max_rank, in_local, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, out_local, max_rank, dtype=dtype, device=device)
        offsets = [sum(widths[:j]) for j in range(n)]
        self.slices = [(j * max_rank, offsets[j], widths[j]) for j in range(n)]

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return add_lora(x, y, self, self.batch)

    def write(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor, float]]
              ) -> None:
        """Put one adapter into ``slot``: ``parts`` maps a fused part to its full (unsharded)
        A [r, in], B [out, r] and scaling, in host memory (pinned for a GPU); the parts left
        out and the ranks past a part's are zero. Shaped on the slots' device, in stream order
        (after the steps launched before, which may still read the slot's old adapter)."""
        a_slot, b_slot = self.a[slot], self.b[slot]
        a_slot.zero_()
        b_slot.zero_()
        R, device = self.rank, self.a.device
        for part, (a, b, scaling) in parts.items():
            a = a.to(device, non_blocking=True)
            b = b.to(device, non_blocking=True).float() * scaling
            r = a.shape[0]
            a_dst = _Target(a_slot[part * R:part * R + r])
            if self.row_parallel:  # A split along its input features, as the weight is
                self.layer.weight_loader(a_dst, a)
                b_slot[:, :r].copy_(b)
                continue
            a_dst.data.copy_(a)
            shard_id = self.shard_ids[part]
            args = () if shard_id is None else (shard_id,)
            self.layer.weight_loader(_Target(b_slot[:, :r]), b, *args)


class _Target:
    """A slot's A or B, as a projection's ``weight_loader`` writes a parameter (``.data``,
    ``.shape``, ``.dim()``): it cuts this rank's shard into it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.data = tensor
        self.shape = tensor.shape

    def dim(self) -> int:
        return self.data.dim()
