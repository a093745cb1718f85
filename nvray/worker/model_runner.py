"""ModelRunner: one tensor-parallel rank — model shard, paged KV cache, the forward pass.

Lifecycle: ``ModelRunner(config, model_path)`` sets the rank up (``setup.py``: device, dtype,
the model with its weights, the attention backend, the CUDA graph sizes); the start-up work
(``startup.py``: memory profile, KV cache sizing, kernel warm-up, graph capture) runs before the
first request; then ``steps`` (``step_launcher.py``) runs scheduled batches, one at a time or
launched ahead of their answers, each through ``forward(step)`` and the sampler. On the GPU the
norms, the attention prologue, the activation and the plain sampler run as hand-written Triton
kernels (``kernels/``; the layers ``torch.compile``d and the sampler eager where Triton is
missing), also with ``enforce_eager``, which turns off graphs only. Inputs are built by
``InputBuilder`` (one host-to-device copy per step); decode-only batches, speculative
verification batches and one-sequence short prefills that fit a graph replay it
(``cuda_graph.py``), everything else runs eager; the LM head and the sampler always run eager on
the rows to sample. Under pipeline parallelism (``layers/pp.py``) every rank runs every step on
its stage's layers: a stage after the first receives the previous stage's activations into the
model's ``stage_input`` before its forward (eager or a graph's replay), a stage before the last
sends its output on, and the last stage's first rank samples and answers (the others return
[]). ``close()`` gives the GPU memory back.
"""

from __future__ import annotations

import gc
import logging
import torch

from nvray.cache_dirs import point_compiler_caches
from nvray.config import EngineConfig
from nvray.layers.attention import select_backend
from nvray.layers.p2p_allreduce import set_up_all_reduce
from nvray.layers.pp import is_last_stage, pp_size, pp_stage, recv_from_prev, send_to_next
from nvray.layers.tp import set_expert_parallel, tp_rank, use_p2p_all_reduce
from nvray.kv_layout import plan_kv_layout
from nvray.model_config import load_model_config
from nvray.quantization import check_fp8_device, quant_config_for
from nvray.quantization.fp8_math import FP8_DTYPE
from nvray.speculative_methods import refuse_drafter_served
from nvray.startup_phases import StartupPhases
from nvray.step_protocol import StepInput
from nvray.worker.cuda_graph import (StepGraphs, graph_capacity, graph_shapes_for,
                                     graphs_possible)
from nvray.grammar import grammar_compiler
from nvray.worker.drafter import Drafter
from nvray.worker.step_profiler import StepProfiler
from nvray.worker.grammar_masks import GrammarMasks
from nvray.worker.held_chunks import HeldChunks
from nvray.worker.held_commit import HeldCommit
from nvray.worker.inputs import GraphShapes, InputBuilder
from nvray.worker.kv_cache import PagedKV, RankCaches, StateRows
from nvray.worker.memory import GpuMemoryReport, free_cached_memory, measure_used
from nvray.worker.sampled_ids import HostIds
from nvray.worker.step_launcher import StepLauncher
from nvray.worker.step_sampler import StepSampler
from nvray.worker.draft_ids import DraftIds
from nvray.worker.setup import (build_model, enable_torch_compile, lora_model,
                                resolve_dtype, resolve_max_model_len, stage_input_buffer,
                                torch_device, use_triton_kernels)

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str) -> None:
        point_compiler_caches()  # before the first Triton compile (the kernel warm-up)
        self.config = config
        self.model_path = model_path
        self.device = torch_device(config.device)
        self.memory_baseline = 0  # in use on the device before this rank's work (memory.py)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            self.memory_baseline = measure_used(self.device)
        self.hf_config = load_model_config(model_path, config.hf_overrides)  # no transformers import
        refuse_drafter_served(model_path, self.hf_config)
        self.dtype = resolve_dtype(config.dtype, self.hf_config, self.device)
        self.quant_config = quant_config_for(self.hf_config, config.quantization)
        self.kv_dtype = FP8_DTYPE if config.kv_cache_dtype == "fp8" else self.dtype
        self.block_size = config.kvcache_block_size
        self.max_model_len = resolve_max_model_len(config, self.hf_config)
        self.startup = StartupPhases()  # this rank's start-up, by phase (startup_phases.py)
        self._load_model()
        self._set_up_attention()
        graphs_wanted = graphs_possible(self.device, config.enforce_eager, self.backend)
        self.graph_shapes = graph_shapes_for(config) if graphs_wanted else GraphShapes()
        self._set_up_caches()
        rows = max(config.max_num_batched_tokens, self.inputs.graph_capacity)  # a step's most
        self.stage_input = stage_input_buffer(self.model, rows, self.hf_config.hidden_size,
                                              self.dtype, self.device)
        self.drafter = self._drafter(graphs_wanted)  # reads this rank's block tables
        self.lora = lora_model(self.model, config, self.quant_config is not None, rows,
                               self.device)
        self._set_up_steps()

    def _load_model(self) -> None:
        """The model with its weights; its attention and recurrent layers."""
        config = self.config
        with self.startup.phase("model_and_weights"):
            set_expert_parallel(config.enable_expert_parallel)
            self.model = build_model(self.hf_config, self.model_path, self.dtype, self.device,
                                     config.seed, self.quant_config, config.load_format)
        self.attention_layers = self.model.attention_layers()
        # recurrent layers (layers/gated_deltanet.py): a state per slot, a slot per sequence
        self.state_layers = self.model.state_layers() if hasattr(self.model, "state_layers") else []
        # a slot per running sequence, and as many for prefix caching's saved states
        self.num_state_slots = (config.max_num_seqs * (1 + config.enable_prefix_caching)
                                if self.state_layers else 0)
        if not self.attention_layers:  # a pipeline stage of a hybrid's linear layers only
            layers = self.model.model.layers.indices
            raise ValueError(
                f"pipeline stage {pp_stage()} holds no attention layer (layers {layers.start}.."
                f"{layers.stop - 1} are all linear attention): choose a "
                f"pipeline_parallel_size={pp_size()} that gives every stage one")

    def _set_up_attention(self) -> None:
        """The all-reduce, the KV layout's groups, the attention backend, compiled layers."""
        config, fp8_kv = self.config, self.config.kv_cache_dtype == "fp8"
        self.all_reduce_in_use = set_up_all_reduce(config.all_reduce, self.dtype, self.device)
        self.kv_layout = plan_kv_layout([layer.sliding_window for layer in self.attention_layers])
        for layer, (group, _) in zip(self.attention_layers, self.kv_layout.layer_slots):
            layer.kv_group = group
        check_fp8_device(self.device, self.quant_config is not None, fp8_kv)
        self.backend = select_backend(config.attention_backend, self.device, self.block_size,
                                      fp8_kv_cache=fp8_kv)
        for layer in self.attention_layers:
            layer.backend = self.backend
        self.use_torch_compile = self.device.type == "cuda"  # enforce_eager turns off graphs only
        self.fused_sampler = False  # the plain sampler as one Triton kernel
        if self.use_torch_compile:
            enable_torch_compile(self.model)
            self.fused_sampler = use_triton_kernels(self.model)

    def _set_up_caches(self) -> None:
        """The cache kinds (``kv_cache.py``, allocated at start-up), held chunks, the inputs."""
        spec, config = self.config.speculative, self.config
        # speculation over recurrent layers: a verified chunk's rows held a slot (held_chunks.py)
        self.held_rows = spec.num_speculative_tokens + 1 if spec and self.state_layers else 0
        self.held_chunks = HeldChunks(self.held_rows)
        self.held_commit = (HeldCommit(self.state_layers, self.graph_shapes.verify, self.device)
                            if self.held_rows else None)
        self.caches = RankCaches(
            PagedKV(self.attention_layers, self.kv_layout, self.block_size, self.kv_dtype,
                    self.device),
            StateRows(self.state_layers, self.dtype, self.device, self.held_rows))
        self.inputs = InputBuilder(self.block_size, self.max_model_len, config.max_num_seqs,
                                   graph_capacity(self.graph_shapes), self.device,
                                   self.kv_layout.num_groups, has_state=bool(self.state_layers),
                                   held_rows=self.held_rows)

    def _set_up_steps(self) -> None:
        """What running steps keeps: graphs (captured at start-up), the drafter's ids, grammar
        masks, the sampler, counters, the launcher (``step_launcher.py``)."""
        config, vocab_size = self.config, self.hf_config.vocab_size
        self.step_drafts = DraftIds(self.device)  # the drafter's ids for the step running
        samples = tp_rank() == 0 and is_last_stage()  # the rank that samples and answers
        self.graphs: StepGraphs | None = None
        self.memory_report: GpuMemoryReport | None = None
        self.graph_memory = 0
        self.num_graph_replays = 0
        self.num_verify_replays = 0  # of them, verification graphs'
        profiler = StepProfiler(  # NVRAY_PROFILE_DIR asks for one (step_profiler.py)
            torch.distributed.get_rank() if torch.distributed.is_initialized() else 0)
        self.grammar_masks = GrammarMasks(  # a step's sampled rows (drafts' too), twice over
            lambda: grammar_compiler(self.model_path, vocab_size), config.max_sampled_rows,
            self.device)
        self.sampler = StepSampler(self.model, self.grammar_masks,
                                   HostIds(config.max_sampled_rows, self.device), self.device,
                                   self.fused_sampler, samples)
        self.steps = StepLauncher(self.forward, self.sampler, self.grammar_masks, self.step_drafts,
                                  samples, profiler)

    def _drafter(self, graphs: bool) -> Drafter | None:
        """The drafter on this rank (``speculative_config`` method ``draft_model``, ``eagle3``
        or ``mtp``)."""
        spec = self.config.speculative
        if spec is None or not spec.drafts_on_ranks:
            return None
        if any(w is not None and w < self.max_model_len for w in self.kv_layout.group_windows):
            raise ValueError(f"speculative_config method {spec.method!r} needs a target whose "
                             "layers all attend fully: this model has sliding-window layers")
        args = (self.config, self.hf_config.vocab_size, self.device, self.dtype, self.kv_dtype,
                self.max_model_len, self.backend, self.inputs.tables, graphs)
        return spec.method_class.build_drafter(spec, args, self.model, self.model_path)

    def reset_tables(self) -> None:
        """Forget every sequence's block table and held chunk (after start-up's made-up
        steps)."""
        self.held_chunks.clear()
        self.inputs.tables.reset()  # the drafter's too: the same

    @property
    def graph_sizes(self) -> list[int]:
        """The decode graphs' batch sizes, ascending (empty: no graphs)."""
        return list(self.graph_shapes.decode)

    @property
    def prefill_sizes(self) -> list[int]:
        return list(self.graph_shapes.prefill)

    # ----------------------------------------------------------------- KV cache
    @property
    def num_blocks(self) -> int:
        return self.caches.num_blocks

    @property
    def kv_block_bytes(self) -> int:
        """A physical block (``PagedKV.block_bytes``) and the draft model's share of it (its
        cache has a twin of every block: ``drafter.py``)."""
        drafter = self.drafter.kv_block_bytes if self.drafter is not None else 0  # its twin block
        return self.caches.kv.block_bytes + drafter

    @property
    def state_slot_bytes(self) -> int:
        """One state slot of every recurrent layer of this rank (and its held rows)."""
        return self.caches.states.row_bytes

    def decode_scratch_bytes(self, batch: int) -> int:
        """What one layer's decode attention allocates besides its output for ``batch``
        sequences in a CUDA graph (contexts bounded by ``max_model_len``)."""
        return self.backend.decode_scratch_bytes(batch, self.attention_layers[0],
                                                 self.kv_dtype.itemsize, self.max_model_len,
                                                 self.device)

    def new_graphs(self) -> StepGraphs:
        hidden = self.hf_config.hidden_size  # a stage before the last: (hidden, residual) rows
        row_shape = (hidden,) if is_last_stage() else (2, hidden)
        return StepGraphs(self.model, self.inputs, self.graph_shapes, row_shape, self.dtype,
                          self.max_model_len)

    def _release_graphs(self) -> None:
        if self.held_commit is not None:
            self.held_commit.release()
        if self.drafter is not None:
            self.drafter.release_graphs()
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    def allocate_kv_cache(self, num_blocks: int, state_rows: int = 1) -> None:
        """A zeroed cache of ``num_blocks`` blocks (0: none) and ``state_rows`` rows of each
        recurrent layer's state (the engine's slots and the scratch row; none with no blocks),
        the drafter's twin blocks too; graphs captured over the old cache are dropped first."""
        self._release_graphs()
        self.caches.allocate(num_blocks, state_rows)
        if self.drafter is not None:
            self.drafter.allocate_kv_cache(num_blocks)

    def close(self) -> None:
        """Drop graphs, cache and weights and give their memory back: the modules hold reference
        cycles, so this collects them (callers unfreeze start-up's objects first, gc_freeze.py)
        and, on the GPU, empties the allocator's cache."""
        self.allocate_kv_cache(0)
        use_p2p_all_reduce(None)  # its buffer goes with the process group
        if self.drafter is not None:
            self.drafter.close()
            self.drafter = None
        self.model = self.sampler.model = None  # type: ignore[assignment]
        self.attention_layers = []
        if self.device.type == "cuda":
            free_cached_memory()
        else:
            gc.collect()

    # -------------------------------------------------------------------- step
    @torch.inference_mode()
    def forward(self, step: StepInput) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(logits [S, V] of the rows to sample: rank 0 of the last stage, None elsewhere or
        when S is 0; hidden states [R + P, H] of the prompt rows to score, then of the rows to
        pool, None when R + P is 0 or before the last stage)."""
        if self.held_commit is not None:  # the rows of held chunks the engine kept, first
            self.held_commit.apply(self.held_chunks.commits(step))
            self.held_chunks.record(step)
        if step.block_copies:  # copy-on-write, before the step writes
            self.caches.kv.copy(step.block_copies)
        if step.state_copies:  # forks' and kept prefixes' states
            self.caches.states.copy(step.state_copies)
        if self.lora is not None:
            self.lora.begin_step(step)
        graphs, fill = self.graphs, self.sampler.last_sampled
        if self.drafter is not None:  # its drafts fill the step's draft placeholders
            drafts = self.drafter.run(step)
            fill = drafts if drafts is not None else fill
            self.step_drafts.start(drafts)
        batch = self.inputs.prepare(step, graphs.shapes if graphs is not None else GraphShapes(),
                                    fill)
        if self.lora is not None:
            self.lora.prepare_step(step, graphs.shapes.verify_q if batch.verify_bs else 0)  # type: ignore[union-attr]
        if self.stage_input is not None:  # the previous stage's activations, rows as computed
            recv_from_prev(self.stage_input[:batch.positions.shape[0]])
        hidden = graphs.replay_for(batch) if graphs is not None else None
        if hidden is None:
            hidden = self.model(batch.input_ids, batch.positions, batch.meta)
        else:
            self.num_graph_replays += 1
            self.num_verify_replays += bool(batch.verify_bs)
        if not is_last_stage():
            send_to_next(hidden)
            return None, None
        rows = hidden[:batch.num_samples] if batch.sample_idx is None else hidden[batch.sample_idx]
        logits = self.model.compute_logits(rows[:batch.num_samples]) if batch.num_samples else None
        reads_more = batch.num_scores or batch.num_pools
        return logits, (rows[batch.num_samples:] if reads_more else None)
