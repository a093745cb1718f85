"""DeviceBlockTables: the block tables of recently scheduled sequences, kept on the device.

Each step the control plane sends every scheduled sequence's whole block table, but a running
sequence's table only grows, one block every ``block_size`` tokens. Converting all of them to a
tensor each step is the largest part of a decode step's host work (~18k ints for 256 sequences
of ~1k tokens), so each sequence gets a row of a persistent ``[max_rows, max_blocks]`` int32
table and only the entries that changed travel, as (flat index, block id) pairs.

``sync(seq_id, block_table, out_idx, out_val)`` returns the sequence's row and appends the
updates it needs; a table that is not an extension of what the row holds (the sequence was
preempted and got new blocks) is rewritten whole. Rows of sequences missing from a step are
reclaimed when rows run out. The caller applies the updates (``apply``) before the forward.
"""

from __future__ import annotations

import torch


class DeviceBlockTables:
    def __init__(self, max_rows: int, max_blocks: int, device: torch.device) -> None:
        self.max_rows, self.max_blocks = max_rows, max_blocks
        self.table = torch.zeros(max_rows, max_blocks, dtype=torch.int32, device=device)
        self.reset()

    def reset(self) -> None:
        self.rows: dict[int, int] = {}  # seq_id -> row
        self.held: dict[int, list[int]] = {}  # seq_id -> the entries its row holds
        self.last_step: dict[int, int] = {}  # seq_id -> step it was last scheduled in
        self.free = list(range(self.max_rows - 1, -1, -1))
        self.step = 0

    def begin_step(self) -> None:
        self.step += 1

    def sync(self, seq_id: int, block_table: list[int], out_idx: list[int], out_val: list[int]) -> int:
        row = self.rows.get(seq_id)
        if row is None:
            row = self._assign(seq_id)
        held = self.held[seq_id]
        self.last_step[seq_id] = self.step
        n = len(held)
        if len(block_table) < n or block_table[:n] != held:
            held.clear()
            n = 0
        if len(block_table) > n:
            assert len(block_table) <= self.max_blocks, (
                f"block table of {len(block_table)} blocks exceeds max_model_len's {self.max_blocks}")
            new = block_table[n:]
            base = row * self.max_blocks + n
            out_idx.extend(range(base, base + len(new)))
            out_val.extend(new)
            held.extend(new)
        return row

    def apply(self, idx: torch.Tensor, val: torch.Tensor) -> None:
        """Write the updates gathered by ``sync`` (device tensors, int32)."""
        if idx.numel():
            self.table.view(-1)[idx] = val

    def _assign(self, seq_id: int) -> int:
        if not self.free:
            self._reclaim()
        row = self.free.pop()
        self.rows[seq_id], self.held[seq_id] = row, []
        return row

    def _reclaim(self) -> None:
        stale = [s for s, last in self.last_step.items() if last < self.step]
        assert stale, f"more than {self.max_rows} sequences in one step"
        for seq_id in stale:
            self.free.append(self.rows.pop(seq_id))
            del self.held[seq_id], self.last_step[seq_id]
