"""PrefixCache: which blocks hold a prefix's KV, keyed by chained hashes of its tokens.

Contract:
- A block that is full *and whose KV has been written* gets a chained hash (xxh64 of the
  previous block's hash and its token ids); each group's block of it is published in the pool
  under ``group_key(hash, group)`` (``nvray/engine/block_pool.py``, which also compares the
  tokens on a lookup). A sequence with a LoRA adapter chains from the adapter's ``cache_salt``
  instead of 0, so its KV is never served to the base model or another adapter (``root``).
- At most ``(num_tokens - 1) // block_size`` blocks of a sequence are served, so the model
  always has at least one token to compute (never a zero-length query). With
  ``hits_skip_last_block`` (an EAGLE-3 drafter, whose row at a block's last position holds the
  next block's first token) a cached prefix is served without its last block.
- Windowed groups (``nvray/kv_layout.py``): a prefix is served only where every group holds
  what its window needs after it (a full group: all its blocks; a windowed group: the blocks
  its window reaches back to), the others -1 in the prefix's entries.
- ``seq_block_hashes`` keeps the hashes of each sequence's hashed blocks, so each block is
  hashed once; ``prefix_hash`` extends them to any whole-block length (recurrent state's save
  points, ``nvray/engine/state_slots.py``).
"""

from __future__ import annotations

from array import array
from typing import NamedTuple

import xxhash

from nvray.engine.block_pool import BlockPool
from nvray.engine.sequence import Sequence
from nvray.kv_layout import first_needed_block

_ROOT_HASH = 0


def _chain(prev_hash: int, block_bytes: bytes) -> int:
    return xxhash.xxh64_intdigest(prev_hash.to_bytes(8, "little") + block_bytes)


def root(seq: Sequence) -> int:
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


class PrefixCache:
    def __init__(self, pool: BlockPool, block_size: int, group_windows: tuple[int | None, ...],
                 hits_skip_last_block: bool) -> None:
        self.pool = pool
        self.block_size = block_size
        self.group_windows = group_windows
        self.num_groups = len(group_windows)
        self.plain = self.num_groups == 1 and not group_windows[0]  # one full-attention group
        self.hits_skip_last_block = hits_skip_last_block
        self.seq_block_hashes: dict[int, list[int]] = {}  # seq_id -> hashes of its cached blocks
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def count_lookup(self, seq: Sequence, hashes: list[int]) -> None:
        """``seq`` starts from a prefix of these hashes (its computed tokens): count the hit."""
        self.seq_block_hashes[seq.seq_id] = list(hashes)
        self.num_queried_tokens += seq.num_tokens
        self.num_hit_tokens += seq.num_computed_tokens

    def forget(self, seq: Sequence) -> None:
        self.seq_block_hashes.pop(seq.seq_id, None)

    def find(self, seq: Sequence) -> CachedPrefix:
        """The longest prefix of ``seq`` whose KV blocks are cached."""
        if not self.plain:
            return self._find_by_group(seq.token_ids, root(seq))
        bs, tokens, pool = self.block_size, seq.token_ids, self.pool
        found: list[int] = []
        hashes: list[int] = []
        prev = root(seq)
        for i in range((len(tokens) - 1) // bs):
            block_tokens = tokens[i * bs:(i + 1) * bs]
            prev = hash_block(prev, block_tokens)
            block_id = pool.cached(prev, block_tokens)
            if block_id is None:
                break
            found.append(block_id)
            hashes.append(prev)
        if self.hits_skip_last_block and found:
            found.pop()
            hashes.pop()
        return CachedPrefix(found, hashes)

    def _find_by_group(self, tokens: list[int], root_hash: int) -> CachedPrefix:
        """``find`` over several groups or windows: the longest prefix of ``k`` blocks such that
        each full group caches blocks ``0..k-1`` and each windowed group the blocks its window
        reaches from position ``k * block_size``."""
        bs, groups = self.block_size, self.num_groups
        hashes = hash_blocks(root_hash, tokens[:(len(tokens) - 1) // bs * bs], bs)
        for g, window in enumerate(self.group_windows):  # a full group's first miss ends it
            if window is None:
                hashes = hashes[:self._num_cached_leading(hashes, g, tokens)]
        cached = [[self.pool.cached(group_key(h, g), tokens[i * bs:(i + 1) * bs])
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
            if self.pool.cached(group_key(h, group), tokens[i * bs:(i + 1) * bs]) is None:
                return i
        return len(hashes)

    def cache_full_blocks(self, seq: Sequence, num_written: int) -> None:
        """Hash the blocks of ``seq`` that are full with written KV (``num_written`` of its
        tokens have it) and publish each group's block under its key."""
        hashes = self.seq_block_hashes.setdefault(seq.seq_id, [])
        num_full = min(num_written, len(seq.token_ids)) // self.block_size
        first = len(hashes)
        if first >= num_full:
            return
        bs, tokens, table, groups = self.block_size, seq.token_ids, seq.block_table, self.num_groups
        new = hash_blocks(hashes[-1] if hashes else root(seq), tokens[first * bs:num_full * bs], bs)
        hashes.extend(new)
        for i, h in enumerate(new, first):
            for g in range(groups):
                block_id = table[i * groups + g]
                if block_id >= 0:  # (a windowed group may have given it back before)
                    self.pool.publish(block_id, group_key(h, g),
                                      tuple(tokens[i * bs:(i + 1) * bs]))

    def prefix_hash(self, seq: Sequence, num_tokens: int) -> int:
        """The chained hash of ``seq``'s first ``num_tokens`` tokens (whole blocks), extending
        the hashes of its blocks cached so far."""
        bs = self.block_size
        known = self.seq_block_hashes.get(seq.seq_id, [])
        k = min(len(known), num_tokens // bs)
        if k == num_tokens // bs:
            return known[k - 1]
        return hash_blocks(known[k - 1] if k else root(seq), seq.token_ids[k * bs:num_tokens],
                           bs)[-1]
