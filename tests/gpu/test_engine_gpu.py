"""The whole engine on the GPU (Qwen3-0.6B shape, bf16): CUDA graphs on and off give the same
greedy tokens through the Ray runtime, and so do overlapped steps and steps one at a time;
prefix-cache hits and preemption keep greedy tokens
oracle argmaxes; the KV cache is sized from gpu_memory_utilization (the engine's own share: two
engines share one GPU) and a budget that cannot hold one max_model_len sequence fails start-up
with the numbers."""

from __future__ import annotations

import pytest
import torch

from gpu_oracle import check_greedy_near_argmax, wait_gpu_memory_below
from nvray import LLM, SamplingParams
from oracle import random_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
VOCAB = 10000


def gpu_used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def run(path: str, prompts, params, **kwargs):
    used = gpu_used()
    llm = LLM(path, **kwargs)
    try:
        return llm.generate(prompts, params, use_tqdm=False), llm.stats()
    finally:
        llm.shutdown()
        wait_gpu_memory_below(used + (256 << 20))


@pytest.mark.xdist_group("ray")  # one worker of a side-by-side run starts Ray
def test_cuda_graphs_on_and_off_give_the_same_greedy_tokens_on_ray(gpu_ray, qwen3_06b_path):
    # 48 sequences: a captured batch size (no padding rows), and enough programs that the decode
    # kernel uses one split in the graph (sized for max_model_len) and eager alike; one prefill
    # step for all, so all decode (and finish) together
    prompts = random_prompts(48, 5, 300, seed=2, vocab=VOCAB)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    common = dict(max_model_len=1024, max_num_seqs=64, num_kvcache_blocks=2048,
                  max_num_batched_tokens=16384)
    graphs, _ = run(qwen3_06b_path, prompts, params, enforce_eager=False, **common)
    eager, _ = run(qwen3_06b_path, prompts, params, enforce_eager=True, **common)
    same = sum(g.token_ids == e.token_ids for g, e in zip(graphs, eager))
    assert same == len(prompts), f"{len(prompts) - same} of {len(prompts)} sequences differ"
    for p, o in list(zip(prompts, graphs))[:4]:
        check_greedy_near_argmax(qwen3_06b_path, p, o.token_ids)


@pytest.mark.xdist_group("ray")
def test_overlapped_steps_give_the_same_greedy_tokens_in_process_and_on_ray(gpu_ray, qwen3_06b_path):
    # the batch design of the test above: every step has the same sequences in both modes, so
    # the kernels see the same shapes and greedy tokens must be identical, not just close
    prompts = random_prompts(48, 5, 300, seed=6, vocab=VOCAB)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    common = dict(max_model_len=1024, max_num_seqs=64, num_kvcache_blocks=2048,
                  max_num_batched_tokens=16384)
    off, _ = run(qwen3_06b_path, prompts, params, runtime="inprocess", overlap_scheduling=False,
                 **common)
    for runtime in ("inprocess", "ray"):
        on, _ = run(qwen3_06b_path, prompts, params, runtime=runtime, overlap_scheduling=True,
                    **common)
        same = sum(a.token_ids == b.token_ids for a, b in zip(on, off))
        assert same == len(prompts), f"{runtime}: {len(prompts) - same} of {len(prompts)} differ"
    for p, o in list(zip(prompts, off))[:2]:
        check_greedy_near_argmax(qwen3_06b_path, p, o.token_ids)


def test_prefix_hits_and_preemption_keep_greedy_tokens_oracle_argmaxes(qwen3_06b_path):
    system = random_prompts(1, 32, 32, seed=3, vocab=VOCAB)[0]
    prompts = [system + tail for tail in random_prompts(7, 5, 15, seed=4, vocab=VOCAB)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    used = gpu_used()
    # 12 blocks of 16 tokens cannot hold 6 sequences of ~45 + 30 tokens: preemption, recompute
    llm = LLM(qwen3_06b_path, runtime="inprocess", num_kvcache_blocks=12, max_model_len=128)
    try:
        first = llm.generate(prompts[:1], params, use_tqdm=False)  # caches the system prompt
        rest = llm.generate(prompts[1:], params, use_tqdm=False)
        stats = llm.stats()
    finally:
        llm.shutdown()
        wait_gpu_memory_below(used + (256 << 20))
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hit_tokens"] >= 32  # the shared system prompt
    for p, o in zip(prompts, first + rest):
        check_greedy_near_argmax(qwen3_06b_path, p, o.token_ids)


def test_sampling_at_temperature_gives_finite_in_vocab_tokens(qwen3_06b_path):
    prompts = random_prompts(16, 10, 200, seed=5, vocab=VOCAB)
    params = SamplingParams(temperature=0.6, top_p=0.9, top_k=50, max_tokens=32, ignore_eos=True)
    outs, _ = run(qwen3_06b_path, prompts, params, runtime="inprocess", num_kvcache_blocks=512,
                  max_model_len=1024, max_num_seqs=16)
    for o in outs:
        assert len(o.token_ids) == 32 and all(0 <= t < 151936 for t in o.token_ids)


@pytest.mark.gpu_alone  # measures the device's memory in use
def test_kv_cache_is_sized_within_gpu_memory_utilization(qwen3_06b_path):
    total, before = torch.cuda.mem_get_info()[1], gpu_used()
    util = 0.2  # the engine's own share: what is in use already is not counted against it
    llm = LLM(qwen3_06b_path, runtime="inprocess", gpu_memory_utilization=util, max_model_len=4096)
    try:
        runner = llm.engine.executor.runner
        report = runner.memory_report
        assert report is not None and report.activations > 0 and report.cuda_graphs > 0
        assert 0 < runner.graph_memory <= 2 * report.cuda_graphs + (64 << 20), report.describe()
        prompts = random_prompts(64, 100, 1000, seed=6, vocab=VOCAB)
        llm.generate(prompts, SamplingParams(temperature=0.6, max_tokens=64, ignore_eos=True),
                     use_tqdm=False)
        grown = gpu_used() - before  # the engine's memory (and a new CUDA context, if any)
        assert total * util - (1 << 30) <= grown <= total * util + (512 << 20), report.describe()
        assert runner.num_blocks * runner.kv_block_bytes <= report.kv_budget
    finally:
        llm.shutdown()


@pytest.mark.gpu_alone  # measures the device's memory in use
def test_two_engines_share_one_gpu_each_with_its_own_share(gpu_ray, qwen3_06b_path):
    """Two replicas on one GPU (``num_gpus_per_rank=0.5``): the second engine's share does not
    count the first's memory, so both get the same KV cache, and both serve."""
    before, total = gpu_used(), torch.cuda.mem_get_info()[1]
    prompts = random_prompts(4, 20, 200, seed=8, vocab=VOCAB)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    engines = []
    try:
        for _ in range(2):
            engines.append(LLM(qwen3_06b_path, num_gpus_per_rank=0.5, gpu_memory_utilization=0.35,
                               max_model_len=4096))
        blocks = [e.stats()["num_kvcache_blocks"] for e in engines]
        assert blocks[1] >= 0.95 * blocks[0], blocks
        outs = [[o.token_ids for o in e.generate(prompts, greedy, use_tqdm=False)] for e in engines]
        assert outs[0] == outs[1]
        assert gpu_used() - before <= 2 * (0.35 * total + (1 << 30))  # + a context each
    finally:
        for e in engines:
            e.shutdown()
        wait_gpu_memory_below(before + (256 << 20))


@pytest.mark.gpu_alone  # sized from what the device has free
def test_a_budget_that_cannot_hold_one_sequence_fails_with_the_numbers(qwen3_06b_path):
    # 1% of the device (0.8 GiB) is less than the weights: no room for one 40,960-token sequence
    with pytest.raises(ValueError, match="KV cache too small.*gpu_memory_utilization.*activation"):
        LLM(qwen3_06b_path, runtime="inprocess", gpu_memory_utilization=0.01, max_model_len=40960)
    torch.cuda.empty_cache()


def test_forced_torch_backend_runs_eager_on_the_gpu(qwen3_06b_path):
    prompts = random_prompts(3, 5, 50, seed=7, vocab=VOCAB)
    outs, _ = run(qwen3_06b_path, prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                  runtime="inprocess", attention_backend="torch", num_kvcache_blocks=64,
                  max_model_len=512)
    for p, o in zip(prompts, outs):
        check_greedy_near_argmax(qwen3_06b_path, p, o.token_ids)
