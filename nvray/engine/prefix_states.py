"""PrefixStates: recurrent states saved at block boundaries of cached prefixes (models with
linear-attention layers, ``nvray/layers/gated_deltanet.py``), for prefix caching.

A KV block holds its own tokens' keys and values, so a cached prefix is its blocks. A
linear-attention layer's state holds the whole past in one fixed-size tensor, so a prefix of
``k`` blocks is served only where the state after exactly those ``k * block_size`` tokens was
kept. This keeps such states in their own rows of the ranks' state tensors (after the running
sequences' slots), each under the chained hash of the prefix's last block (``BlockManager``'s),
least recently used first out: ``row_of`` finds one, ``use`` marks a hit, ``save`` gives a row to
a new state (a free row, else the least recently used one's). The copies into and out of the rows
are the ``BlockManager``'s ``state_copies``, launched in the order they are made, so a row that is
saved over after a hit was read by its copy first.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixStates:
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
