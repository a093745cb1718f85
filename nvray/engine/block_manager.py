"""BlockManager: paged KV blocks with reference counts and a prefix cache.

Contract:
- A block is owned by every running sequence whose block table lists it (``ref_count``).
- Prefix caching: a block that is full *and whose KV has been written* gets a chained hash
  (xxh64 of the previous block's hash and its token ids) and goes into ``hash_to_block``.
  A lookup also compares token ids, so a hash collision can never serve the wrong KV.
  A sequence with a LoRA adapter chains from the adapter's ``cache_salt`` instead of 0, so
  its KV is never served to the base model or another adapter (``_root``).
- A freed block keeps its hash and content; free blocks are evicted least recently freed first
  (blocks holding no cached content go first of all). Reusing a block drops its stale hash.
- At most ``(num_tokens - 1) // block_size`` blocks of a sequence are served from the cache,
  so the model always has at least one token to compute (never a zero-length query). With
  ``hits_skip_last_block`` (an EAGLE-3 drafter, whose row at a block's last position holds the
  next block's first token) a cached prefix is served without its last block, which the
  sequence computes again in a block of its own.
- Forks: ``fork`` gives a sequence another's blocks up to a token count (ref counted, never
  copied). Copy-on-write: before a sequence writes into a block it shares (a fork's partly
  filled last block), it gets a private copy; the (source, copy) pair waits in
  ``take_copies()`` for the step that must copy the KV before it writes.
- Windowed layers (``nvray/kv_layout.py``): a sequence's table holds one entry per group for
  each logical block (entry ``b * num_groups + g``). A group of window W needs only the blocks
  from the one holding position ``start - W + 1`` on, ``start`` being the next token to compute;
  ``release_out_of_window`` gives the others back (their entries become -1) as the sequence
  grows, so a long sequence of a model with local layers holds a window's worth of blocks in
  those layers. A windowed group's blocks are cached under the group's own key; a cached prefix
  is served only where every group holds what its window needs after it (a full group: all its
  blocks; a windowed group: the blocks its window reaches back to), the others -1.
- Recurrent state (models with linear-attention layers): besides its blocks, a sequence that
  holds blocks holds one of ``num_live_states`` state slots (``Sequence.state_slot``), taken
  with its first blocks and given back with them. A fork copies its parent's state into its
  own slot (the pair waits in ``take_state_copies()``; the state is the parent's after
  ``num_computed_tokens``, so a fork shares all of the parent's computed tokens). A slot's
  state describes the sequence's whole past, not one block: with prefix caching, the slots
  from ``num_live_states`` on keep states at block boundaries (``PrefixStates``). A new
  sequence's save points are where its prompt leaves the cached KV, if that is past the deepest
  kept state (after a system prompt an earlier prompt shared: the next prompt that shares it
  resumes there), and its prompt's last block boundary before the last prompt token (where the
  same prompt, or the conversation's next turn, would resume; one block earlier with
  ``hits_skip_last_block``, where such a hit ends); the scheduler ends a chunk at
  each (``state_save_point``), and the step after it copies the state into a row kept under that
  block's hash (``save_state``).
  A cached prefix is served to the deepest block whose state is kept (its KV blocks cached
  too); the sequence's slot gets that state copied in before its first step.
- The ranks keep each sequence's block table between steps and get only its changes
  (``nvray/step_protocol.py``): a sequence's ``ranks_table_len`` counts the leading entries they hold,
  and this class lowers it where it changes an entry (a copy-on-write, a new table); a freed
  sequence waits in ``take_released()`` for the step that tells the ranks to drop its table.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import NamedTuple

import xxhash

from nvray.engine.prefix_states import PrefixStates
from nvray.engine.sequence import Sequence
from nvray.kv_layout import first_needed_block

_ROOT_HASH = 0


def _chain(prev_hash: int, block_bytes: bytes) -> int:
    return xxhash.xxh64_intdigest(prev_hash.to_bytes(8, "little") + block_bytes)


def _root(seq: Sequence) -> int:
    """Where the chained hashes of ``seq``'s blocks start: its adapter's salt, or 0."""
    return _ROOT_HASH if seq.lora is None else seq.lora.cache_salt


def hash_block(prev_hash: int, token_ids: list[int]) -> int:
    """Chained hash of one full block: depends on every token before it."""
    return _chain(prev_hash, array("q", token_ids).tobytes())


def group_key(block_hash: int, group: int) -> int:
    """The prefix-cache key of a group's block of this chained hash (group 0: the hash)."""
    return block_hash if group == 0 else _chain(block_hash, group.to_bytes(4, "little"))


def hash_blocks(prev_hash: int, token_ids: list[int], block_size: int) -> list[int]:
    """``hash_block`` of each of the consecutive full blocks of ``token_ids`` (a whole number
    of blocks), chained from ``prev_hash``: one conversion of the tokens for the whole run."""
    data, width, hashes = array("q", token_ids).tobytes(), 8 * block_size, []
    for start in range(0, len(data), width):
        prev_hash = _chain(prev_hash, data[start:start + width])
        hashes.append(prev_hash)
    return hashes


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "drafted", "drafted_next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None  # its prefix-cache key (``group_key``)
        self.token_ids: tuple[int, ...] | None = None
        self.drafted = False  # the draft cache's twin holds its tokens' rows (``mark_drafted``)
        self.drafted_next = -1  # the token after it when they were fed (a head's last row's)


class CachedPrefix(NamedTuple):
    """A cached prefix of a waiting sequence: its table entries (``num_groups`` per logical
    block, -1 where a windowed group needs none), the chained hash of each logical block, and
    (models with recurrent state) the prefix-state row holding the state at its end and how
    many tokens' KV is cached (deeper than the prefix where no state is kept there: where an
    earlier prompt diverged from this one, e.g. after a shared system prompt)."""

    blocks: list[int]
    hashes: list[int]
    state_row: int = -1
    kv_cached_tokens: int = 0

    @property
    def num_blocks(self) -> int:
        """Logical blocks (positions ``num_blocks * block_size`` are cached)."""
        return len(self.hashes)


NO_PREFIX = CachedPrefix([], [])


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 group_windows: tuple[int | None, ...] = (None,), num_state_slots: int = 0,
                 num_live_states: int | None = None, hits_skip_last_block: bool = False) -> None:
        """``group_windows``: the window of each block-table group (``KVLayout``);
        ``num_state_slots``: recurrent-state slots (0: the model has no recurrent layers), the
        first ``num_live_states`` (default: all) for running sequences, the rest for prefix
        caching's saved states; ``hits_skip_last_block``: see the module docstring."""
        assert num_blocks >= 1 and block_size >= 1, "need at least one block of one slot"
        self.block_size = block_size
        self.num_blocks = num_blocks
        live = num_state_slots if num_live_states is None else min(num_live_states, num_state_slots)
        self.num_state_slots, self.num_live_states = num_state_slots, live
        self.free_state_slots = list(range(live - 1, -1, -1))  # pop() takes slot 0 first
        self.state_copies: list[tuple[int, int]] = []  # (src, dst) slots not yet launched
        saves = enable_prefix_caching and num_state_slots > live
        self.prefix_states = PrefixStates(range(live, num_state_slots)) if saves else None
        # a model with recurrent state caches prefixes only where it can keep their states
        self.enable_prefix_caching = enable_prefix_caching and (not num_state_slots or saves)
        self.group_windows = tuple(group_windows)
        self.num_groups = len(self.group_windows)
        self.windowed = [(g, w) for g, w in enumerate(self.group_windows) if w]
        self.hits_skip_last_block = hits_skip_last_block
        self.blocks = [Block(i) for i in range(num_blocks)]
        # LRU order of free blocks: the first entry is evicted first.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.seq_block_hashes: dict[int, list[int]] = {}  # seq_id -> hashes of its cached blocks
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) not yet launched
        self.released: list[int] = []  # freed seq ids whose ranks' tables are not dropped yet
        self.num_copied_blocks = 0
        self.peak_held = 0  # the most blocks held at once (what the workload needed)

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_blocks) / self.num_blocks

    @property
    def peak_usage(self) -> float:
        return self.peak_held / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def num_blocks_for(self, num_tokens: int) -> int:
        """Logical blocks covering ``num_tokens`` positions (a table entry per group each)."""
        return -(-num_tokens // self.block_size)

    def num_held_blocks(self, seq: Sequence) -> int:
        """Physical blocks ``seq``'s table lists now."""
        return sum(1 for b in seq.block_table if b >= 0)

    def find_cached_prefix(self, seq: Sequence) -> CachedPrefix:
        """The longest cached prefix of ``seq`` (read-only lookup); with recurrent state, the
        longest whose state at its end is kept."""
        if not self.enable_prefix_caching:
            return NO_PREFIX
        cached = self._find_cached_blocks(seq)
        if self.prefix_states is None:
            return cached
        kv_tokens = cached.num_blocks * self.block_size
        for k in range(cached.num_blocks, 0, -1):
            row = self.prefix_states.row_of(cached.hashes[k - 1])
            if row is not None:
                return CachedPrefix(cached.blocks[:k * self.num_groups], cached.hashes[:k], row,
                                    kv_tokens)
        return CachedPrefix([], [], -1, kv_tokens)

    def _find_cached_blocks(self, seq: Sequence) -> CachedPrefix:
        """The longest prefix of ``seq`` whose KV blocks are cached."""
        bs, tokens = self.block_size, seq.token_ids
        if self.num_groups == 1 and not self.windowed:
            found: list[int] = []
            hashes: list[int] = []
            prev = _root(seq)
            for i in range((len(tokens) - 1) // bs):
                block_tokens = tokens[i * bs:(i + 1) * bs]
                prev = hash_block(prev, block_tokens)
                block_id = self.hash_to_block.get(prev)
                if block_id is None or self.blocks[block_id].token_ids != tuple(block_tokens):
                    break
                found.append(block_id)
                hashes.append(prev)
            if self.hits_skip_last_block and found:
                found.pop()
                hashes.pop()
            return CachedPrefix(found, hashes)
        return self._find_cached_prefix_by_group(tokens, _root(seq))

    def _find_cached_prefix_by_group(self, tokens: list[int], root: int) -> CachedPrefix:
        """``find_cached_prefix`` over several groups or windows: the longest prefix of ``k``
        blocks such that each full group caches blocks ``0..k-1`` and each windowed group the
        blocks its window reaches from position ``k * block_size``."""
        bs, groups = self.block_size, self.num_groups
        hashes = hash_blocks(root, tokens[:(len(tokens) - 1) // bs * bs], bs)
        for g, window in enumerate(self.group_windows):  # a full group's first miss ends it
            if window is None:
                hashes = hashes[:self._num_cached_leading(hashes, g, tokens)]
        cached = [[self._cached_block(h, g, tokens[i * bs:(i + 1) * bs])
                   for i, h in enumerate(hashes)] for g in range(groups)]
        best, skip = 0, self.hits_skip_last_block
        for k in range(len(hashes), 0, -1):
            if all(all(b is not None for b in cached[g][first_needed_block(w, k * bs, bs):k])
                   for g, w in enumerate(self.group_windows)):
                if skip:  # the longest prefix found, less its last block
                    skip = False
                    continue
                best = k
                break
        lows = [first_needed_block(w, best * bs, bs) for w in self.group_windows]
        blocks = [cached[g][i] if i >= lows[g] else -1  # type: ignore[misc]
                  for i in range(best) for g in range(groups)]
        return CachedPrefix(blocks, hashes[:best])

    def _num_cached_leading(self, hashes: list[int], group: int, tokens: list[int]) -> int:
        """How many of the first blocks ``hashes`` names ``group`` caches, up to its first miss."""
        bs = self.block_size
        for i, h in enumerate(hashes):
            if self._cached_block(h, group, tokens[i * bs:(i + 1) * bs]) is None:
                return i
        return len(hashes)

    def _cached_block(self, block_hash: int, group: int, block_tokens: list[int]) -> int | None:
        block_id = self.hash_to_block.get(group_key(block_hash, group))
        if block_id is None or self.blocks[block_id].token_ids != tuple(block_tokens):
            return None
        return block_id

    def can_allocate(self, cached: CachedPrefix, num_tokens: int) -> bool:
        """Can a waiting sequence get ``cached`` blocks plus slots up to ``num_tokens`` tokens?"""
        revived = sum(1 for b in cached.blocks if b >= 0 and self.blocks[b].ref_count == 0)
        new = (self.num_blocks_for(num_tokens) - cached.num_blocks) * self.num_groups
        return revived + new <= len(self.free_blocks) and self.has_state_slot()

    def has_state_slot(self) -> bool:
        """Can one more sequence hold a state slot (always, without recurrent layers)?"""
        return not self.num_state_slots or bool(self.free_state_slots)

    def needs_blocks(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Does writing ``num_new_tokens`` more tokens take free blocks (the fast check)?"""
        capacity = len(seq.block_table) // self.num_groups * self.block_size
        return (seq.num_computed_tokens + num_new_tokens > capacity
                or bool(self._shared_write_entries(seq)))

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Free blocks that writing ``num_new_tokens`` more tokens of ``seq`` takes (new blocks,
        and private copies of shared blocks it would write into)."""
        groups = self.num_groups
        grow = (self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
                - len(seq.block_table) // groups)
        return max(grow, 0) * groups + len(self._shared_write_entries(seq))

    def can_append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= len(self.free_blocks)

    def can_fork(self, num_shared_tokens: int, num_new_tokens: int) -> bool:
        """Can a sequence sharing a fork's first ``num_shared_tokens`` add that many more?"""
        grow = (self.num_blocks_for(num_shared_tokens + num_new_tokens)
                - self.num_blocks_for(num_shared_tokens))
        partial = num_shared_tokens % self.block_size != 0
        return ((grow + partial) * self.num_groups <= len(self.free_blocks)
                and self.has_state_slot())

    def holds_prefix(self, seq: Sequence, num_tokens: int) -> bool:
        """Does ``seq`` still hold every block a sequence forked at ``num_tokens`` tokens needs
        (a windowed group gives back blocks as ``seq`` grows)?"""
        groups, bs = self.num_groups, self.block_size
        end = self.num_blocks_for(num_tokens)
        return all(seq.block_table[i * groups + g] >= 0
                   for g, w in self.windowed
                   for i in range(first_needed_block(w, num_tokens, bs), end))

    def _shared_write_entries(self, seq: Sequence) -> list[int]:
        """The entries of the block ``seq`` writes next that it shares with another sequence."""
        if not seq.shares_blocks:
            return []
        groups = self.num_groups
        first = seq.num_computed_tokens // self.block_size * groups
        table = seq.block_table
        return [e for e in range(first, min(first + groups, len(table)))
                if table[e] >= 0 and self.blocks[table[e]].ref_count > 1]

    # ----------------------------------------------------------------- changes
    def allocate_prefix(self, seq: Sequence, cached: CachedPrefix) -> None:
        """Give a waiting sequence its cached prefix blocks; count the lookup."""
        assert not seq.block_table, f"seq {seq.seq_id} already holds blocks"
        for block_id in cached.blocks:
            if block_id < 0:
                continue
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
        seq.block_table = list(cached.blocks)
        seq.ranks_table_len = 0
        self._take_state_slot(seq)
        if cached.state_row >= 0:  # the state at the prefix's end, into the sequence's slot
            self.prefix_states.use(cached.hashes[-1])  # type: ignore[union-attr]
            self.state_copies.append((cached.state_row, seq.state_slot))
        seq.num_computed_tokens = cached.num_blocks * self.block_size
        seq.state_save_at = self.state_save_point(seq, seq.num_computed_tokens,
                                                  cached.kv_cached_tokens)
        seq.num_cached_tokens = seq.num_computed_tokens
        seq.draft_len = self._drafted_tokens(seq, cached)
        self.seq_block_hashes[seq.seq_id] = list(cached.hashes)
        self.num_queried_tokens += seq.num_tokens
        self.num_hit_tokens += seq.num_computed_tokens

    def fork(self, child: Sequence, parent: Sequence, num_tokens: int) -> None:
        """Give a waiting ``child`` the blocks of ``parent`` that hold its first ``num_tokens``
        tokens (the same tokens: a request's choices share the prompt)."""
        assert not child.block_table, f"seq {child.seq_id} already holds blocks"
        shared = parent.block_table[:self.num_blocks_for(num_tokens) * self.num_groups]
        for block_id in shared:
            if block_id >= 0:
                self.blocks[block_id].ref_count += 1
        child.block_table = list(shared)
        child.ranks_table_len = 0
        if self.num_state_slots:
            assert num_tokens == parent.num_computed_tokens, (
                "a fork of a model with recurrent state shares all of its parent's tokens")
            self._take_state_slot(child)
            self.state_copies.append((parent.state_slot, child.state_slot))
        child.num_computed_tokens = num_tokens
        child.shares_blocks = parent.shares_blocks = True
        child.num_cached_tokens = num_tokens
        # the draft cache's rows of the shared tokens are the parent's (copied on write with them)
        child.draft_len = min(parent.draft_len, num_tokens)

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write pairs since the last call (the next launched step copies them)."""
        copies, self.copies = self.copies, []
        return copies

    def state_save_point(self, seq: Sequence, start: int, diverges_at: int = 0) -> int:
        """Where ``seq``'s state is next to be kept, for a sequence computed up to ``start``
        (-1: nowhere further; no prefix caching of states): where it diverges from the cached
        KV (``diverges_at``, ``CachedPrefix.kv_cached_tokens``: a prompt that shares a system
        prompt with an earlier one keeps the state at its end for the next), else its prompt's
        last block boundary before its last token (where the same prompt would resume; a block
        before it where hits leave their last block out)."""
        if self.prefix_states is None:
            return -1
        blocks = (seq.num_prompt_tokens - 1) // self.block_size - self.hits_skip_last_block
        last = blocks * self.block_size
        point = diverges_at if start < diverges_at < last else last
        return point if point > start else -1

    def save_state(self, seq: Sequence) -> None:
        """``seq`` has computed up to its save point in the step just launched: the next step
        copies its state into a prefix-state row kept under that block's hash; its next save
        point is set."""
        point = seq.state_save_at
        seq.state_save_at = self.state_save_point(seq, point)
        row = self.prefix_states.save(self._prefix_hash(seq, point))  # type: ignore[union-attr]
        if row is not None:
            self.state_copies.append((seq.state_slot, row))

    def _prefix_hash(self, seq: Sequence, num_tokens: int) -> int:
        """The chained hash of ``seq``'s first ``num_tokens`` tokens (whole blocks), extending
        the hashes of its blocks cached so far."""
        bs = self.block_size
        known = self.seq_block_hashes.get(seq.seq_id, [])
        k = min(len(known), num_tokens // bs)
        if k == num_tokens // bs:
            return known[k - 1]
        return hash_blocks(known[k - 1] if k else _root(seq), seq.token_ids[k * bs:num_tokens],
                           bs)[-1]

    def take_state_copies(self) -> list[tuple[int, int]]:
        """The state-slot copies of forks since the last call (the next launched step)."""
        copies, self.state_copies = self.state_copies, []
        return copies

    def _take_state_slot(self, seq: Sequence) -> None:
        if self.num_state_slots:
            assert self.free_state_slots, "no free state slot (check has_state_slot first)"
            seq.state_slot = self.free_state_slots.pop()

    def take_released(self) -> list[int]:
        """The seq ids freed since the last call (the next launched step drops their tables)."""
        released, self.released = self.released, []
        return released

    def release_out_of_window(self, seq: Sequence) -> None:
        """Give back the blocks of ``seq``'s windowed groups that no query from
        ``num_computed_tokens`` on reads (their entries become -1; the ranks' stale copies of
        them are never read, so they are not told). Steps already launched that read them run
        before any step that writes them again (one stream, in order)."""
        groups, table = self.num_groups, seq.block_table
        for g, window in self.windowed:
            i = min(first_needed_block(window, seq.num_computed_tokens, self.block_size),
                    len(table) // groups) - 1
            while i >= 0 and table[i * groups + g] >= 0:
                self._release_block(table[i * groups + g])
                table[i * groups + g] = -1
                i -= 1

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make sure the block table covers ``num_computed_tokens + num_new_tokens`` tokens,
        with a private copy of a shared block the tokens would be written into (first giving
        back the blocks its windowed groups no longer read)."""
        if self.windowed:
            self.release_out_of_window(seq)
        for entry in self._shared_write_entries(seq):
            shared = self.blocks[seq.block_table[entry]]
            shared.ref_count -= 1
            seq.block_table[entry] = self._take_free_block()
            seq.ranks_table_len = min(seq.ranks_table_len, entry - entry % self.num_groups)
            self.copies.append((shared.block_id, seq.block_table[entry]))
            self.num_copied_blocks += 1
        needed = (self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
                  - len(seq.block_table) // self.num_groups)
        for _ in range(needed * self.num_groups):
            seq.block_table.append(self._take_free_block())

    def cache_full_blocks(self, seq: Sequence, num_written: int | None = None) -> None:
        """Hash the blocks of ``seq`` that became full with written KV (call after a step);
        ``num_written``: how many of its tokens have their KV written (default: all computed)."""
        if not self.enable_prefix_caching:
            return
        hashes = self.seq_block_hashes.setdefault(seq.seq_id, [])
        written = seq.num_computed_tokens if num_written is None else num_written
        num_full = min(written, len(seq.token_ids)) // self.block_size
        first = len(hashes)
        if first >= num_full:
            return
        bs, tokens, table, groups = self.block_size, seq.token_ids, seq.block_table, self.num_groups
        new = hash_blocks(hashes[-1] if hashes else _root(seq), tokens[first * bs:num_full * bs], bs)
        hashes.extend(new)
        for i, h in enumerate(new, first):
            for g in range(groups):
                block_id = table[i * groups + g]
                if block_id < 0:  # a windowed group gave it back before it was hashed
                    continue
                block = self.blocks[block_id]
                if block.hash is None:
                    key = group_key(h, g)
                    block.hash, block.token_ids = key, tuple(tokens[i * bs:(i + 1) * bs])
                    self.hash_to_block.setdefault(key, block_id)

    def mark_drafted(self, seq: Sequence) -> None:
        """Note the blocks of ``seq`` whose rows the draft cache now holds (after a step): those
        wholly before position ``draft_len - 1`` (a head's row at p is token p + 1's, so the
        row at ``draft_len - 1`` waits for the next feed; a draft model's rows are one ahead of
        that), with the token after each (its last row's, for a head). A block keeps the mark
        until it is reused, so a prefix hit on it need not feed the drafter those tokens again
        (``allocate_prefix``)."""
        if self.num_groups != 1:  # (drafters run beside targets without windowed layers)
            return
        bs = self.block_size
        for i in range(max(seq.draft_len - 1, 0) // bs - 1, -1, -1):
            block = self.blocks[seq.block_table[i]]
            if block.drafted:  # marked up to here by an earlier step (or another sequence)
                return
            block.drafted, block.drafted_next = True, seq.token_ids[(i + 1) * bs]

    def _drafted_tokens(self, seq: Sequence, cached: CachedPrefix) -> int:
        """How much of a cached prefix the draft cache holds for ``seq``: its leading drafted
        blocks. A head's rows lag (``hits_skip_last_block``): a block's last row was fed the
        token after it, so a block counts only where that token is ``seq``'s too, and a marked
        block whose last row ``seq`` will feed again from another token loses its mark (the
        prefix's hash may lead to a block another sequence continued differently)."""
        if self.num_groups != 1:
            return 0
        bs, count = self.block_size, None
        for i, block_id in enumerate(cached.blocks):
            block = self.blocks[block_id]
            if self.hits_skip_last_block and block.drafted_next != seq.token_ids[(i + 1) * bs]:
                block.drafted = False
            if count is None and not block.drafted:
                count = i
        return (len(cached.blocks) if count is None else count) * bs

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq``; cached content stays until evicted."""
        for block_id in reversed(seq.block_table):
            if block_id >= 0:
                self._release_block(block_id)
        if seq.block_table:
            self.released.append(seq.seq_id)
        if seq.state_slot >= 0:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = seq.state_save_at = -1
        seq.block_table = []
        seq.ranks_table_len = 0
        seq.num_computed_tokens = 0
        self.seq_block_hashes.pop(seq.seq_id, None)

    def _release_block(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            self.free_blocks[block_id] = None
            if block.hash is None:
                self.free_blocks.move_to_end(block_id, last=False)

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0, f"free block {block_id} is referenced"
        if block.hash is not None:
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash = block.token_ids = None
        block.drafted = False
        block.ref_count = 1
        self.peak_held = max(self.peak_held, self.num_blocks - len(self.free_blocks))
        return block_id
