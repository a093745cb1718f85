"""BlockManager: a sequence's KV blocks and state slot, from the pool, the prefix cache and the
state slots — what the scheduler asks and changes.

The parts, each with its contract:
- ``BlockPool`` (``block_pool.py``): physical blocks, reference counts, the LRU free list and
  the prefix-cache index;
- ``PrefixCache`` (``prefix_cache.py``): chained hashes of full, written blocks, lookups of a
  waiting sequence's longest cached prefix (per group for windowed layers, under an adapter's
  salt);
- ``StateSlots`` (``state_slots.py``): recurrent-state slots and the states prefix caching
  keeps at save points;
- ``DraftMarks`` (``speculation.py``): which blocks' rows a drafter's cache holds.

What this class adds:
- A block is owned by every running sequence whose block table lists it. Forks: ``fork`` gives
  a sequence another's blocks up to a token count (ref counted, never copied). Copy-on-write:
  before a sequence writes into a block it shares (a fork's partly filled last block), it gets
  a private copy; the (source, copy) pair waits in ``take_copies()`` for the step that must
  copy the KV before it writes.
- Windowed layers (``nvray/kv_layout.py``): a sequence's table holds one entry per group for
  each logical block (entry ``b * num_groups + g``). A group of window W needs only the blocks
  from the one holding position ``start - W + 1`` on, ``start`` being the next token to compute;
  ``release_out_of_window`` gives the others back (their entries become -1) as the sequence
  grows, so a long sequence of a model with local layers holds a window's worth of blocks in
  those layers.
- A model with recurrent state caches prefixes only where it can keep their states; a cached
  prefix is then served to the deepest block whose state is kept (its KV blocks cached too),
  and the sequence's slot gets that state copied in before its first step.
- The ranks keep each sequence's block table between steps and get only its changes
  (``nvray/step_protocol.py``): a sequence's ``ranks_table_len`` counts the leading entries they
  hold, and this class lowers it where it changes an entry (a copy-on-write, a new table); a
  freed sequence waits in ``take_released()`` for the step that tells the ranks to drop its
  table.
"""

from __future__ import annotations

from nvray.engine.block_pool import BlockPool
from nvray.engine.prefix_cache import NO_PREFIX, CachedPrefix, PrefixCache
from nvray.engine.sequence import Sequence
from nvray.engine.speculation import DraftMarks
from nvray.engine.state_slots import StateSlots
from nvray.kv_layout import first_needed_block


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 group_windows: tuple[int | None, ...] = (None,), num_state_slots: int = 0,
                 num_live_states: int | None = None, hits_skip_last_block: bool = False) -> None:
        """``group_windows``: the window of each block-table group (``KVLayout``);
        ``num_state_slots``: recurrent-state slots (0: the model has no recurrent layers), the
        first ``num_live_states`` (default: all) for running sequences, the rest for prefix
        caching's saved states; ``hits_skip_last_block``: see ``prefix_cache.py``."""
        assert num_blocks >= 1 and block_size >= 1, "need at least one block of one slot"
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.group_windows = tuple(group_windows)
        self.num_groups = len(self.group_windows)
        self.windowed = [(g, w) for g, w in enumerate(self.group_windows) if w]
        self.pool = BlockPool(num_blocks)
        self.prefix_cache = PrefixCache(self.pool, block_size, self.group_windows,
                                        hits_skip_last_block)
        self.states = StateSlots(num_state_slots, num_live_states, enable_prefix_caching,
                                 block_size, self.num_groups, hits_skip_last_block)
        self.draft_marks = DraftMarks(num_blocks, block_size, self.num_groups,
                                      hits_skip_last_block)
        self.pool.on_reuse = self.draft_marks.clear
        self.enable_prefix_caching = enable_prefix_caching and self.states.caches_prefixes
        self.num_state_slots = num_state_slots
        self.copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) not yet launched
        self.released: list[int] = []  # freed seq ids whose ranks' tables are not dropped yet
        self.num_copied_blocks = 0

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def peak_usage(self) -> float:
        return self.pool.peak_usage

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_cache.hit_rate

    @property
    def num_queried_tokens(self) -> int:
        return self.prefix_cache.num_queried_tokens

    @property
    def num_hit_tokens(self) -> int:
        return self.prefix_cache.num_hit_tokens

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
        return self.states.deepest_kept(self.prefix_cache.find(seq))

    def can_allocate(self, cached: CachedPrefix, num_tokens: int) -> bool:
        """Can a waiting sequence get ``cached`` blocks plus slots up to ``num_tokens`` tokens?"""
        new = (self.num_blocks_for(num_tokens) - cached.num_blocks) * self.num_groups
        return (self.pool.num_revived(cached.blocks) + new <= self.pool.num_free_blocks
                and self.states.has_free())

    def has_state_slot(self) -> bool:
        """Can one more sequence hold a state slot (always, without recurrent layers)?"""
        return self.states.has_free()

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
        return self.num_new_blocks(seq, num_new_tokens) <= self.pool.num_free_blocks

    def can_fork(self, num_shared_tokens: int, num_new_tokens: int) -> bool:
        """Can a sequence sharing a fork's first ``num_shared_tokens`` add that many more?"""
        grow = (self.num_blocks_for(num_shared_tokens + num_new_tokens)
                - self.num_blocks_for(num_shared_tokens))
        partial = num_shared_tokens % self.block_size != 0
        return ((grow + partial) * self.num_groups <= self.pool.num_free_blocks
                and self.states.has_free())

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
                if table[e] >= 0 and self.pool.is_shared(table[e])]

    # ----------------------------------------------------------------- changes
    def allocate_prefix(self, seq: Sequence, cached: CachedPrefix) -> None:
        """Give a waiting sequence its cached prefix blocks; count the lookup."""
        assert not seq.block_table, f"seq {seq.seq_id} already holds blocks"
        for block_id in cached.blocks:
            if block_id >= 0:
                self.pool.hold(block_id)
        seq.block_table = list(cached.blocks)
        seq.ranks_table_len = 0
        seq.num_computed_tokens = seq.num_cached_tokens = cached.num_blocks * self.block_size
        self.states.start(seq, cached)
        seq.draft_len = self.draft_marks.drafted_tokens(seq, cached)
        self.prefix_cache.count_lookup(seq, cached.hashes)

    def fork(self, child: Sequence, parent: Sequence, num_tokens: int) -> None:
        """Give a waiting ``child`` the blocks of ``parent`` that hold its first ``num_tokens``
        tokens (the same tokens: a request's choices share the prompt)."""
        assert not child.block_table, f"seq {child.seq_id} already holds blocks"
        shared = parent.block_table[:self.num_blocks_for(num_tokens) * self.num_groups]
        for block_id in shared:
            if block_id >= 0:
                self.pool.hold(block_id)
        child.block_table = list(shared)
        child.ranks_table_len = 0
        self.states.fork(child, parent, num_tokens)
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
        """Where ``seq``'s state is next to be kept (``StateSlots.save_point``)."""
        return self.states.save_point(seq, start, diverges_at)

    def save_state(self, seq: Sequence) -> None:
        """``seq`` has computed up to its save point in the step just launched: the next step
        copies its state into a prefix-state row kept under that block's hash."""
        self.states.save(seq, self.prefix_cache.prefix_hash(seq, seq.state_save_at))

    def take_state_copies(self) -> list[tuple[int, int]]:
        """The state-slot copies since the last call (the next launched step)."""
        return self.states.take_copies()

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
                self.pool.release(table[i * groups + g])
                table[i * groups + g] = -1
                i -= 1

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make sure the block table covers ``num_computed_tokens + num_new_tokens`` tokens,
        with a private copy of a shared block the tokens would be written into (first giving
        back the blocks its windowed groups no longer read)."""
        if self.windowed:
            self.release_out_of_window(seq)
        pool = self.pool
        for entry in self._shared_write_entries(seq):
            shared = seq.block_table[entry]
            pool.release(shared)  # (another sequence still holds it)
            seq.block_table[entry] = pool.take()
            seq.ranks_table_len = min(seq.ranks_table_len, entry - entry % self.num_groups)
            self.copies.append((shared, seq.block_table[entry]))
            self.num_copied_blocks += 1
        needed = (self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
                  - len(seq.block_table) // self.num_groups)
        for _ in range(needed * self.num_groups):
            seq.block_table.append(pool.take())

    def cache_full_blocks(self, seq: Sequence, num_written: int | None = None) -> None:
        """Hash the blocks of ``seq`` that became full with written KV (call after a step);
        ``num_written``: how many of its tokens have their KV written (default: all computed)."""
        if self.enable_prefix_caching:
            written = seq.num_computed_tokens if num_written is None else num_written
            self.prefix_cache.cache_full_blocks(seq, written)

    def mark_drafted(self, seq: Sequence) -> None:
        """Note the blocks of ``seq`` whose rows the draft cache now holds (``DraftMarks``)."""
        self.draft_marks.mark(seq)

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq``; cached content stays until evicted."""
        for block_id in reversed(seq.block_table):
            if block_id >= 0:
                self.pool.release(block_id)
        if seq.block_table:
            self.released.append(seq.seq_id)
        self.states.give_back(seq)
        seq.block_table = []
        seq.ranks_table_len = 0
        seq.num_computed_tokens = 0
        self.prefix_cache.forget(seq)
