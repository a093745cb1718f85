"""DeviceBlockTables: the block tables of the sequences the ranks run, kept on the device.

A running sequence's table only grows, one block every ``block_size`` tokens, so the control
plane sends each table's changes only (``nvray/step_protocol.py``): a step carries, per sequence, the
entries from ``table_start`` on (0: the whole table). Each sequence gets a row of a persistent
``[max_rows, max_blocks]`` int32 table, mirrored on the host (the builder computes KV slots
from it); only the entries that changed travel to the device, as (flat index, block id) pairs.

With several block-table groups (``nvray/kv_layout.py``) a sequence's table is flat, entry
``b * G + g`` for group ``g``'s logical block ``b``; on the device the tables are
``[G, max_rows, max_blocks]``, so each group's rows are the ``[max_rows, max_blocks]`` table the
attention kernels read (``group_tables[g]``).

The last row (``pad_row``) is never handed out and stays zeros: CUDA graphs' padding sequences
read it (block 0 of every group). A row is zeroed when handed out, so the entries past a
sequence's own (which a graph's padding positions may read) are never a previous holder's -1
(a windowed group's freed block, ``nvray/kv_layout.py``) but a real block id.

``sync(seq_id, entries, table_start, out_idx, out_val)`` returns the sequence's row and its
whole table (host), and appends the updates the device needs; ``release(seq_ids)`` drops the
tables of freed sequences. A step that sends whole tables (``table_start`` 0: a new table, or
a hand-built step) may leave rows unreleased: when rows run out, the rows of sequences missing
from the step are reclaimed, and a sequence that then sends a change finds no table and fails
loudly. The caller applies the updates (``apply``) before the forward.
"""

from __future__ import annotations

import torch


class DeviceBlockTables:
    def __init__(self, max_rows: int, max_blocks: int, device: torch.device,
                 num_groups: int = 1) -> None:
        self.max_rows, self.max_blocks, self.num_groups = max_rows, max_blocks, num_groups
        self.tables = torch.zeros(num_groups, max_rows, max_blocks, dtype=torch.int32,
                                  device=device)
        self.group_tables = list(self.tables.unbind(0))  # [max_rows, max_blocks] views
        self.pad_row = max_rows - 1  # never handed out: zeros (see the module docstring)
        self.reset()

    def reset(self) -> None:
        self.rows: dict[int, int] = {}  # seq_id -> row
        self.held: dict[int, list[int]] = {}  # seq_id -> the entries its row holds
        self.last_step: dict[int, int] = {}  # seq_id -> step it was last scheduled in
        self.free = list(range(self.pad_row - 1, -1, -1))
        self.step = 0

    def begin_step(self) -> None:
        self.step += 1

    def sync(self, seq_id: int, entries: list[int], table_start: int, out_idx: list[int],
             out_val: list[int]) -> tuple[int, list[int]]:
        row = self.rows.get(seq_id)
        if row is None:
            assert table_start == 0, (
                f"seq {seq_id} sent its block table from entry {table_start}, but this rank "
                "holds no table for it")
            row = self._assign(seq_id)
        held = self.held[seq_id]
        self.last_step[seq_id] = self.step
        assert table_start <= len(held), (
            f"seq {seq_id} sent its block table from entry {table_start}, but this rank holds "
            f"{len(held)} entries")
        if entries:
            groups = self.num_groups
            end = -(-(table_start + len(entries)) // groups)
            assert end <= self.max_blocks, (
                f"block table of {end} blocks exceeds max_model_len's {self.max_blocks}")
            if groups == 1:
                base = row * self.max_blocks + table_start
                out_idx.extend(range(base, base + len(entries)))
            else:
                rows, width = self.max_rows * self.max_blocks, self.max_blocks
                out_idx.extend(e % groups * rows + row * width + e // groups
                               for e in range(table_start, table_start + len(entries)))
            out_val.extend(entries)
        del held[table_start:]
        held.extend(entries)
        return row, held

    def release(self, seq_ids: list[int]) -> None:
        """Drop the tables of these sequences (unknown ids: nothing to drop)."""
        for seq_id in seq_ids:
            row = self.rows.pop(seq_id, None)
            if row is not None:
                self.free.append(row)
                del self.held[seq_id], self.last_step[seq_id]

    def apply(self, idx: torch.Tensor, val: torch.Tensor) -> None:
        """Write the updates gathered by ``sync`` (device tensors, int32)."""
        if idx.numel():
            self.tables.view(-1)[idx] = val

    def _assign(self, seq_id: int) -> int:
        if not self.free:
            self._reclaim()
        row = self.free.pop()
        self.rows[seq_id], self.held[seq_id] = row, []
        self.tables[:, row].zero_()  # before this step's updates (the same stream)
        return row

    def _reclaim(self) -> None:
        stale = [s for s, last in self.last_step.items() if last < self.step]
        assert stale, f"more than {self.max_rows} sequences in one step"
        for seq_id in stale:
            self.free.append(self.rows.pop(seq_id))
            del self.held[seq_id], self.last_step[seq_id]
