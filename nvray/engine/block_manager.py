"""BlockManager: paged KV blocks with reference counts and a prefix cache.

Contract:
- A block is owned by every running sequence whose block table lists it (``ref_count``).
- Prefix caching: a block that is full *and whose KV has been written* gets a chained hash
  (xxh64 of the previous block's hash and its token ids) and goes into ``hash_to_block``.
  A lookup also compares token ids, so a hash collision can never serve the wrong KV.
- A freed block keeps its hash and content; free blocks are evicted least recently freed first
  (blocks holding no cached content go first of all). Reusing a block drops its stale hash.
- At most ``(num_tokens - 1) // block_size`` blocks of a sequence are served from the cache,
  so the model always has at least one token to compute (never a zero-length query).
- Forks: ``fork`` gives a sequence another's blocks up to a token count (ref counted, never
  copied). Copy-on-write: before a sequence writes into a block it shares (a fork's partly
  filled last block), it gets a private copy; the (source, copy) pair waits in
  ``take_copies()`` for the step that must copy the KV before it writes.
- The ranks keep each sequence's block table between steps and get only its changes
  (``nvray/step_protocol.py``): a sequence's ``ranks_table_len`` counts the leading entries they hold,
  and this class lowers it where it changes an entry (a copy-on-write, a new table); a freed
  sequence waits in ``take_released()`` for the step that tells the ranks to drop its table.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict

import xxhash

from nvray.engine.sequence import Sequence

_ROOT_HASH = 0


def _chain(prev_hash: int, block_bytes: bytes) -> int:
    return xxhash.xxh64_intdigest(prev_hash.to_bytes(8, "little") + block_bytes)


def hash_block(prev_hash: int, token_ids: list[int]) -> int:
    """Chained hash of one full block: depends on every token before it."""
    return _chain(prev_hash, array("q", token_ids).tobytes())


def hash_blocks(prev_hash: int, token_ids: list[int], block_size: int) -> list[int]:
    """``hash_block`` of each of the consecutive full blocks of ``token_ids`` (a whole number
    of blocks), chained from ``prev_hash``: one conversion of the tokens for the whole run."""
    data, width, hashes = array("q", token_ids).tobytes(), 8 * block_size, []
    for start in range(0, len(data), width):
        prev_hash = _chain(prev_hash, data[start:start + width])
        hashes.append(prev_hash)
    return hashes


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks >= 1 and block_size >= 1, "need at least one block of one slot"
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
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

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_blocks) / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of ``seq`` (read-only lookup)."""
        if not self.enable_prefix_caching:
            return []
        bs, tokens = self.block_size, seq.token_ids
        found: list[int] = []
        prev = _ROOT_HASH
        for i in range((len(tokens) - 1) // bs):
            block_tokens = tokens[i * bs:(i + 1) * bs]
            prev = hash_block(prev, block_tokens)
            block_id = self.hash_to_block.get(prev)
            if block_id is None or self.blocks[block_id].token_ids != tuple(block_tokens):
                break
            found.append(block_id)
        return found

    def can_allocate(self, cached: list[int], num_tokens: int) -> bool:
        """Can a waiting sequence get ``cached`` blocks plus slots up to ``num_tokens`` tokens?"""
        revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        new = self.num_blocks_for(num_tokens) - len(cached)
        return revived + new <= len(self.free_blocks)

    def needs_blocks(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Does writing ``num_new_tokens`` more tokens take free blocks (the fast check)?"""
        return (seq.num_computed_tokens + num_new_tokens > len(seq.block_table) * self.block_size
                or self._shares_write_block(seq))

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Free blocks that writing ``num_new_tokens`` more tokens of ``seq`` takes (new blocks,
        and a private copy of a shared block it would write into)."""
        grow = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return max(grow, 0) + self._shares_write_block(seq)

    def can_append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= len(self.free_blocks)

    def can_fork(self, num_shared_tokens: int, num_new_tokens: int) -> bool:
        """Can a sequence sharing a fork's first ``num_shared_tokens`` add that many more?"""
        grow = (self.num_blocks_for(num_shared_tokens + num_new_tokens)
                - self.num_blocks_for(num_shared_tokens))
        return grow + (num_shared_tokens % self.block_size != 0) <= len(self.free_blocks)

    def _shares_write_block(self, seq: Sequence) -> bool:
        if not seq.shares_blocks:
            return False
        i = seq.num_computed_tokens // self.block_size
        return i < len(seq.block_table) and self.blocks[seq.block_table[i]].ref_count > 1

    # ----------------------------------------------------------------- changes
    def allocate_prefix(self, seq: Sequence, cached: list[int]) -> None:
        """Give a waiting sequence its cached prefix blocks; count the lookup."""
        assert not seq.block_table, f"seq {seq.seq_id} already holds blocks"
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
        seq.block_table = list(cached)
        seq.ranks_table_len = 0
        seq.num_computed_tokens = len(cached) * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens
        self.seq_block_hashes[seq.seq_id] = [self.blocks[b].hash for b in cached]  # type: ignore[misc]
        self.num_queried_tokens += seq.num_tokens
        self.num_hit_tokens += seq.num_computed_tokens

    def fork(self, child: Sequence, parent: Sequence, num_tokens: int) -> None:
        """Give a waiting ``child`` the blocks of ``parent`` that hold its first ``num_tokens``
        tokens (the same tokens: a request's choices share the prompt)."""
        assert not child.block_table, f"seq {child.seq_id} already holds blocks"
        shared = parent.block_table[:self.num_blocks_for(num_tokens)]
        for block_id in shared:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(shared)
        child.ranks_table_len = 0
        child.num_computed_tokens = num_tokens
        child.shares_blocks = parent.shares_blocks = True
        child.num_cached_tokens = num_tokens

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write pairs since the last call (the next launched step copies them)."""
        copies, self.copies = self.copies, []
        return copies

    def take_released(self) -> list[int]:
        """The seq ids freed since the last call (the next launched step drops their tables)."""
        released, self.released = self.released, []
        return released

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make sure the block table covers ``num_computed_tokens + num_new_tokens`` tokens,
        with a private copy of a shared block the tokens would be written into."""
        if self._shares_write_block(seq):
            i = seq.num_computed_tokens // self.block_size
            shared = self.blocks[seq.block_table[i]]
            shared.ref_count -= 1
            seq.block_table[i] = self._take_free_block()
            seq.ranks_table_len = min(seq.ranks_table_len, i)
            self.copies.append((shared.block_id, seq.block_table[i]))
            self.num_copied_blocks += 1
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(needed):
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
        bs, tokens, table = self.block_size, seq.token_ids, seq.block_table
        new = hash_blocks(hashes[-1] if hashes else _ROOT_HASH, tokens[first * bs:num_full * bs], bs)
        hashes.extend(new)
        for i, h in enumerate(new, first):
            block = self.blocks[table[i]]
            if block.hash is None:
                block.hash, block.token_ids = h, tuple(tokens[i * bs:(i + 1) * bs])
                self.hash_to_block.setdefault(h, block.block_id)

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq``; cached content stays until evicted."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
                if block.hash is None:
                    self.free_blocks.move_to_end(block_id, last=False)
        if seq.block_table:
            self.released.append(seq.seq_id)
        seq.block_table = []
        seq.ranks_table_len = 0
        seq.num_computed_tokens = 0
        self.seq_block_hashes.pop(seq.seq_id, None)

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0, f"free block {block_id} is referenced"
        if block.hash is not None:
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash = block.token_ids = None
        block.ref_count = 1
        return block_id
