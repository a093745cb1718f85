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

    def image(self, parts: dict[int, tuple[torch.Tensor, torch.Tensor]]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One slot's A and B as this rank holds them, in host memory (pinned for a GPU):
        ``parts`` maps a fused part to its full (unsharded) A [r, in] and scaled B [out, r];
        the parts left out stay zero."""
        pin = self.a.device.type == "cuda"
        a_img = torch.zeros(self.a.shape[1:], dtype=self.a.dtype, pin_memory=pin)
        b_img = torch.zeros(self.b.shape[1:], dtype=self.b.dtype, pin_memory=pin)
        R = self.rank
        for part, (a, b) in parts.items():
            r = a.shape[0]
            a_pad = torch.zeros(R, a.shape[1], dtype=self.a.dtype)
            a_pad[:r] = a
            b_pad = torch.zeros(b.shape[0], R, dtype=self.b.dtype)
            b_pad[:, :r] = b
            a_dst = a_img[part * R:(part + 1) * R]
            if self.row_parallel:  # A split along its input features, as the weight is
                self.layer.weight_loader(_Target(a_dst), a_pad)
                b_img.copy_(b_pad)
                continue
            a_dst.copy_(a_pad)
            shard_id = self.shard_ids[part]
            args = () if shard_id is None else (shard_id,)
            self.layer.weight_loader(_Target(b_img), b_pad, *args)
        return a_img, b_img

    def write(self, slot: int, image: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Copy a slot's ``image`` in (stream-ordered: after the steps launched before)."""
        self.a[slot].copy_(image[0], non_blocking=True)
        self.b[slot].copy_(image[1], non_blocking=True)


class _Target:
    """A slot's A or B, as a projection's ``weight_loader`` writes a parameter (``.data``,
    ``.shape``, ``.dim()``): it cuts this rank's shard into it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.data = tensor
        self.shape = tensor.shape

    def dim(self) -> int:
        return self.data.dim()
