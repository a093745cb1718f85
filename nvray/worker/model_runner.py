"""ModelRunner: one tensor-parallel rank — model shard, paged KV cache, step execution.

Lifecycle: build and load the model; ``num_kvcache_blocks()`` says how many blocks fit this
rank's memory budget (on the GPU after a measured warm-up step: see ``memory.py``; the control
plane takes the minimum over ranks); ``allocate_kv_cache(n)`` creates the cache, compiles the
kernels the first requests would need, and captures the decode CUDA graphs (``cuda_graph.py``;
off with ``enforce_eager``, on the CPU, or with an attention backend that cannot be captured);
then ``execute(step)`` runs one scheduled batch and, on rank 0, returns the sampled token ids
(other ranks return []); ``execute_overlapped(step)`` launches a step and returns the ids of the
one launched before it, so the caller works while the device computes (placeholders in a step's
ids are filled from the previous step's sampled ids on the device; TP ranks all get rank 0's).
On the GPU the norms, the attention prologue, the activation and the plain sampler (greedy, or
no filters, bans or seeds) run as hand-written Triton kernels (``kernels/``; the layers
``torch.compile``d and the sampler eager where Triton is missing), also with ``enforce_eager``,
which turns off graphs only. Inputs are built by ``InputBuilder`` (one host-to-device copy per
step); decode-only batches that fit a graph replay it, everything else runs eager; the LM head
and the sampler always run eager on the rows to sample. ``close()`` gives the GPU memory back.
"""

from __future__ import annotations

import collections
import gc
import importlib.util
import logging
from typing import Any

import torch
import torch.distributed as dist

from nvray.config import EngineConfig
from nvray.engine.step_input import SampleSpec, SeqStep, StepInput, StepOutput
from nvray.layers.attention import select_backend
from nvray.layers.tp import tp_rank, tp_size
from nvray.loader import load_model
from nvray.models import model_class_for
from nvray.worker.cuda_graph import StepGraphs, graph_batch_sizes, prefill_graph_sizes
from nvray.worker.device_lists import to_device
from nvray.worker.gemm_warmup import warm_gemms
from nvray.worker.inputs import InputBuilder
from nvray.worker.logits_processors import adjust_logits
from nvray.worker.logprobs import HostLogprobs, LogprobRows
from nvray.worker.memory import (GpuMemoryReport, free_cached_memory, graph_memory_estimate,
                                 measure_used)
from nvray.worker.sampled_ids import HostIds, SampledIds
from nvray.worker.sampler import sample

logger = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# the warm-up samples with every filter on: the sampler's most memory-hungry path
_WARMUP_SAMPLE = SampleSpec(temperature=0.6, top_p=0.9, top_k=50, min_p=0.05, seed=None,
                            step_index=0)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but no CUDA device is visible")
    return torch.device("cuda", torch.cuda.current_device()) if name == "cuda" else torch.device("cpu")


def resolve_dtype(name: str, hf_config: Any, device: torch.device) -> torch.dtype:
    """'auto': the checkpoint's dtype, except fp32 runs as bf16 on GPU and 16-bit as fp32 on CPU."""
    if name != "auto":
        return _DTYPES[name]
    ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
    ckpt = _DTYPES.get(ckpt, torch.float32) if isinstance(ckpt, str) else ckpt
    if device.type == "cpu":
        return torch.float32
    return torch.bfloat16 if ckpt == torch.float32 else ckpt


def load_hf_config(model_path: str) -> Any:
    from transformers import AutoConfig  # noqa: PLC0415

    return AutoConfig.from_pretrained(model_path)


def resolve_max_model_len(config: EngineConfig, hf_config: Any) -> int:
    limit = hf_config.max_position_embeddings
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's "
                         f"max_position_embeddings={limit}")
    return config.max_model_len


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.hf_config = load_hf_config(model_path)
        self.dtype = resolve_dtype(config.dtype, self.hf_config, self.device)
        self.block_size = config.kvcache_block_size
        self.max_model_len = resolve_max_model_len(config, self.hf_config)
        self.model = self._build_model(model_path)
        self.attention_layers = self.model.attention_layers()
        self.backend = select_backend(config.attention_backend, self.device, self.block_size)
        for layer in self.attention_layers:
            layer.backend = self.backend
        self.use_torch_compile = self.device.type == "cuda"  # enforce_eager turns off graphs only
        self.fused_sampler = False  # the plain sampler as one Triton kernel
        if self.use_torch_compile:
            self._enable_torch_compile()
            self._use_triton_kernels()
        graphs = self._graphs_wanted()
        self.graph_sizes = graph_batch_sizes(config.max_num_seqs) if graphs else []
        self.prefill_sizes = prefill_graph_sizes(config.max_prefill_graph_tokens) if graphs else []
        self.inputs = InputBuilder(self.block_size, self.max_model_len, config.max_num_seqs,
                                   max([*self.graph_sizes, *self.prefill_sizes], default=0),
                                   self.device)
        self.graphs: StepGraphs | None = None
        self.memory_report: GpuMemoryReport | None = None
        self.graph_memory = 0
        self.num_graph_replays = 0
        self.num_blocks = 0
        self.last_sampled: torch.Tensor | None = None  # the newest step's sampled ids (device)
        self.in_flight: collections.deque[SampledIds] = collections.deque()
        self.host_ids = HostIds(config.max_num_seqs, self.device)

    def _build_model(self, model_path: str) -> torch.nn.Module:
        torch.manual_seed(self.config.seed)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = model_class_for(self.hf_config)(self.hf_config)
        finally:
            torch.set_default_dtype(default_dtype)
        load_model(model, model_path)
        return model.eval()

    def _enable_torch_compile(self) -> None:
        """Fused norms, rotary and activation (measured on an H100, Qwen3-0.6B, batch 256: a
        decode graph replay takes 12.0 ms instead of 15.0 ms; an eager decode 28 ms instead of
        44 ms). Compilation happens in the first forward (the warm-up or the graph capture)."""
        for module in self.model.modules():
            if hasattr(module, "enable_torch_compile"):
                module.enable_torch_compile()

    def _use_triton_kernels(self) -> None:
        """Hand-written Triton kernels where the model has them: the q/k norms and rotary of
        each layer in one kernel instead of four; the hidden-state norms (with the residual add)
        and the MLP's activation instead of their ``torch.compile``d versions, whose guards and
        wrappers cost ~0.15 ms of host time per call on eager (prefill) steps; the plain
        sampler's draw instead of its eager kernels."""
        if importlib.util.find_spec("triton") is None:
            return
        self.fused_sampler = True
        for module in self.model.modules():
            if hasattr(module, "use_triton_kernels"):
                module.use_triton_kernels()

    def _graphs_wanted(self) -> bool:
        if self.device.type != "cuda" or self.config.enforce_eager:
            return False
        if not self.backend.supports_cuda_graphs:
            logger.warning("CUDA graphs are off: the %s attention backend cannot be captured",
                           self.backend.name)
            return False
        return True

    # ----------------------------------------------------------------- KV cache
    @property
    def kv_block_bytes(self) -> int:
        layer = self.attention_layers[0]
        per_token = 2 * layer.num_kv_heads * layer.head_dim * self.dtype.itemsize
        return len(self.attention_layers) * self.block_size * per_token

    def num_kvcache_blocks(self) -> int:
        """How many KV blocks this rank can hold (before the minimum over ranks)."""
        if self.config.num_kvcache_blocks is not None:
            return self.config.num_kvcache_blocks
        if self.device.type == "cpu":
            budget = int(self.config.cpu_kvcache_space_gib * 2**30)
            where = f"cpu_kvcache_space_gib={self.config.cpu_kvcache_space_gib}"
        else:
            self.memory_report = self.profile_memory()
            budget, where = self.memory_report.kv_budget, self.memory_report.describe()
            logger.info("GPU memory: %s", where)
        num_blocks = max(budget, 0) // self.kv_block_bytes
        needed = -(-self.max_model_len // self.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"KV cache too small: {max(budget, 0) / 2**30:.2f} GiB holds {num_blocks} blocks of "
                f"{self.block_size} tokens ({self.kv_block_bytes / 2**20:.2f} MiB each), but one "
                f"max_model_len={self.max_model_len} sequence needs {needed}. Memory: {where}. "
                "Raise gpu_memory_utilization/cpu_kvcache_space_gib, or lower max_model_len, "
                "max_num_batched_tokens or max_num_seqs")
        return num_blocks

    def profile_memory(self) -> GpuMemoryReport:
        """Measure weights, the activation peak and the CUDA graphs' memory (GPU, before the cache)."""
        dev = self.device
        free_cached_memory()
        allocated = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        self._set_kv_cache(1)  # scratch: every warm-up token writes into block 0
        self.warmup()
        torch.cuda.synchronize(dev)
        activations = torch.cuda.max_memory_allocated(dev) - allocated - self.kv_block_bytes
        graphs = 0
        if self.graph_sizes:
            graphs = graph_memory_estimate(self._capture_for_estimate,
                                            len(self.graph_sizes) + len(self.prefill_sizes), dev)
            self._release_graphs()
        self._set_kv_cache(0)
        free_cached_memory()
        total = torch.cuda.mem_get_info(dev)[1]
        return GpuMemoryReport(total, self.config.gpu_memory_utilization, measure_used(dev),
                               allocated, max(activations, 0), graphs)

    def warmup(self) -> None:
        """One step of max_num_batched_tokens prompt tokens, sampling one row per sequence."""
        tokens = self.config.max_num_batched_tokens
        num_seqs = max(1, min(self.config.max_num_seqs, tokens))
        tokens = min(tokens, num_seqs * self.max_model_len)
        lens = [tokens // num_seqs + (i < tokens % num_seqs) for i in range(num_seqs)]
        seqs = [SeqStep(-1 - i, [0] * n, 0, [0] * -(-n // self.block_size), _WARMUP_SAMPLE)
                for i, n in enumerate(lens)]
        self.execute(StepInput(seqs))
        self.inputs.tables.reset()

    def _capture_for_estimate(self, which: str) -> None:
        self.graphs = self.graphs or self._new_graphs()
        self.graphs.capture([self.graph_sizes[-1] if which == "largest" else self.graph_sizes[0]])

    def _new_graphs(self) -> StepGraphs:
        return StepGraphs(self.model, self.inputs, self.graph_sizes, self.hf_config.hidden_size,
                          self.dtype, self.max_model_len, self.prefill_sizes)

    def _release_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    def _set_kv_cache(self, num_blocks: int) -> None:
        for layer in self.attention_layers:
            shape = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            layer.k_cache = layer.v_cache = torch.empty(0)  # free the old cache first
            layer.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Create the cache, then capture the decode CUDA graphs over it."""
        self._release_graphs()
        self.num_blocks = num_blocks
        self._set_kv_cache(num_blocks)
        if self.device.type == "cuda":
            self.warm_kernels()
        if self.graph_sizes:
            before = measure_used(self.device)
            self.graphs = self._new_graphs()
            seconds = self.graphs.capture(prefill=True)
            self.graph_memory = measure_used(self.device) - before
            estimate = self.memory_report.cuda_graphs if self.memory_report else 0
            logger.info("captured %d decode CUDA graphs (batch sizes %s..%s) and %d prefill graphs "
                        "(up to %s tokens) in %.1f s, %.0f MiB (estimated %.0f MiB)",
                        len(self.graph_sizes), self.graph_sizes[0], self.graph_sizes[-1],
                        len(self.prefill_sizes), self.prefill_sizes[-1] if self.prefill_sizes else 0,
                        seconds, self.graph_memory / 2**20, estimate / 2**20)

    @torch.inference_mode()
    def warm_kernels(self) -> None:
        """Compile now what the first requests would otherwise compile mid-run (measured: ~1.5 s
        stalls in the first steps of the throughput bench). The Triton prefill kernel has a
        variant per query-tile size (from the longest query chunk: 8, 16, 32, 64 rows) and per
        block-table width class (Triton specializes ints equal to 1 or divisible by 16); the
        sampler's kernel one for rows sharing a temperature, one for greedy rows only (the
        steps of query 9) and one for rows of both (the step of 2 rows). Each warm-up step is
        one query chunk at the end of a context that lives in block 0 of the unused cache.
        First the GEMMs at the row counts steps will use (``gemm_warmup.py``: a cuBLAS kernel's
        first launch waits for the device to drain)."""
        warm_gemms(self.model, self.hf_config.hidden_size, self.config.max_num_batched_tokens,
                   self.config.max_num_seqs)
        wide = 16 * self.block_size  # a block table 16 entries wide
        for query_len in (2, 9, 17, 33):
            spec = _WARMUP_SAMPLE._replace(top_p=1.0, top_k=-1, min_p=0.0,  # the fused sampler
                                           temperature=0.0 if query_len == 9 else 0.6)
            for context in sorted({query_len, max(wide, query_len), wide + 3 * self.block_size}):
                if context > self.max_model_len:
                    continue
                table = [0] * -(-context // self.block_size)
                seqs = [SeqStep(-1 - i, [0] * query_len, context - query_len, table,
                                spec._replace(temperature=spec.temperature * (1 - i)))
                        for i in range(1 + (query_len == 33))]  # and one step of 2 rows
                self.execute(StepInput(seqs))
        self.inputs.tables.reset()

    def close(self) -> None:
        """Drop graphs, cache and weights and give their memory back: the modules hold reference
        cycles, so this collects them (callers unfreeze start-up's objects first, gc_freeze.py)
        and, on the GPU, empties the allocator's cache."""
        self._release_graphs()
        self._set_kv_cache(0)
        self.model = None  # type: ignore[assignment]
        self.attention_layers = []
        if self.device.type == "cuda":
            free_cached_memory()
        else:
            gc.collect()

    # -------------------------------------------------------------------- step
    @torch.inference_mode()
    def forward(self, step: StepInput) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(logits [S, V] of the rows to sample: rank 0, None elsewhere or when S is 0;
        hidden states [R, H] of the prompt rows to score, None when R is 0)."""
        if step.block_copies:
            self.copy_blocks(step.block_copies)
        graphs = self.graphs
        batch = self.inputs.prepare(step, graphs.sizes if graphs is not None else [],
                                    graphs.prefill_sizes if graphs is not None else [],
                                    self.last_sampled)
        if batch.graph_bs:
            hidden = graphs.replay(batch.graph_bs)  # type: ignore[union-attr]
            self.num_graph_replays += 1
        elif batch.prefill_q:
            hidden = graphs.replay_prefill(batch.prefill_q)  # type: ignore[union-attr]
            self.num_graph_replays += 1
        else:
            hidden = self.model(batch.input_ids, batch.positions, batch.meta)
        rows = hidden[:batch.num_samples] if batch.sample_idx is None else hidden[batch.sample_idx]
        logits = self.model.compute_logits(rows[:batch.num_samples]) if batch.num_samples else None
        return logits, (rows[batch.num_samples:] if batch.num_scores else None)

    def forward_logits(self, step: StepInput) -> torch.Tensor | None:
        """Logits [S, V] of the rows to sample (rank 0; None elsewhere, or when S is 0)."""
        return self.forward(step)[0]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: each (src, dst) block's KV, in every layer, before the step writes."""
        src = to_device([c[0] for c in copies], self.device)
        dst = to_device([c[1] for c in copies], self.device)
        for layer in self.attention_layers:
            layer.k_cache.index_copy_(0, dst, layer.k_cache.index_select(0, src))
            layer.v_cache.index_copy_(0, dst, layer.v_cache.index_select(0, src))

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        """Run ``step`` and return its sampled ids and log-probabilities (rank 0; empty
        elsewhere)."""
        return self._launch(step, share_ids=False).result()

    @torch.inference_mode()
    def execute_overlapped(self, step: StepInput | None) -> StepOutput | None:
        """Launch ``step`` (None: nothing new), then return the sampled ids of the step launched
        before it (None if there is none). The device runs ``step`` while the caller works on
        the returned ids; ``step`` may hold placeholders for the ids still being sampled."""
        if step is not None:
            self.in_flight.append(self._launch(step, share_ids=True))
        if len(self.in_flight) < (2 if step is not None else 1):
            return None
        return self.in_flight.popleft().result()

    def discard_in_flight(self) -> None:
        """Drop launched steps whose ids will never be read (their requests were failed)."""
        self.in_flight.clear()
        self.last_sampled = None

    def _launch(self, step: StepInput, share_ids: bool) -> SampledIds:
        """Queue ``step``'s forward and sampling on the device; keep its ids there and start
        their copy to the host. ``share_ids`` (overlapped steps, whose next step reads them on
        the device): every rank gets rank 0's ids."""
        logits, score_hidden = self.forward(step)
        specs = [s.sample for s in step.seqs if s.sample is not None]
        if logits is not None:
            raw = logits if step.samples_logprobs else None
            if step.adjusts_logits:
                logits = adjust_logits(logits.to(torch.float32, copy=True), specs,
                                       self.last_sampled)
            ids = sample(logits, specs, fused=self.fused_sampler).to(torch.int32)  # type: ignore[arg-type]
        else:
            raw = None
            ids = torch.empty(len(specs), dtype=torch.int32, device=self.device)
        if share_ids and tp_size() > 1 and specs:
            dist.broadcast(ids, src=0)
        logprobs, ks = self._logprobs(step, specs, raw, ids, score_hidden)
        self.last_sampled = ids
        if tp_rank() != 0:
            return SampledIds.none()
        return self.host_ids.copy_from(ids, logprobs, ks)

    def _logprobs(self, step: StepInput, specs: list[SampleSpec], raw: torch.Tensor | None,
                  ids: torch.Tensor, score_hidden: torch.Tensor | None
                  ) -> tuple[HostLogprobs | None, list[int] | None]:
        """Log-probabilities of the sampled rows that ask, then of the prompt rows to score (in
        ``step_input``'s order); every rank takes part (the LM head of prompt rows)."""
        if not step.samples_logprobs and score_hidden is None:
            return None, None
        scores = [s.score for s in step.seqs if s.score is not None]
        asked = [i for i, spec in enumerate(specs) if spec.logprobs >= 0]
        ks = [specs[i].logprobs for i in asked] + [sc.num_logprobs for sc in scores
                                                   for _ in sc.targets]
        rows = LogprobRows(max(ks))
        if raw is not None and asked:
            where = to_device(asked, self.device)
            rows.add_sampled(raw.index_select(0, where), ids.index_select(0, where))
        if score_hidden is not None:
            targets = to_device([t for sc in scores for t in sc.targets], self.device)
            rows.add_prompt(score_hidden, targets, self.model.compute_logits)
        if tp_rank() != 0:
            return None, None
        return rows.to_host(), ks
