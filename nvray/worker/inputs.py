"""InputBuilder: one StepInput -> the device tensors of one forward, with few host operations.

Every integer a step needs (token ids, positions, KV slots, query offsets, context lengths,
block-table rows, rows to sample, block-table changes) is written into ONE pinned int32 host
buffer through numpy and crosses to the device in ONE non-blocking copy; the tensors of the
forward are views of the device copy. Block tables live on the device (``DeviceBlockTables``),
so only their changes travel, from the control plane and on to the device. On the CPU the host
buffer is used directly.

A decode step that fits a captured CUDA graph writes instead into the graph's static inputs:
``[ids | positions | seq_lens | rows | slots of each block-table group]``, each
``graph_capacity`` long, padded up to the graph's batch size with rows that attend to nothing
(seq_len 0) and write nowhere (slot -1).

With several block-table groups (``nvray/kv_layout.py``) every token has a KV slot in each
group (the flat table's entry ``b * G + g``), and the metadata carries one per group
(``AttentionMetadata.groups``).
A model with recurrent layers adds a field: each sequence's state slot (padding: -1, the
layers' scratch row). With speculative decoding (``held_rows`` R) a step with drafts also gives
each token of a drafting sequence its row in the layers' held buffers (``slot * R + j``; -1 for
the others' tokens: ``AttentionMetadata.state_held_at``), a static field of the verification
graphs too; such a step runs eagerly where no verification graph holds it.
A step that is one sequence's query chunk fitting a prefill graph (``cuda_graph.py``) writes its
tokens there too, padded to the graph's query length with tokens that write nowhere; its
context length is the chunk's start + the graph's query length.
A step whose sequences each compute at most ``verify_q`` tokens (speculative decoding's
verification) and that fits a verification graph is laid out ``verify_q`` rows a sequence: each
sequence's tokens, then padding that writes nowhere (context length: the chunk's start +
``verify_q``); padding sequences attend over the first ``verify_q`` positions of the tables'
padding row (block 0, ``DeviceBlockTables.pad_row``). The
rows to sample, score and pool and the placeholders' positions follow their tokens there.

The host buffer is reused every step, so before writing it the builder waits for the previous
step's copy (an event: free on rank 0, which synchronizes on the sampled tokens anyway).

Overlapped steps: a placeholder id (negative: ``nvray/step_protocol.py``) stands for a token the
previous step is still sampling on the device; the builder sends where each one goes and which
row of that step's sampled ids fills it, and fills them on the device after the copy, so the
token never travels to the host and back before the next step can start. A draft model's drafts
are placeholders too (every draft of the sequence), filled the same way from the drafter's ids.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

import torch

from nvray.step_protocol import SeqStep, StepInput, placeholder_row
from nvray.worker.held_chunks import is_held
from nvray.layers.attention import AttentionMetadata
from nvray.worker.block_tables import DeviceBlockTables

SHARED_FIELDS = 4  # ids, positions, seq_lens, rows; then one slots field per group
_ALIGN = 4  # int32 elements: every tensor starts 16-byte aligned (Triton specializes on it)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class GraphShapes(NamedTuple):
    """The captured CUDA graphs' shapes, each ascending (empty: none; all empty: eager only)."""

    decode: tuple[int, ...] = ()  # batch sizes of decode graphs
    prefill: tuple[int, ...] = ()  # query lengths of one-sequence prefill graphs
    verify: tuple[int, ...] = ()  # batch sizes of verification graphs ...
    verify_q: int = 0  # ... of this many query rows a sequence


class StepBatch(NamedTuple):
    input_ids: torch.Tensor  # [T] int32 (graph: [graph_bs], padded)
    positions: torch.Tensor  # [T] int32
    meta: AttentionMetadata | None  # None on the graph path: the graph holds its own
    sample_idx: torch.Tensor | None  # [S + R + P] int32 rows of the hidden states to sample,
    # then to score (prompt log-probabilities), then to pool; None: rows 0..S-1
    num_samples: int
    num_seqs: int
    graph_bs: int  # batch size of the decode CUDA graph to replay; 0: none
    prefill_q: int = 0  # query length of the prefill CUDA graph to replay; 0: none
    verify_bs: int = 0  # batch size of the verification CUDA graph to replay; 0: none
    num_scores: int = 0  # R
    num_pools: int = 0  # P


_Fill = tuple[torch.Tensor, torch.Tensor]  # device (placeholder positions, sampled rows)


class StaticInputs(NamedTuple):
    """The CUDA graphs' static inputs (views of one device buffer)."""

    ids: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor
    rows: torch.Tensor
    slots: list[torch.Tensor]  # one per block-table group
    state_slots: torch.Tensor | None  # models with recurrent layers: each sequence's slot
    held_at: torch.Tensor | None  # ... with speculation: each token's held row (verification)


class _HostLists(NamedTuple):
    ids: list[int]
    pos: list[int]
    slots: list[list[int]]  # one list per block-table group
    q_lens: list[int]
    seq_lens: list[int]
    rows: list[int]
    sample: list[int]
    upd_idx: list[int]
    upd_val: list[int]
    fill_dst: list[int]  # positions in ids of placeholders
    fill_src: list[int]  # ... and the rows of the previous step's sampled ids that fill them
    score: list[int]  # rows of prompt tokens to score (after the rows to sample)
    state: list[int]  # each sequence's recurrent-state slot (models with recurrent layers)
    pool: list[int]  # rows of prompts' last tokens to pool (after the rows to score)
    held: list[int]  # with held chunks: each token's held row (-1: not held); else empty

    @property
    def reads_more(self) -> bool:
        """Whether rows besides the sampled ones are read (to score or to pool)."""
        return bool(self.score or self.pool)

    @property
    def gathered(self) -> list[int]:
        return self.sample + self.score + self.pool if self.reads_more else self.sample


class InputBuilder:
    def __init__(self, block_size: int, max_model_len: int, max_num_seqs: int,
                 graph_capacity: int, device: torch.device, num_groups: int = 1,
                 has_state: bool = False, tables: DeviceBlockTables | None = None,
                 held_rows: int = 0) -> None:
        """``tables``: another builder's (a draft model's builder shares the target's: the same
        blocks; syncing a step's changes twice changes nothing); ``held_rows``: the recurrent
        layers' held rows a slot (speculative decoding on a model with recurrent layers)."""
        self.block_size = block_size
        self.num_groups = num_groups
        self.has_state = has_state
        self.held_rows = held_rows
        self.max_positions = -(-max_model_len // block_size) * block_size  # the tables' reach
        self.device = device
        self.cuda = device.type == "cuda"
        self.tables = tables or DeviceBlockTables(2 * max_num_seqs + 3,
                                                  -(-max_model_len // block_size), device,
                                                  num_groups)  # + its padding row
        self.graph_capacity = _aligned(graph_capacity)
        self.static_fields = SHARED_FIELDS + num_groups + has_state + bool(held_rows)
        self.static = torch.zeros(self.static_fields * self.graph_capacity, dtype=torch.int32,
                                  device=device)
        self.copy_done = torch.cuda.Event() if self.cuda else None
        self.host = torch.empty(0, dtype=torch.int32)
        self._grow(self.static_fields * self.graph_capacity + 4096)

    def static_views(self) -> StaticInputs | None:
        """The graphs' static inputs (None: no graphs)."""
        if not self.graph_capacity:
            return None
        fields = self.static.view(self.static_fields, -1).unbind(0)
        groups = list(fields[SHARED_FIELDS:SHARED_FIELDS + self.num_groups])
        extra = list(fields[SHARED_FIELDS + self.num_groups:])
        state = extra.pop(0) if self.has_state else None
        return StaticInputs(*fields[:SHARED_FIELDS], groups, state,
                            extra.pop(0) if self.held_rows else None)

    # ------------------------------------------------------------------ build
    def prepare(self, step: StepInput, shapes: GraphShapes = GraphShapes(),
                prev_sampled: torch.Tensor | None = None) -> StepBatch:
        """``shapes``: the captured graphs' (none: eager only); ``prev_sampled``: the previous
        step's sampled ids on the device (int32), or the drafter's, which fill the
        placeholders."""
        if self.copy_done is not None:
            self.copy_done.synchronize()  # the host buffer is free again
        lists = self._collect(step)
        if lists.fill_dst:
            assert prev_sampled is not None and max(lists.fill_src) < prev_sampled.numel(), (
                "a placeholder token refers to no sampled id of the previous step")
        num_seqs, decode = len(lists.rows), shapes.decode
        if decode and max(lists.q_lens) == 1 and num_seqs <= decode[-1]:  # (held: 2+ tokens)
            batch, fill = self._prepare_graph(lists, decode[bisect.bisect_left(decode, num_seqs)])
        elif verify_bs := self._verify_graph_for(lists, shapes):
            batch, fill = self._prepare_verify_graph(lists, verify_bs, shapes.verify_q)
        elif not lists.held and (prefill_q := self._prefill_graph_for(lists, shapes.prefill)):
            batch, fill = self._prepare_prefill_graph(lists, prefill_q)
        else:
            batch, fill = self._prepare_eager(lists)
        if lists.fill_dst:
            dst, src = fill
            batch.input_ids[dst] = prev_sampled[src]  # type: ignore[index]
        return batch

    def _verify_graph_for(self, h: _HostLists, shapes: GraphShapes) -> int:
        """The batch size of the verification graph that can run this step, or 0."""
        q, sizes = shapes.verify_q, shapes.verify
        if not sizes or len(h.rows) > sizes[-1] or max(h.q_lens) > q:
            return 0
        # each padded context must stay within the block table (max_model_len)
        if any(end - n + q > self.max_positions for n, end in zip(h.q_lens, h.seq_lens)):
            return 0
        return sizes[bisect.bisect_left(sizes, len(h.rows))]

    def _prefill_graph_for(self, h: _HostLists, prefill_sizes: tuple[int, ...]) -> int:
        """The query length of the prefill graph that can run this step, or 0."""
        if len(h.rows) != 1 or not prefill_sizes or h.q_lens[0] > prefill_sizes[-1]:
            return 0
        q = prefill_sizes[bisect.bisect_left(prefill_sizes, h.q_lens[0])]
        # the padded context must stay within the block table (max_model_len)
        return q if h.seq_lens[0] - h.q_lens[0] + q <= self.max_positions else 0

    def _collect(self, step: StepInput) -> _HostLists:
        bs, tables, groups = self.block_size, self.tables, self.num_groups
        tables.begin_step()
        if step.released:
            tables.release(step.released)
        h = _HostLists([], [], [[] for _ in range(groups)], [], [], [], [], [], [], [], [], [], [],
                       [], [])
        slots = h.slots[0]
        holds = self.held_rows and any(is_held(s, self.held_rows) for s in step.seqs)
        for s in step.seqs:
            n, start = len(s.token_ids), s.start_pos
            end = start + n
            if s.score is not None:
                first = len(h.ids) + s.score.offset
                h.score.extend(range(first, first + len(s.score.targets)))
            row, table = tables.sync(s.seq_id, s.block_table, s.table_start, h.upd_idx, h.upd_val)
            h.rows.append(row)
            h.state.append(s.state_slot)
            if holds:
                self._held_rows_of(h.held, s)
            h.ids.extend(s.token_ids)
            if s.token_ids[-1] < 0:  # placeholders: the last token, or every draft
                for at in range(len(h.ids) - (s.num_drafts or 1), len(h.ids)):
                    h.fill_dst.append(at)
                    h.fill_src.append(placeholder_row(h.ids[at]))
                    h.ids[at] = 0
            if n == 1 and groups == 1:  # the decode token of a one-group model: the hot path
                h.pos.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                h.pos.extend(range(start, end))
                self._group_slots(h.slots, table, start, end)
            h.q_lens.append(n)
            h.seq_lens.append(end)
            if s.sample is not None:  # its last row, and one before it per draft
                h.sample.extend(range(len(h.ids) - 1 - s.num_drafts, len(h.ids)))
            if s.pool is not None:
                h.pool.append(len(h.ids) - 1)
        return h

    def _held_rows_of(self, held: list[int], s: SeqStep) -> None:
        """The held rows of ``s``'s chunk (``held_chunks.is_held``), at its slot's; -1 each
        where it is not held."""
        n = len(s.token_ids)
        if not is_held(s, self.held_rows):
            held.extend([-1] * n)
            return
        held.extend(range(s.state_slot * self.held_rows, s.state_slot * self.held_rows + n))

    def _group_slots(self, slots: list[list[int]], table: list[int], start: int, end: int) -> None:
        """The KV slots of positions ``start .. end - 1`` in each group's table (whole runs of
        slots per block)."""
        bs, groups = self.block_size, self.num_groups
        for b in range(start // bs, (end - 1) // bs + 1):
            lo, hi = max(start, b * bs), min(end, (b + 1) * bs)
            for g in range(groups):
                base = table[b * groups + g] * bs - b * bs
                slots[g].extend(range(base + lo, base + hi))

    def _prepare_graph(self, h: _HostLists, graph_bs: int) -> tuple[StepBatch, _Fill]:
        n = len(h.rows)
        fields = [(h.ids, 0, graph_bs), (h.pos, 0, graph_bs), (h.seq_lens, 0, graph_bs),
                  (h.rows, 0, graph_bs)] + [(s, -1, graph_bs) for s in h.slots]
        fields += [(h.state, -1, graph_bs)] if self.has_state else []
        sample_all = len(h.sample) == n and not h.reads_more
        sample, fill = self._write_static(h, fields, [] if sample_all else h.gathered, h.fill_dst)
        ids, pos = self.static_views()[:2]  # type: ignore[index]
        return StepBatch(ids[:graph_bs], pos[:graph_bs], None, None if sample_all else sample,
                         len(h.sample), n, graph_bs, num_scores=len(h.score),
                         num_pools=len(h.pool)), fill

    def _prepare_prefill_graph(self, h: _HostLists, q: int) -> tuple[StepBatch, _Fill]:
        n = len(h.ids)
        fields = [(h.ids, 0, q), (h.pos, 0, q), ([h.seq_lens[0] - n + q], 0, 1), (h.rows, 0, 1)]
        fields += [(s, -1, q) for s in h.slots] + ([(h.state, -1, 1)] if self.has_state else [])
        sample, fill = self._write_static(h, fields, h.gathered, h.fill_dst)
        ids, pos = self.static_views()[:2]  # type: ignore[index]
        return StepBatch(ids[:q], pos[:q], None, sample, len(h.sample), 1, 0, prefill_q=q,
                         num_scores=len(h.score), num_pools=len(h.pool)), fill

    def _prepare_verify_graph(self, h: _HostLists, bs: int, q: int) -> tuple[StepBatch, _Fill]:
        """``q`` rows a sequence (its tokens, then padding) for ``bs`` sequences (then padding
        sequences over the first ``q`` positions of the tables' padding row: block 0)."""
        where = [i * q + j for i, n in enumerate(h.q_lens) for j in range(n)]  # each token's row

        def spread(values: list[int], pad: int) -> list[int]:
            rows = [pad] * (len(h.q_lens) * q)
            for at, value in zip(where, values):
                rows[at] = value
            return rows

        seq_lens = [end - n + q for n, end in zip(h.q_lens, h.seq_lens)]
        fields = [(spread(h.ids, 0), 0, bs * q), (spread(h.pos, 0), 0, bs * q),
                  (seq_lens, q, bs), (h.rows, self.tables.pad_row, bs)]
        fields += [(spread(s, -1), -1, bs * q) for s in h.slots]
        fields += [(h.state, -1, bs)] if self.has_state else []
        fields += [(spread(h.held or [-1] * len(h.ids), -1), -1, bs * q)] if self.held_rows else []
        sample, fill = self._write_static(h, fields, [where[j] for j in h.gathered],
                                          [where[j] for j in h.fill_dst])
        ids, pos = self.static_views()[:2]  # type: ignore[index]
        return StepBatch(ids[:bs * q], pos[:bs * q], None, sample, len(h.sample), len(h.rows), 0,
                         verify_bs=bs, num_scores=len(h.score), num_pools=len(h.pool)), fill

    def _write_static(self, h: _HostLists, fields: list[tuple[list[int], int, int]],
                      gathered: list[int], fill_dst: list[int]) -> tuple[torch.Tensor, _Fill]:
        """Write each static field (its values, then its padding value up to its length), and
        upload them with the rows to gather, the table updates and the placeholders; returns
        the device rows to gather and the placeholders' (positions, sampled rows)."""
        cap, a = self.graph_capacity, self.host_np
        for f, (values, pad, length) in enumerate(fields):
            a[f * cap:f * cap + len(values)] = values
            a[f * cap + len(values):f * cap + length] = pad
        head = self.static_fields * cap
        tail = self._fill(head, gathered, h.upd_idx, h.upd_val, fill_dst, h.fill_src)
        self.static.copy_(self.host[:head], non_blocking=True)
        sample, upd_idx, upd_val, dst, src = self._upload(
            head, tail, [len(gathered), len(h.upd_idx), len(h.upd_val), len(fill_dst),
                         len(h.fill_src)])
        self.tables.apply(upd_idx, upd_val)
        self._record()
        return sample, (dst, src)

    def _prepare_eager(self, h: _HostLists) -> tuple[StepBatch, _Fill]:
        cu = [0]
        for q in h.q_lens:
            cu.append(cu[-1] + q)
        groups = self.num_groups
        parts = [h.ids, h.pos, *h.slots, cu, h.seq_lens, h.rows, h.gathered, h.upd_idx, h.upd_val,
                 h.fill_dst, h.fill_src, h.state, h.held]
        end = self._fill(0, *parts)
        views = self._upload(0, end, [len(p) for p in parts])
        ids, pos, slots = views[0], views[1], views[2:2 + groups]
        cu_q, seq_lens, rows, sample, upd_idx, upd_val, dst, src, state, held = views[2 + groups:]
        self.tables.apply(upd_idx, upd_val)
        max_seq_len = max(h.seq_lens)
        width = -(-max_seq_len // self.block_size)
        tables = [t[:, :width].index_select(0, rows) for t in self.tables.group_tables]  # [B, width]
        self._record()
        meta = AttentionMetadata(slot_mapping=slots[0], query_start_loc=cu_q, seq_lens=seq_lens,
                                 block_tables=tables[0], max_query_len=max(h.q_lens),
                                 max_seq_len=max_seq_len, query_lens_cpu=h.q_lens,
                                 seq_lens_cpu=h.seq_lens,
                                 state_slots=state if self.has_state else None,
                                 state_held_at=held if h.held else None)
        if groups > 1:
            meta.with_groups(slots, tables)
        sample_all = not h.reads_more and h.sample == list(range(len(h.sample)))  # e.g. decodes
        return StepBatch(ids, pos, meta, None if sample_all else sample, len(h.sample),
                         len(h.rows), 0, num_scores=len(h.score), num_pools=len(h.pool)), (dst, src)

    # -------------------------------------------------------------- buffers
    def _fill(self, offset: int, *parts: list[int]) -> int:
        """Write ``parts`` one after another (each 16-byte aligned) into the host buffer from
        ``offset``; returns the end. A part's start moving between aligned and unaligned would
        make Triton compile another variant of each kernel that reads it, mid-run."""
        end = offset + sum(_aligned(len(p)) for p in parts)
        if end > self.host.numel():
            self._grow(end)
        a = self.host_np
        for p in parts:
            a[offset:offset + len(p)] = p
            offset += _aligned(len(p))
        return end

    def _upload(self, start: int, end: int, lengths: list[int]) -> list[torch.Tensor]:
        """Copy host[start:end] to the device at the same offsets; views of the given lengths."""
        if self.cuda and end > start:
            self.dev[start:end].copy_(self.host[start:end], non_blocking=True)
        views, offset = [], start
        for n in lengths:
            views.append(self.dev[offset:offset + n])
            offset += _aligned(n)
        return views

    def _record(self) -> None:
        if self.copy_done is not None:
            self.copy_done.record()

    def _grow(self, n: int) -> None:
        """A larger buffer (rare: sized for the largest step seen), keeping what was written."""
        n = max(n, 2 * self.host.numel())
        if self.copy_done is not None:
            torch.cuda.synchronize(self.device)  # the old buffers may still be in use
        old = self.host
        with torch.inference_mode(False):  # plain tensors, writable in or out of inference mode
            self.host = torch.zeros(n, dtype=torch.int32, pin_memory=self.cuda)
            self.host[:old.numel()] = old
            self.dev = torch.empty(n, dtype=torch.int32, device=self.device) if self.cuda else self.host
        self.host_np = self.host.numpy()
