"""Start-up work of one rank, between building the model and serving the first step.

``num_kvcache_blocks(runner)`` says how many KV blocks fit the rank's memory budget: on the GPU
first compiling the Triton kernels all of this start-up launches, side by side
(``compile_ahead.py``, over ``rehearse_startup``), then after a measured warm-up step and trial
captures of CUDA graphs (the largest verification graph where speculation has them, then
``trial_graph_sizes``: the largest decode graph, the one holding the most decode scratch, the
smallest; ``memory.py``); the control plane takes the minimum over ranks.
``prepare_kv_cache(runner, n)`` creates the cache, then, on the GPU, compiles the kernels the
first requests would need (and warms the GEMMs, ``gemm_warmup.py``) and captures the decode,
verification and prefill CUDA graphs (``cuda_graph.py``; off with ``enforce_eager`` or an attention backend that
cannot be captured).
"""

from __future__ import annotations

import logging

import torch

from nvray.kv_layout import peak_blocks
from nvray.layers.moe import reset_expert_load
from nvray.step_protocol import SampleSpec, SeqStep, StepInput
from nvray.worker.compile_ahead import ahead_threads, compile_ahead
from nvray.worker.gemm_warmup import warm_gemms
from nvray.worker.memory import (GpuMemoryReport, free_cached_memory, graph_memory_estimate,
                                 measure_used)
from nvray.worker.inputs import GraphShapes
from nvray.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)
# the warm-up samples with every filter on: the sampler's most memory-hungry path
_WARMUP_SAMPLE = SampleSpec(temperature=0.6, top_p=0.9, top_k=50, min_p=0.05, seed=None,
                            step_index=0)


def num_kvcache_blocks(runner: ModelRunner) -> int:
    """How many KV blocks this rank can hold (before the minimum over ranks)."""
    config = runner.config
    threads = ahead_threads(runner.device.type)
    if threads:
        with runner.startup.phase("compile_ahead"):
            compile_kernels_ahead(runner, threads)
    if config.num_kvcache_blocks is not None:
        return config.num_kvcache_blocks
    if runner.device.type == "cpu":
        budget = int(config.cpu_kvcache_space_gib * 2**30)
        where = f"cpu_kvcache_space_gib={config.cpu_kvcache_space_gib}"
    else:
        with runner.startup.phase("memory_profile"):
            runner.memory_report = profile_memory(runner)
        budget, where = runner.memory_report.kv_budget, runner.memory_report.describe()
        logger.info("GPU memory: %s", where)
    block_bytes, block_size = runner.kv_block_bytes, runner.block_size
    state_bytes = (runner.num_state_slots + 1) * runner.state_slot_bytes  # recurrent layers'
    if state_bytes:
        where += (f"; the linear-attention layers' state {_size(state_bytes)} first "
                  f"({runner.num_state_slots} slots of {_size(runner.state_slot_bytes)}: "
                  "max_num_seqs, doubled by enable_prefix_caching)")
    budget -= state_bytes
    num_blocks = max(budget, 0) // block_bytes
    chunk = config.max_num_batched_tokens if config.enable_chunked_prefill else runner.max_model_len
    needed = peak_blocks(runner.kv_layout.group_windows, runner.max_model_len, block_size,
                         min(chunk, runner.max_model_len))
    if num_blocks < needed:
        raise ValueError(
            f"KV cache too small: {max(budget, 0) / 2**30:.2f} GiB holds {num_blocks} blocks of "
            f"{block_size} tokens ({block_bytes / 2**20:.2f} MiB each), but one "
            f"max_model_len={runner.max_model_len} sequence needs {needed}. Memory: {where}. "
            "Raise gpu_memory_utilization/cpu_kvcache_space_gib, or lower max_model_len, "
            "max_num_batched_tokens or max_num_seqs")
    return num_blocks


def _size(num_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes / 2**10:.1f} KiB"


def compile_kernels_ahead(runner: ModelRunner, threads: int) -> None:
    """The Triton kernels of this start-up compiled side by side on ``threads``, over a
    one-block scratch cache that is dropped after (``compile_ahead.py``)."""
    runner.allocate_kv_cache(1)
    try:
        compile_ahead(lambda: warmup(runner), lambda: rehearse_startup(runner), threads)
    finally:
        runner.allocate_kv_cache(0)
        runner.reset_tables()
        free_cached_memory()


@torch.inference_mode()
def rehearse_startup(runner: ModelRunner) -> None:
    """The forwards of this start-up after its warm-up step, once, eagerly: the kernel
    warm-up's steps and every CUDA graph's forward (what ``compile_ahead`` needs to see
    launched)."""
    warm_kernel_steps(runner)
    if runner.graph_sizes:
        runner.new_graphs().rehearse()


def profile_memory(runner: ModelRunner) -> GpuMemoryReport:
    """Measure weights, the activation peak and the CUDA graphs' memory (GPU, before the cache)."""
    dev = runner.device
    free_cached_memory()
    allocated = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    runner.allocate_kv_cache(1)  # scratch: every warm-up token writes into block 0
    warmup(runner)
    torch.cuda.synchronize(dev)
    activations = torch.cuda.max_memory_allocated(dev) - allocated - runner.kv_block_bytes
    graphs = 0
    if runner.graph_sizes:
        def capture_one(trial: GraphShapes) -> None:
            runner.graphs = runner.graphs or runner.new_graphs()
            runner.graphs.capture(trial)

        shapes = runner.graph_shapes
        # the largest verification graph (most tokens) sets the pool first where there is one
        trials = [shapes._replace(decode=(), prefill=(), verify=(size,))
                  for size in shapes.verify[-1:]]
        trials += [shapes._replace(decode=(size,), prefill=(), verify=())
                   for size in trial_graph_sizes(runner)]
        # a draft model's graphs share the pool; each is costed as the smallest trial's
        drafter = runner.drafter.num_graphs if runner.drafter is not None else 0
        graphs = graph_memory_estimate(capture_one, trials, len(shapes.decode)
                                       + len(shapes.prefill) + len(shapes.verify) + drafter, dev)
    runner.allocate_kv_cache(0)  # drops the trial graphs too
    free_cached_memory()
    free, total = torch.cuda.mem_get_info(dev)
    return GpuMemoryReport(total, runner.config.gpu_memory_utilization, runner.memory_baseline,
                           max(total - free - runner.memory_baseline, 0), allocated,
                           max(activations, 0), graphs, free)


def trial_graph_sizes(runner: ModelRunner) -> list[int]:
    """The decode graphs the memory estimate captures: the largest, the one whose attention
    holds the most split scratch (where that is another one), the smallest last (prefill
    graphs are costed as the smallest)."""
    sizes = runner.graph_sizes
    scratch = {size: runner.decode_scratch_bytes(size) for size in sizes}
    heaviest = max(sizes, key=scratch.__getitem__)
    middle = [heaviest] if scratch[heaviest] > 0 and heaviest not in (sizes[0], sizes[-1]) else []
    return [sizes[-1], *middle, sizes[0]]


def warmup(runner: ModelRunner) -> None:
    """One step of max_num_batched_tokens prompt tokens, sampling as many rows as a step can
    (one per sequence; with speculation, draft rows too: ``EngineConfig.max_sampled_rows``)."""
    config, block_size = runner.config, runner.block_size
    tokens = config.max_num_batched_tokens
    num_seqs = max(1, min(config.max_num_seqs, tokens))
    tokens = min(tokens, num_seqs * runner.max_model_len)
    lens = [tokens // num_seqs + (i < tokens % num_seqs) for i in range(num_seqs)]
    groups = runner.kv_layout.num_groups  # a table entry per group for each logical block
    extra_rows = min(config.max_sampled_rows, tokens) - num_seqs
    seqs = []
    for i, n in enumerate(lens):
        drafts = max(0, min(n - 1, extra_rows))  # rows sampled before the last one
        extra_rows -= drafts
        seqs.append(SeqStep(-1 - i, [0] * n, 0, [0] * (-(-n // block_size) * groups),
                            _WARMUP_SAMPLE, num_drafts=drafts, draft_start=0,
                            draft_tokens=(0,) * n))  # a draft model's feed, as large
    runner.steps.execute(StepInput(seqs))
    runner.reset_tables()


def prepare_kv_cache(runner: ModelRunner, num_blocks: int) -> None:
    """Create the cache; on the GPU, warm the kernels and capture the CUDA graphs over it."""
    with runner.startup.phase("kv_cache"):
        runner.allocate_kv_cache(num_blocks, runner.num_state_slots + 1)
    if runner.device.type == "cuda":
        with runner.startup.phase("kernel_warmup"):
            warm_kernels(runner)
    if runner.graph_sizes:
        with runner.startup.phase("cuda_graphs"):
            capture_graphs(runner)
    reset_expert_load(runner.model)  # what the warm-ups and captures routed is no load


def capture_graphs(runner: ModelRunner) -> None:
    # entering a capture empties the allocator's cache (the warm-ups' blocks): empty it first,
    # so that what the graphs take is measured, not less what the cache gave back
    free_cached_memory()
    before = measure_used(runner.device)
    runner.graphs = runner.new_graphs()
    seconds = runner.graphs.capture()
    if runner.held_commit is not None:  # the held rows' commit (recurrent layers), too
        runner.held_commit.capture(runner.graphs.pool)
    if runner.drafter is not None:  # the draft model's, in the same pool
        runner.drafter.capture_graphs(runner.graphs.pool)
        logger.info("captured %d CUDA graphs of the draft model", runner.drafter.num_graphs)
    runner.graph_memory = measure_used(runner.device) - before
    estimate = runner.memory_report.cuda_graphs if runner.memory_report else 0
    decode, prefill, verify = runner.graph_sizes, runner.prefill_sizes, runner.graph_shapes.verify
    logger.info("captured %d decode CUDA graphs (batch sizes %s..%s), %d prefill graphs "
                "(up to %s tokens) and %d verification graphs (up to %s sequences) in %.1f s, "
                "%.0f MiB (estimated %.0f MiB)", len(decode), decode[0], decode[-1],
                len(prefill), prefill[-1] if prefill else 0, len(verify),
                verify[-1] if verify else 0, seconds, runner.graph_memory / 2**20,
                estimate / 2**20)


@torch.inference_mode()
def warm_kernels(runner: ModelRunner) -> None:
    """Compile now what the first requests would otherwise compile mid-run (measured: ~1.5 s
    stalls in the first steps of the throughput bench). The Triton prefill kernel has a
    variant per query-tile size (from the longest query chunk: 8, 16, 32, 64 rows) and per
    block-table width class (Triton specializes ints equal to 1 or divisible by 16); the
    sampler's kernel one for rows sharing a temperature, one for greedy rows only (the
    steps of query 9) and one for rows of both (the step of 2 rows); the grammar-mask kernel
    one per logits dtype. Each warm-up step is
    one query chunk at the end of a context that lives in block 0 of the unused cache.
    First the GEMMs at the row counts steps will use (``gemm_warmup.py``: a cuBLAS kernel's
    first launch waits for the device to drain)."""
    config = runner.config
    warm_gemms(runner.model, runner.hf_config.hidden_size, config.max_num_batched_tokens,
               config.max_sampled_rows)
    warm_kernel_steps(runner)


def warm_kernel_steps(runner: ModelRunner) -> None:
    """``warm_kernels``' steps (each Triton specialization the first requests would launch)."""
    block_size = runner.block_size
    wide = 16 * block_size  # a block table 16 entries wide
    for query_len in (2, 9, 17, 33):
        spec = _WARMUP_SAMPLE._replace(top_p=1.0, top_k=-1, min_p=0.0,  # the fused sampler
                                       temperature=0.0 if query_len == 9 else 0.6)
        for context in sorted({query_len, max(wide, query_len), wide + 3 * block_size}):
            if context > runner.max_model_len:
                continue
            table = [0] * (-(-context // block_size) * runner.kv_layout.num_groups)
            seqs = [SeqStep(-1 - i, [0] * query_len, context - query_len, table,
                            spec._replace(temperature=spec.temperature * (1 - i)),
                            draft_start=context - query_len, draft_tokens=(0,) * query_len)
                    for i in range(1 + (query_len == 33))]  # and one step of 2 rows
            runner.steps.execute(StepInput(seqs))
    runner.reset_tables()
    if runner.held_commit is not None:  # the held rows' commit (recurrent layers)
        runner.held_commit.warm()
    runner.grammar_masks.warm(runner.hf_config.vocab_size, (runner.dtype, torch.float32))
