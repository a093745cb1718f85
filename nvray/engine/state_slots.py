"""StateSlots: recurrent-state slots of running sequences and the states prefix caching keeps
(models with linear-attention layers, ``nvray/layers/gated_deltanet.py``).

Contract:
- A sequence that holds blocks holds one of ``num_live`` slots (``Sequence.state_slot``),
  taken with its first blocks and given back with them. A fork copies its parent's state into
  its own slot (the state after the parent's ``num_computed_tokens``: a fork shares all of
  them). Copies wait in ``take_copies()`` for the next launched step, in the order they were
  made, so a row that is saved over after a hit was read by its copy first.
- A KV block holds its own tokens' keys and values, so a cached prefix is its blocks; a
  linear-attention layer's state holds the whole past in one tensor, so a prefix of ``k``
  blocks is served only where the state after exactly those tokens was kept. With prefix
  caching, the rows from ``num_live`` on keep such states (``PrefixStates``), each under the
  chained hash of the prefix's last block, least recently used first out.
- Save points: where a new sequence's prompt leaves the cached KV, if that is past the deepest
  kept state (after a system prompt an earlier prompt shared: the next prompt that shares it
  resumes there), and its prompt's last block boundary before the last prompt token (where the
  same prompt, or the conversation's next turn, would resume; one block earlier with
  ``hits_skip_last_block``, where such a hit ends). The scheduler ends a chunk at each
  (``Sequence.state_save_at``); the step after it copies the state into a kept row (``save``).
"""

from __future__ import annotations

from collections import OrderedDict

from nvray.engine.prefix_cache import CachedPrefix
from nvray.engine.sequence import Sequence


class PrefixStates:
    """Rows of kept states by the hash of the prefix they end: ``row_of`` finds one, ``use``
    marks a hit, ``save`` gives a row to a new state (a free row, else the least recently used
    one's)."""

    def __init__(self, rows: range) -> None:
        self.num_rows = len(rows)
        self.free_rows = list(reversed(rows))
        self.row_by_hash: OrderedDict[int, int] = OrderedDict()  # LRU first
        self.num_saved = 0
        self.num_evicted = 0

    def row_of(self, block_hash: int) -> int | None:
        return self.row_by_hash.get(block_hash)

    def use(self, block_hash: int) -> int:
        """The row of a hit, now the most recently used."""
        self.row_by_hash.move_to_end(block_hash)
        return self.row_by_hash[block_hash]

    def save(self, block_hash: int) -> int | None:
        """A row for the state after the prefix ending in ``block_hash`` (None: kept already)."""
        if block_hash in self.row_by_hash:
            self.row_by_hash.move_to_end(block_hash)
            return None
        if self.free_rows:
            row = self.free_rows.pop()
        else:
            _, row = self.row_by_hash.popitem(last=False)
            self.num_evicted += 1
        self.row_by_hash[block_hash] = row
        self.num_saved += 1
        return row


class StateSlots:
    def __init__(self, num_slots: int, num_live: int | None, enable_prefix_caching: bool,
                 block_size: int, num_groups: int, hits_skip_last_block: bool) -> None:
        """``num_slots``: every state row (0: no recurrent layers); the first ``num_live``
        (default: all) for running sequences, the rest for prefix caching's kept states."""
        live = num_slots if num_live is None else min(num_live, num_slots)
        self.num_slots, self.num_live = num_slots, live
        self.free_slots = list(range(live - 1, -1, -1))  # pop() takes slot 0 first
        self.copies: list[tuple[int, int]] = []  # (src, dst) rows not yet launched
        saves = enable_prefix_caching and num_slots > live
        self.prefix_states = PrefixStates(range(live, num_slots)) if saves else None
        self.block_size, self.num_groups = block_size, num_groups
        self.hits_skip_last_block = hits_skip_last_block

    @property
    def caches_prefixes(self) -> bool:
        """Can a prefix be served (no recurrent layers, or states kept for it)?"""
        return not self.num_slots or self.prefix_states is not None

    def has_free(self) -> bool:
        """Can one more sequence hold a slot (always, without recurrent layers)?"""
        return not self.num_slots or bool(self.free_slots)

    def take(self, seq: Sequence) -> None:
        if self.num_slots:
            assert self.free_slots, "no free state slot (check has_state_slot first)"
            seq.state_slot = self.free_slots.pop()

    def give_back(self, seq: Sequence) -> None:
        if seq.state_slot >= 0:
            self.free_slots.append(seq.state_slot)
            seq.state_slot = seq.state_save_at = -1

    def fork(self, child: Sequence, parent: Sequence, num_tokens: int) -> None:
        """``child`` shares ``parent``'s first ``num_tokens`` tokens: a slot with its state."""
        if self.num_slots:
            assert num_tokens == parent.num_computed_tokens, (
                "a fork of a model with recurrent state shares all of its parent's tokens")
            self.take(child)
            self.copies.append((parent.state_slot, child.state_slot))

    def take_copies(self) -> list[tuple[int, int]]:
        """The state copies since the last call (the next launched step makes them)."""
        copies, self.copies = self.copies, []
        return copies

    def deepest_kept(self, cached: CachedPrefix) -> CachedPrefix:
        """The longest part of a cached KV prefix whose state at its end is kept."""
        if self.prefix_states is None:
            return cached
        kv_tokens = cached.num_blocks * self.block_size
        for k in range(cached.num_blocks, 0, -1):
            row = self.prefix_states.row_of(cached.hashes[k - 1])
            if row is not None:
                return CachedPrefix(cached.blocks[:k * self.num_groups], cached.hashes[:k], row, kv_tokens)
        return CachedPrefix([], [], -1, kv_tokens)

    def start(self, seq: Sequence, cached: CachedPrefix) -> None:
        """``seq`` starts from ``cached`` (its computed tokens set): a slot, the prefix's kept
        state copied into it, and its first save point."""
        self.take(seq)
        if cached.state_row >= 0:
            self.prefix_states.use(cached.hashes[-1])  # type: ignore[union-attr]
            self.copies.append((cached.state_row, seq.state_slot))
        seq.state_save_at = self.save_point(seq, seq.num_computed_tokens, cached.kv_cached_tokens)

    def save_point(self, seq: Sequence, start: int, diverges_at: int = 0) -> int:
        """Where ``seq``'s state is next to be kept, for a sequence computed up to ``start``
        (-1: nowhere further; no prefix caching of states): where it diverges from the cached
        KV (``diverges_at``, ``CachedPrefix.kv_cached_tokens``), else its prompt's last block
        boundary before its last token (a block before it where hits leave their last block
        out)."""
        if self.prefix_states is None:
            return -1
        blocks = (seq.num_prompt_tokens - 1) // self.block_size - self.hits_skip_last_block
        last = blocks * self.block_size
        point = diverges_at if start < diverges_at < last else last
        return point if point > start else -1

    def save(self, seq: Sequence, prefix_hash: int) -> None:
        """``seq`` has computed up to its save point, whose prefix hashes to ``prefix_hash``, in
        the step just launched: the next step copies its state into a row kept under that hash;
        its next save point is set."""
        seq.state_save_at = self.save_point(seq, seq.state_save_at)
        row = self.prefix_states.save(prefix_hash)  # type: ignore[union-attr]
        if row is not None:
            self.copies.append((seq.state_slot, row))
