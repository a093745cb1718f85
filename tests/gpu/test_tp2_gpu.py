"""Tensor parallelism on two GPUs (NCCL): a TP=2 engine on a Qwen3-0.6B-shaped bf16 checkpoint,
with overlapped steps (rank 0 broadcasts its sampled ids to rank 1 on the device) and CUDA
graphs, picks greedy tokens that are the oracle's argmaxes up to bf16 noise, through prefill
chunks, prefix hits and decode. Skips on a machine with fewer than two GPUs."""

from __future__ import annotations

import pytest
import torch

from gpu_oracle import check_greedy_near_argmax, wait_gpu_memory_below
from nvray import LLM, SamplingParams
from oracle import random_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]


def test_tp2_greedy_tokens_are_oracle_argmaxes_with_overlap(gpu_ray, qwen3_06b_path):
    prompts = random_prompts(12, 20, 700, seed=8, vocab=10000)
    prompts.append(prompts[2][:300] + [11, 12, 13])  # a cached prefix, once the first has run
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    used = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
    llm = LLM(qwen3_06b_path, tensor_parallel_size=2, max_model_len=1024,
              max_num_batched_tokens=512, max_num_seqs=16, gpu_memory_utilization=0.5)
    try:
        first = llm.generate(prompts[:-1], params, use_tqdm=False)
        last = llm.generate(prompts[-1:], params, use_tqdm=False)
        stats = llm.stats()
    finally:
        llm.shutdown()
        wait_gpu_memory_below(used + (256 << 20))
    assert last[0].num_cached_tokens >= 288 and stats["prefix_cache_hit_tokens"] >= 288
    for prompt, out in zip(prompts, first + last):
        assert len(out.token_ids) == 24
        check_greedy_near_argmax(qwen3_06b_path, prompt, out.token_ids)
