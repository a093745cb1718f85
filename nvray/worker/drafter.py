"""Drafter: speculative decoding's draft model (``speculative_config`` method ``draft_model``),
run on the target's ranks, in the same call as the step that verifies its drafts.

What it holds: a small model with the target's vocabulary (any family nvray serves, without
windowed or recurrent layers), sharded over the target's tensor-parallel ranks as the target
is, and its own paged KV cache with as many blocks as the target's: block ``b`` of the target's
cache has its twin here, so it reads the target's block tables (the same ``DeviceBlockTables``)
and forks and preemption need nothing of their own.

``run(step)``, before the target's forward of ``step``, only where some ``SeqStep`` feeds it
(``draft_tokens``: the engine sends what the draft cache lacks, ``nvray/engine/speculation.py``;
steps without drafts cost the draft model nothing):
1. one forward over every fed sequence's ``draft_tokens`` from ``draft_start``; a sequence with
   model drafts (placeholders, ``nvray/step_protocol.py``) is fed through its newest token,
   whose row proposes its first draft;
2. one decode forward per further draft position, over the sequences that draft that far, each
   feeding its previous draft.
Drafts are the draft model's greedy tokens (rank 0 picks them, every rank gets them). It
returns the drafts as one device tensor indexed by the placeholders' rows (None when the step
has no model drafts); the target's input builder fills the placeholders from it. What the
draft cache holds only ever changes which drafts are proposed, never which tokens are kept.

CUDA graphs (``cuda_graph.py``): decode graphs and graphs of two rows a sequence (a drafting
sequence feeds its newest token, and the last draft of a run kept whole; EAGLE-3: k + 1 rows,
the run's kept tokens) up to
``disable_by_batch_size`` sequences, and one-sequence prefill graphs; other forwards run
eagerly. They share the target's graph memory pool: graphs run one after another and keep
nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from nvray.config import EngineConfig
from nvray.kv_layout import plan_kv_layout
from nvray.layers.rotary import rope_max_positions
from nvray.layers.tp import broadcast_from_first
from nvray.model_config import load_model_config
from nvray.models.tiny import resolve_model
from nvray.quantization import quant_config_for
from nvray.speculative import SpeculativeConfig
from nvray.step_protocol import SampleSpec, SeqStep, StepInput, placeholder_id
from nvray.worker.block_tables import DeviceBlockTables
from nvray.worker.cuda_graph import (StepGraphs, graph_batch_sizes, graph_capacity,
                                     prefill_graph_sizes)
from nvray.worker.device_lists import to_device
from nvray.worker.inputs import GraphShapes, InputBuilder, StepBatch
from nvray.worker.kv_cache import PagedKV
from nvray.worker.setup import build_model, enable_torch_compile, use_triton_kernels

_GREEDY = SampleSpec(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, seed=None, step_index=0)


def has_model_drafts(s: SeqStep) -> bool:
    """Whether the ranks' drafter fills this sequence's drafts (placeholders)."""
    return s.num_drafts > 0 and s.token_ids[-1] < 0


class Drafter:
    """The draft model (method ``draft_model``); ``eagle_drafter.py`` subclasses it for EAGLE-3
    through the hooks ``_load_config``, ``_check_reach``, ``_build``, ``row_shape``, ``_fed``,
    ``shift``,
    ``_set_inputs`` and ``_greedy``."""

    shift = 0  # a drafter row's position before its token's (EAGLE-3: 1)

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, target_vocab: int,
                 device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
                 max_model_len: int, backend: Any, tables: DeviceBlockTables,
                 graphs: bool) -> None:
        path = resolve_model(spec.model)  # type: ignore[arg-type]
        self.spec, self.config = spec, config
        self.hf_config = self._load_config(path)
        vocab = self.hf_config.vocab_size
        if vocab != target_vocab:
            raise ValueError(f"speculative_config model={spec.model!r}: its vocabulary has {vocab} "
                             f"tokens, the target's {target_vocab}: a drafter must share the "
                             "target's tokenizer and vocabulary")
        self._check_reach(max_model_len)
        self.device, self.dtype, self.kv_dtype = device, dtype, kv_dtype
        self.block_size, self.max_model_len = config.kvcache_block_size, max_model_len
        self.model = self._build(path, config)
        self.layers = self.model.attention_layers()
        if any(layer.sliding_window for layer in self.layers) or (
                hasattr(self.model, "state_layers") and self.model.state_layers()):
            raise ValueError(f"speculative_config model={spec.model!r}: a draft model needs "
                             "full attention in every layer (no sliding windows, no recurrent "
                             "layers)")
        for layer in self.layers:
            layer.backend, layer.kv_group = backend, 0
        if device.type == "cuda":
            enable_torch_compile(self.model)
            use_triton_kernels(self.model)
        drafting = min(config.max_num_seqs, spec.disable_by_batch_size)
        sizes = tuple(graph_batch_sizes(drafting))
        # a feed's rows a sequence after a verified run: the last draft and the token after
        # it (a draft model), or every kept token of the run (EAGLE-3 feeds accepted drafts
        # again: up to k + 1)
        feed_q = spec.num_speculative_tokens + 1 if spec.refeeds_accepted else 2
        self.shapes = (GraphShapes(sizes, tuple(prefill_graph_sizes(
            config.max_prefill_graph_tokens)), sizes, feed_q) if graphs else GraphShapes())
        self.inputs = InputBuilder(self.block_size, max_model_len, config.max_num_seqs,
                                   graph_capacity(self.shapes), device, tables=tables)
        self.drafts = torch.zeros(drafting * spec.num_speculative_tokens, dtype=torch.int32,
                                  device=device)
        self.graphs: StepGraphs | None = None
        self.num_graph_replays = 0  # draft forwards that replayed a graph
        self.cache = PagedKV(self.layers, plan_kv_layout([None] * len(self.layers)),
                             self.block_size, kv_dtype, device)  # a tensor pair a layer

    def _load_config(self, path: str) -> Any:
        """The drafter's config (its checkpoint's)."""
        return load_model_config(path)

    def _check_reach(self, max_model_len: int) -> None:
        """Refuse a drafter whose positions reach less far than the target's requests."""
        reach = rope_max_positions(self.hf_config, getattr(self.hf_config, "layer_types", None))
        if reach < max_model_len:
            raise ValueError(f"speculative_config model={self.spec.model!r}: its positions reach "
                             f"{reach} tokens, fewer than max_model_len={max_model_len}: lower "
                             "max_model_len or choose a drafter that reaches as far")

    def _build(self, path: str, config: EngineConfig) -> torch.nn.Module:
        return build_model(self.hf_config, path, self.dtype, self.device, config.seed,
                           quant_config_for(self.hf_config, None), config.load_format)

    @property
    def row_shape(self) -> tuple[int, ...]:
        """What the model's forward returns a token (its graphs' output rows)."""
        return (self.hf_config.hidden_size,)

    # ----------------------------------------------------------------- memory
    @property
    def kv_block_bytes(self) -> int:
        """The draft cache's share of one block: every layer's K and V of ``block_size`` tokens."""
        return self.cache.block_bytes

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.cache.tensors

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """A zeroed draft cache of ``num_blocks`` blocks (0: none); graphs over the old one go."""
        self.release_graphs()
        self.cache.allocate(num_blocks)

    @property
    def num_graphs(self) -> int:
        shapes = self.shapes
        return len(shapes.decode) + len(shapes.prefill) + len(shapes.verify)

    def capture_graphs(self, pool: Any) -> None:
        """Capture the drafter's graphs into ``pool`` (the target's; None: a pool of their own)."""
        if not self.shapes.decode:
            return
        self.graphs = StepGraphs(self.model, self.inputs, self.shapes, self.row_shape,
                                 self.dtype, self.max_model_len)
        self.graphs.pool = pool
        self.graphs.capture()

    def release_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    def close(self) -> None:
        self.allocate_kv_cache(0)
        self.model = None  # type: ignore[assignment]
        self.layers = []

    # -------------------------------------------------------------------- step
    @torch.inference_mode()
    def run(self, step: StepInput) -> torch.Tensor | None:
        """Feed the draft cache and propose ``step``'s model drafts (see the module docstring);
        None when nothing is fed or drafted."""
        if step.block_copies:
            self._copy_blocks(step.block_copies)
        fed = [f for s in step.seqs if s.draft_tokens and (f := self._fed(s)).token_ids]
        if not fed:
            return None
        ids = self._forward(StepInput(fed, released=step.released), None, None)
        drafting = [s for s in step.seqs if has_model_drafts(s)]
        if not drafting:
            return None
        first_rows, row = [], 0
        for s in drafting:
            first_rows.append(row)
            row += s.num_drafts
        self._keep(ids, first_rows)
        held = self.inputs.tables.held
        active = list(range(len(drafting)))
        for j in range(1, max(s.num_drafts for s in drafting)):
            row_of = {i: r for r, i in enumerate(active)}  # rows of the previous pass's ids
            active = [i for i in active if drafting[i].num_drafts > j]
            passes = [SeqStep(drafting[i].seq_id, [placeholder_id(row_of[i])],
                              drafting[i].start_pos + j - self.shift, [], _GREEDY,
                              table_start=len(held[drafting[i].seq_id])) for i in active]
            ids = self._forward(StepInput(passes), ids, [row_of[i] for i in active])
            self._keep(ids, [first_rows[i] + j for i in active])
        return self.drafts[:row]

    def _fed(self, s: SeqStep) -> SeqStep:
        """What ``s`` feeds the draft model: its ``draft_tokens``, the last row sampled where it
        drafts (then they end with its newest token); the block-table changes of the step
        (the target's builder applies them again)."""
        if has_model_drafts(s):
            assert s.draft_start + len(s.draft_tokens) == s.start_pos + 1, (
                "a drafting sequence feeds the draft model through its newest token")
        return SeqStep(s.seq_id, list(s.draft_tokens), s.draft_start, s.block_table,
                       _GREEDY if has_model_drafts(s) else None, table_start=s.table_start)

    def _forward(self, step: StepInput, prev: torch.Tensor | None,
                 prev_rows: list[int] | None) -> torch.Tensor:
        """Run one draft forward; the greedy token of each sampled row, on every rank
        (``prev``: the previous pass's, which ``step``'s placeholders name; ``prev_rows``: the
        row of the previous pass each sequence of a further pass continues, None in the
        feed)."""
        graphs = self.graphs
        batch = self.inputs.prepare(step, graphs.shapes if graphs is not None else GraphShapes(),
                                    prev)
        self._set_inputs(batch, prev_rows)
        hidden = graphs.replay_for(batch) if graphs is not None else None
        if hidden is None:
            hidden = self.model(batch.input_ids, batch.positions, batch.meta)
        else:
            self.num_graph_replays += 1
        n = batch.num_samples
        ids = torch.empty(n, dtype=torch.int32, device=self.device)
        if not n:
            return ids
        rows = hidden[:n] if batch.sample_idx is None else hidden[batch.sample_idx[:n]]
        greedy = self._greedy(rows)
        if greedy is not None:  # rank 0
            ids = greedy.to(torch.int32)
        return broadcast_from_first(ids)

    def _set_inputs(self, batch: StepBatch, prev_rows: list[int] | None) -> None:
        """Inputs the model reads besides the batch's (a draft model: none)."""

    def _greedy(self, rows: torch.Tensor) -> torch.Tensor | None:
        """The greedy token of each sampled row's output (rank 0; None elsewhere)."""
        logits = self.model.compute_logits(rows)
        return logits.argmax(-1) if logits is not None else None

    def _keep(self, ids: torch.Tensor, rows: list[int]) -> None:
        """Write a pass's drafts at their placeholder rows."""
        self.drafts.index_copy_(0, to_device(rows, self.device), ids)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write, as the target's cache does it."""
        self.cache.copy(copies)
