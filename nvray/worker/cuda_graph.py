"""StepGraphs: the model's forward captured in CUDA graphs: decode batches, short prefills,
speculative verification batches.

A decode step of a few hundred sequences of a small model is a few hundred kernel launches
whose host cost exceeds their GPU time; replaying a graph launches them all at once. Graphs are
captured for ``graph_batch_sizes(max_num_seqs)`` (1, 2, 4, 8, then multiples of 16 up to
min(max_num_seqs, 512)), largest first, sharing one memory pool. A decode batch runs in the
smallest graph that holds it; the padding rows have seq_len 0 (the decode kernel writes zeros)
and slot -1 (nothing is stored). Larger batches, and steps with a prefill chunk that neither a
prefill graph nor a verification graph (below) holds, run eager.

Inputs are the InputBuilder's static buffers; block tables are gathered inside the graph from
the device block table (``max_model_len`` wide), so the decode kernel's split-K grid is sized
for ``max_model_len`` and one graph serves every context length. With tensor parallelism the
row-parallel all-reduces (NCCL) are captured too. Sampling stays outside: the graph ends with
the hidden states (``row_shape`` per token: (hidden,), or (2, hidden) for a pipeline stage before
the last: hidden states and residual), and the LM head and sampler run eager on the rows to
sample.

Prefill graphs (``prefill_graph_sizes``: 16, 32, ... up to ``max_prefill_graph_tokens``) serve a
step that is ONE sequence's query chunk of up to that many tokens: an eager forward of a small
model costs tens of milliseconds of host time (hundreds of launches) for ~2 ms of GPU work, and
that is the time to first token of a request arriving at an idle engine. The chunk is padded
to the graph's Q tokens: the graph's query is always Q long and its context length is the
chunk's start + Q, so the real tokens sit at their true positions; the padding rows come
after them, write nowhere (slot -1), and only they can see the padding positions (causal
mask), so the real rows compute exactly what an eager forward would.

Verification graphs (speculative decoding, ``verify_q`` = k + 1; batch sizes
``verify_graph_sizes``: the decode sizes up to ``disable_by_batch_size``) serve a step whose
sequences each compute at most ``verify_q`` tokens (a sequence's newest token and its drafts; a
plain decode; a short prompt chunk): every sequence gets ``verify_q`` query rows, its real tokens
first and then padding as in a prefill graph (context length: the chunk's start + ``verify_q``);
padding sequences attend over the first ``verify_q`` positions of the tables' padding row
(block 0) and write nowhere. Without them several sequences' verification ran eagerly, about 3x a decode step
on an 8B model (docs/speculative.md). A model with recurrent layers reads each token's held row
(``state_held_at``, a static input) there, its padding rows neither decaying nor writing a state.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from nvray.layers.attention import AttentionMetadata
from nvray.worker.inputs import GraphShapes, InputBuilder, StepBatch

if TYPE_CHECKING:
    from nvray.config import EngineConfig

logger = logging.getLogger(__name__)
_MAX_GRAPH_BS = 512

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def prefill_graph_sizes(max_tokens: int) -> list[int]:
    """Captured prefill query lengths, ascending: 16, 32, 64, ... up to ``max_tokens``."""
    return [q for q in (16 << i for i in range(12)) if q <= max_tokens]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Captured batch sizes, ascending: 1, 2, 4, 8, 16, 32, ... up to min(max_num_seqs, 512)."""
    top = min(max_num_seqs, _MAX_GRAPH_BS)
    sizes = [b for b in (1, 2, 4, 8) if b < top] + list(range(16, top + 1, 16))
    return sizes if sizes and sizes[-1] == top else sizes + [top]


def verify_graph_sizes(max_num_seqs: int, drafting_batch: int) -> list[int]:
    """Captured verification batch sizes: the decode graphs' up to ``drafting_batch`` sequences
    (the most that draft in one step: ``disable_by_batch_size``)."""
    return graph_batch_sizes(min(max_num_seqs, drafting_batch))


def graph_capacity(shapes: GraphShapes) -> int:
    """Tokens the static inputs must hold for these graphs."""
    return max([*shapes.decode, *shapes.prefill,
                *(bs * shapes.verify_q for bs in shapes.verify)], default=0)


def graph_shapes_for(config: EngineConfig) -> GraphShapes:
    """The graphs to capture: decode batches, short prefills and, with speculation,
    verification batches of k + 1 tokens a sequence."""
    spec = config.speculative
    verify = (verify_graph_sizes(config.max_num_seqs, spec.disable_by_batch_size)
              if spec is not None else [])
    return GraphShapes(tuple(graph_batch_sizes(config.max_num_seqs)),
                       tuple(prefill_graph_sizes(config.max_prefill_graph_tokens)),
                       tuple(verify), spec.num_speculative_tokens + 1 if spec else 0)


def graphs_possible(device: torch.device, enforce_eager: bool, backend: Any) -> bool:
    """Whether this rank captures graphs: CUDA, not ``enforce_eager``, a backend that can be
    captured (a warning says why not otherwise)."""
    if device.type != "cuda" or enforce_eager:
        return False
    if not backend.supports_cuda_graphs:
        logger.warning("CUDA graphs are off: the %s attention backend cannot be captured",
                       backend.name)
        return False
    return True


class StepGraphs:
    def __init__(self, forward: Forward, inputs: InputBuilder, shapes: GraphShapes,
                 row_shape: tuple[int, ...], dtype: torch.dtype, max_model_len: int) -> None:
        assert graph_capacity(shapes) <= inputs.graph_capacity, "inputs too small for the graphs"
        self.forward = forward
        self.inputs = inputs
        self.shapes = shapes
        self.verify_q = shapes.verify_q
        self.max_model_len = max_model_len
        (self.ids, self.pos, self.seq_lens, self.rows, self.group_slots, self.state_slots,
         self.held_at) = inputs.static_views()
        cap = inputs.graph_capacity
        self.query_start_loc = torch.arange(cap + 1, dtype=torch.int32, device=inputs.device)
        self.out = torch.zeros(cap, *row_shape, dtype=dtype, device=inputs.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.prefill_query_start = {q: torch.tensor([0, q], dtype=torch.int32, device=inputs.device)
                                    for q in shapes.prefill}
        self.verify_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        most = max(shapes.verify, default=0)
        self.verify_query_start = self.verify_q * torch.arange(most + 1, dtype=torch.int32,
                                                               device=inputs.device)
        self.pool = None

    def _meta(self, num_tokens: int, num_seqs: int, query_start_loc: torch.Tensor,
              max_query_len: int, holds: bool = False) -> AttentionMetadata:
        """A captured region's metadata: its block tables gathered inside the graph, one set
        per block-table group; ``holds`` (verification): each token's held row too."""
        slots = [s[:num_tokens] for s in self.group_slots]
        tables = [t.index_select(0, self.rows[:num_seqs]) for t in self.inputs.tables.group_tables]
        meta = AttentionMetadata(
            slot_mapping=slots[0], query_start_loc=query_start_loc,
            seq_lens=self.seq_lens[:num_seqs], block_tables=tables[0],
            max_query_len=max_query_len, max_seq_len=self.max_model_len, query_lens_cpu=[],
            seq_lens_cpu=[],
            state_slots=None if self.state_slots is None else self.state_slots[:num_seqs],
            state_held_at=self.held_at[:num_tokens] if holds and self.held_at is not None
            else None, padded_rows=True)
        return meta.with_groups(slots, tables) if len(tables) > 1 else meta

    def _run(self, bs: int) -> None:
        """The captured region: gather block tables, run the model, keep the hidden states."""
        meta = self._meta(bs, bs, self.query_start_loc[:bs + 1], 1)
        self.out[:bs] = self.forward(self.ids[:bs], self.pos[:bs], meta)

    def _run_prefill(self, q: int) -> None:
        """The captured region of a prefill graph: one sequence, a query of ``q`` tokens."""
        meta = self._meta(q, 1, self.prefill_query_start[q], q)
        self.out[:q] = self.forward(self.ids[:q], self.pos[:q], meta)

    def _run_verify(self, bs: int) -> None:
        """The captured region of a verification graph: ``bs`` sequences of ``verify_q`` query
        tokens each."""
        q = self.verify_q
        meta = self._meta(bs * q, bs, self.verify_query_start[:bs + 1], q, holds=True)
        self.out[:bs * q] = self.forward(self.ids[:bs * q], self.pos[:bs * q], meta)

    def _capture_one(self, run: Callable[[int], None], size: int) -> torch.cuda.CUDAGraph:
        run(size)  # warm-up outside the graph (allocator, Triton compilation)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            run(size)
        self.pool = self.pool or graph.pool()
        return graph

    @torch.inference_mode()
    def capture(self, shapes: GraphShapes | None = None) -> float:
        """Capture the graphs of ``shapes`` (None: all of this object's; a part of them: the
        memory estimate's trials), each kind largest first, into one shared pool; returns the
        seconds it took."""
        start = time.perf_counter()
        for run, graphs, size in self._regions(shapes or self.shapes):
            graphs[size] = self._capture_one(run, size)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    @torch.inference_mode()
    def rehearse(self) -> None:
        """Run every region ``capture`` would capture once, eagerly, capturing nothing (the
        launches a capture makes, for ``compile_ahead.py``)."""
        for run, _, size in self._regions(self.shapes):
            run(size)

    def _regions(self, shapes: GraphShapes
                 ) -> Iterator[tuple[Callable[[int], None], dict[int, torch.cuda.CUDAGraph], int]]:
        """The regions in capture order (each kind largest first), as (the region's run, the
        graphs it goes to, size), each with its static inputs set: decode batches run the model
        once and write nothing, attend to nothing (slot -1, seq_len 0); a verification batch's
        sequences and a prefill of q tokens attend over a context of q positions (row 0 of the
        tables: block 0)."""
        for slots in [*self.group_slots, self.state_slots, self.held_at]:
            if slots is not None:
                slots.fill_(-1)
        self.seq_lens.zero_()
        self.rows.zero_()
        try:
            for bs in sorted(shapes.decode, reverse=True):
                yield self._run, self.graphs, bs
            for bs in sorted(shapes.verify, reverse=True):
                self.seq_lens[:bs] = self.verify_q
                yield self._run_verify, self.verify_graphs, bs
            self.seq_lens.zero_()
            for q in sorted(shapes.prefill, reverse=True):
                self.seq_lens[:1] = q
                yield self._run_prefill, self.prefill_graphs, q
        finally:
            self.seq_lens.zero_()

    def replay_for(self, batch: StepBatch) -> torch.Tensor | None:
        """The hidden states of ``batch`` from the graph its builder laid it out for (decode,
        prefill or verification); None: it runs eagerly."""
        if batch.graph_bs:
            return self.replay(batch.graph_bs)
        if batch.prefill_q:
            return self.replay_prefill(batch.prefill_q)
        if batch.verify_bs:
            return self.replay_verify(batch.verify_bs)
        return None

    def replay(self, bs: int) -> torch.Tensor:
        """Run the graph of batch size ``bs`` on the static inputs; [bs, hidden] (a static view)."""
        self.graphs[bs].replay()
        return self.out[:bs]

    def replay_prefill(self, q: int) -> torch.Tensor:
        """Run the prefill graph of query length ``q``; [q, hidden] (a static view)."""
        self.prefill_graphs[q].replay()
        return self.out[:q]

    def replay_verify(self, bs: int) -> torch.Tensor:
        """Run the verification graph of ``bs`` sequences; [bs * verify_q, hidden] (a static
        view)."""
        self.verify_graphs[bs].replay()
        return self.out[:bs * self.verify_q]

    def release(self) -> None:
        self.graphs.clear()
        self.prefill_graphs.clear()
        self.verify_graphs.clear()
        self.pool = None
