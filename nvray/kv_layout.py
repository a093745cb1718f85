"""KVLayout: which attention layers share a block table, and how a KV block is laid out.

The cache spec of a layer is its attention window (None: full attention; W: the last W
positions, Gemma 3's local layers, Mistral's sliding window). Layers of one kind need the same
blocks, so they share a block table; layers of different kinds do not: a full-attention layer
keeps every block of a sequence, a windowed layer only the blocks its window reaches, and the
engine frees the others as the sequence grows (``nvray/engine/block_manager.py``).

The layers are split into **groups** of ``slots_per_block`` layers of one kind each (a kind's
last group padded with empty slots where its count does not divide), and every group has a
block table. One pool of physical blocks serves all groups: a block holds the KV of
``slots_per_block`` layers (slot ``j`` of the group whose table lists it), so a freed block
of a windowed group can be taken by a full-attention group and back, and the pool is shared out
by the workload, not by a fixed split. A model whose layers are all of one kind has one group
of all its layers: the layout every model had before windows were freed.

A sequence's block table is flat, ``num_groups`` entries per logical block (entry
``b * num_groups + g`` is group ``g``'s block for positions ``b * block_size`` onwards), so the
step protocol's table changes (``table_start``) stay one list. An entry -1 is a block a
windowed group no longer holds (or never needed: a prefix-cache hit's blocks before the
window); attention never reads it (``nvray/layers/attention.py``). Groups are ordered full
attention first, then by window.

Both the engine (block accounting) and the ranks (cache allocation, slot mapping) read it:
``plan_kv_layout(windows)`` is the one place the layout is decided.
"""

from __future__ import annotations

from typing import NamedTuple


class KVLayout(NamedTuple):
    group_windows: tuple[int | None, ...]  # per group: its layers' window (None: full)
    layer_slots: tuple[tuple[int, int], ...]  # per attention layer: (group, slot)
    slots_per_block: int  # layers a physical block holds

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)


def _kind_order(window: int | None) -> tuple[int, int]:
    return (0, 0) if window is None else (1, window)


def plan_kv_layout(windows: list[int | None]) -> KVLayout:
    """The layout of layers whose windows are ``windows`` (one per attention layer, in order).

    Groups hold as many layers as the rarest kind has (Gemma 3 12B's 8 global and 40 local
    layers: one full-attention group and five windowed groups of 8), so no kind pads more than
    one group."""
    assert windows, "a model needs at least one attention layer"
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        kinds.setdefault(window or None, []).append(layer)
    size = min(len(layers) for layers in kinds.values())
    group_windows: list[int | None] = []
    slots: dict[int, tuple[int, int]] = {}
    for window in sorted(kinds, key=_kind_order):
        layers = kinds[window]
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start:start + size]):
                slots[layer] = (len(group_windows), slot)
            group_windows.append(window)
    return KVLayout(tuple(group_windows), tuple(slots[i] for i in range(len(windows))), size)


def first_needed_block(window: int | None, start: int, block_size: int) -> int:
    """The first logical block a query at position ``start`` (and every later one) reads in a
    group of this window: 0 for full attention, else the block of position start - W + 1."""
    if window is None:
        return 0
    return max(0, start - window + 1) // block_size


def peak_blocks(group_windows: tuple[int | None, ...], num_tokens: int, block_size: int,
                chunk_tokens: int) -> int:
    """The most physical blocks one sequence of ``num_tokens`` tokens holds at once, computed
    in steps of at most ``chunk_tokens`` tokens: every block in a full-attention group, in a
    windowed group those a step's window and tokens span."""
    logical = -(-num_tokens // block_size)
    return sum(logical if w is None
               else min(logical, -(-(w - 1 + chunk_tokens) // block_size) + 1)
               for w in group_windows)
