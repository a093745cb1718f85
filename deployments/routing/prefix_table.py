"""The prefix table of the prefix-aware router: which engine replicas took a request whose
routing key started with each block of characters (chained xxh64 hashes of the key's leading
``block_chars``-character blocks, like the engine's prefix cache does with token blocks)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

import xxhash

BLOCK_CHARS = 64  # about a 16-token KV block of English text
TABLE_SIZE = 200_000  # remembered prefix blocks (LRU)


def prefix_hashes(key: str, block_chars: int = BLOCK_CHARS) -> list[int]:
    """Chained hashes of the key's whole leading blocks: hash i covers blocks 0..i."""
    hashes, prev = [], 0
    data = key.encode("utf-8", "surrogatepass")
    for start in range(0, len(data) - block_chars + 1, block_chars):
        prev = xxhash.xxh64_intdigest(data[start:start + block_chars], seed=prev)
        hashes.append(prev)
    return hashes


class PrefixTable:
    """Prefix block hash -> the replicas that took a request starting with it (an LRU over
    blocks; each block's holders in the order they took it)."""

    def __init__(self, capacity: int = TABLE_SIZE) -> None:
        self.capacity = capacity
        self.holders: OrderedDict[int, tuple[Hashable, ...]] = OrderedDict()

    def longest_holders(self, hashes: list[int], live: set[Hashable]) -> list[Hashable]:
        """The live replicas holding the longest of these prefixes that any live one holds."""
        for h in reversed(hashes):
            holders = [r for r in self.holders.get(h, ()) if r in live]
            if holders:
                return holders
        return []

    def record(self, hashes: list[int], replica: Hashable) -> None:
        for h in hashes:
            holders = self.holders.get(h, ())
            if replica not in holders:
                self.holders[h] = holders + (replica,)
            self.holders.move_to_end(h)
        while len(self.holders) > self.capacity:
            self.holders.popitem(last=False)


