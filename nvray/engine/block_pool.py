"""BlockPool: the engine's physical KV blocks — reference counts, the free list, the cache index.

Contract:
- A block is held by every sequence whose table lists it (``ref_count``); ``hold`` adds a
  holder (taking a free block off the free list), ``release`` drops one.
- A free block keeps its prefix-cache key and tokens until it is taken for new content: free
  blocks are taken least recently freed first, and blocks holding no cached content before
  any (``release`` puts them at the front). ``take`` drops a reused block's stale key from the
  index and calls ``on_reuse`` (the draft marks, ``nvray/engine/speculation.py``) with its id.
- The index maps a cache key (``nvray/engine/prefix_cache.py``'s ``group_key``) to the block
  that holds its content; ``cached`` also compares the block's tokens, so a hash collision can
  never serve the wrong KV. ``publish`` gives a block its key (the first block under a key
  stays its holder).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None  # its prefix-cache key (``group_key``)
        self.token_ids: tuple[int, ...] | None = None


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # LRU order of free blocks: the first entry is taken first.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.peak_held = 0  # the most blocks held at once (what the workload needed)
        self.on_reuse: Callable[[int], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_blocks) / self.num_blocks

    @property
    def peak_usage(self) -> float:
        return self.peak_held / self.num_blocks

    def num_revived(self, block_ids: list[int]) -> int:
        """How many of ``block_ids`` (-1: none) are free now (holding them takes free blocks)."""
        return sum(1 for b in block_ids if b >= 0 and self.blocks[b].ref_count == 0)

    def is_shared(self, block_id: int) -> bool:
        return self.blocks[block_id].ref_count > 1

    def cached(self, key: int, block_tokens: list[int]) -> int | None:
        """The block holding ``key``'s content for exactly ``block_tokens``, if any."""
        block_id = self.hash_to_block.get(key)
        if block_id is None or self.blocks[block_id].token_ids != tuple(block_tokens):
            return None
        return block_id

    def publish(self, block_id: int, key: int, block_tokens: tuple[int, ...]) -> None:
        """``block_id`` holds the content of ``key`` (once: a block keeps its first key)."""
        block = self.blocks[block_id]
        if block.hash is None:
            block.hash, block.token_ids = key, block_tokens
            self.hash_to_block.setdefault(key, block_id)

    def hold(self, block_id: int) -> None:
        """One more holder of ``block_id`` (a free one comes off the free list, content kept)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_blocks[block_id]
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            self.free_blocks[block_id] = None
            if block.hash is None:
                self.free_blocks.move_to_end(block_id, last=False)

    def take(self) -> int:
        """A free block for new content, held once (its cached content, if any, is dropped)."""
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0, f"free block {block_id} is referenced"
        if block.hash is not None:
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash = block.token_ids = None
        if self.on_reuse is not None:
            self.on_reuse(block_id)
        block.ref_count = 1
        self.peak_held = max(self.peak_held, self.num_blocks - len(self.free_blocks))
        return block_id
