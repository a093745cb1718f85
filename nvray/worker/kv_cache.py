"""A rank's caches, one class per cache kind: their bytes, allocation and copies.

Two kinds, each a set of tensors whose first dimension is the unit the engine hands out
(``nvray/engine/block_manager.py``), so every kind copies its units the same way
(``copy``: copy-on-write of blocks, forks and saved prefixes of states), and moving units to
and from host memory has one place to go:
- ``PagedKV``: attention blocks. One K and one V tensor per slot of the KV layout
  (``nvray/kv_layout.py``), shared by the layers of that slot in every group (one group: a
  tensor per layer); a unit is a block of ``block_size`` tokens. Full-attention and windowed
  groups are one kind: they share the pool and differ only in which blocks the engine frees.
- ``StateRows``: recurrent state (linear-attention layers, ``nvray/layers/gated_deltanet.py``);
  a unit is one row of every layer's state tensors (a running sequence's slot or a kept prefix
  state), its size fixed whatever the sequence's length.

``RankCaches`` holds a rank's kinds; the drafter's twin of each block is its own ``PagedKV``
(``nvray/worker/drafter.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from nvray.kv_layout import KVLayout
from nvray.worker.device_lists import copy_cache_blocks


class PagedKV:
    def __init__(self, layers: list[Any], layout: KVLayout, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.layers, self.layout = layers, layout
        self.block_size, self.dtype, self.device = block_size, dtype, device
        self.num_blocks = 0
        self.tensors: list[torch.Tensor] = []  # every K and V tensor of the cache, once

    @property
    def block_bytes(self) -> int:
        """A physical block: ``block_size`` tokens' K and V in each slot of the layout (the
        layers of a slot have one shape: ``allocate`` checks it)."""
        per_slot: dict[int, int] = {}
        for layer, (_, slot) in zip(self.layers, self.layout.layer_slots):
            per_slot[slot] = max(per_slot.get(slot, 0), 2 * layer.num_kv_heads * layer.head_dim)
        return self.block_size * sum(per_slot.values()) * self.dtype.itemsize

    def allocate(self, num_blocks: int) -> None:
        """A zeroed cache of ``num_blocks`` blocks (0: none), set on the layers."""
        self.num_blocks = num_blocks
        for layer in self.layers:
            layer.k_cache = layer.v_cache = torch.empty(0)  # free the old cache first
        pools: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer, (_, slot) in zip(self.layers, self.layout.layer_slots):
            shape = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            if slot not in pools:
                pools[slot] = (torch.zeros(shape, dtype=self.dtype, device=self.device),
                               torch.zeros(shape, dtype=self.dtype, device=self.device))
            assert pools[slot][0].shape == shape, (
                f"layers sharing KV slot {slot} differ in shape: {tuple(pools[slot][0].shape)} "
                f"and {shape}")
            layer.k_cache, layer.v_cache = pools[slot]
        self.tensors = [cache for pool in pools.values() for cache in pool]

    def copy(self, copies: list[tuple[int, int]]) -> None:
        """Each (src, dst) block's KV, in every layer."""
        copy_cache_blocks(self.tensors, copies, self.device)


class StateRows:
    def __init__(self, layers: list[Any], dtype: torch.dtype, device: torch.device,
                 held_rows: int) -> None:
        """``held_rows``: a verified chunk's rows each row holds (speculation, held_chunks.py)."""
        self.layers, self.dtype, self.device, self.held_rows = layers, dtype, device, held_rows
        self.tensors: list[torch.Tensor] = []  # every recurrent layer's state tensors

    @property
    def row_bytes(self) -> int:
        """One row of every recurrent layer of this rank (and its held rows)."""
        return sum(layer.state_bytes(self.dtype, self.held_rows) for layer in self.layers)

    def allocate(self, rows: int) -> None:
        for layer in self.layers:
            layer.allocate_state(rows, self.dtype, self.device, self.held_rows)
        self.tensors = [t for layer in self.layers for t in layer.state_tensors()]

    def copy(self, copies: list[tuple[int, int]]) -> None:
        """Each (src, dst) row's state, in every layer."""
        copy_cache_blocks(self.tensors, copies, self.device)  # a row: a row of each tensor


class RankCaches:
    """A rank's attention blocks and state rows, allocated together."""

    def __init__(self, kv: PagedKV, states: StateRows) -> None:
        self.kv, self.states = kv, states

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    def allocate(self, num_blocks: int, state_rows: int) -> None:
        """``num_blocks`` blocks and ``state_rows`` state rows (none with no blocks)."""
        self.states.allocate(state_rows if num_blocks else 0)
        self.kv.allocate(num_blocks)
