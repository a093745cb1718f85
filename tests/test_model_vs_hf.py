"""nvray's Qwen3/Qwen2 against HF transformers: fp32 logits and greedy tokens, through every
engine path (prefix-cache hits, chunked prefill, preemption, each scheduling policy)."""

from __future__ import annotations

import pytest
import torch

from oracle import greedy_step, hf_greedy, hf_model, random_prompts
from nvray import LLM, EngineConfig, SamplingParams
from nvray.worker.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
_LLMS: dict[tuple, LLM] = {}


def llm_for(path: str, **kwargs) -> LLM:
    key = (path, tuple(sorted(kwargs.items())))
    if key not in _LLMS:
        _LLMS[key] = LLM(path, runtime="inprocess", **kwargs)
    return _LLMS[key]


def assert_matches_hf(path: str, prompts: list[list[int]], outputs, max_tokens: int = 12) -> None:
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(path, prompt, max_tokens), f"prompt of {len(prompt)} tokens"
        assert out.finish_reason == "length"


@pytest.mark.parametrize("model", ["tiny_path", "other_qwen3_path", "qwen2_path"])
def test_logits_close_for_prefill_and_decode(model, request):
    path = request.getfixturevalue(model)
    runner = ModelRunner(EngineConfig(model=path, num_kvcache_blocks=16, kvcache_block_size=16), path)
    runner.allocate_kv_cache(16)
    prompt = random_prompts(1, 37, 37, seed=3)[0]
    table = list(range(15, -1, -1))  # shuffled physical blocks
    hf = hf_model(path)
    tokens = list(prompt)
    ours = runner.forward(greedy_step(prompt, 0, table))[0][0]
    for step in range(4):
        with torch.no_grad():
            ref = hf(torch.tensor([tokens])).logits[0, -1]
        torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4, msg=f"step {step}")
        tokens.append(int(ref.argmax()))
        ours = runner.forward(greedy_step([tokens[-1]], len(tokens) - 1, table))[0][0]


@pytest.mark.parametrize("model", ["tiny_path", "other_qwen3_path", "qwen2_path"])
def test_greedy_batch_of_varied_lengths_matches_hf(model, request):
    path = request.getfixturevalue(model)
    prompts = random_prompts(6, 1, 90, seed=11)
    assert_matches_hf(path, prompts, llm_for(path).generate(prompts, GREEDY, use_tqdm=False))


def test_prefix_cache_hits_match_hf(tiny_path):
    llm = llm_for(tiny_path, kvcache_block_size=16)
    system = random_prompts(1, 40, 40, seed=5)[0]
    shared = [system + tail for tail in random_prompts(3, 3, 20, seed=6)]
    exact_blocks = random_prompts(1, 48, 48, seed=7)[0]  # a whole number of blocks
    first = llm.generate(shared + [exact_blocks], GREEDY, use_tqdm=False)
    again = llm.generate(shared + [exact_blocks, shared[0]], GREEDY, use_tqdm=False)
    assert_matches_hf(tiny_path, shared + [exact_blocks], first)
    assert_matches_hf(tiny_path, shared + [exact_blocks, shared[0]], again)
    assert all(o.num_cached_tokens >= 32 for o in again), [o.num_cached_tokens for o in again]
    assert again[3].num_cached_tokens == 32  # full-prompt hit still computes its last block


def test_chunked_prefill_matches_hf(tiny_path):
    prompts = random_prompts(4, 40, 120, seed=8)
    llm = llm_for(tiny_path, max_num_batched_tokens=24)
    assert_matches_hf(tiny_path, prompts, llm.generate(prompts, GREEDY, use_tqdm=False))


def test_preemption_matches_hf(tiny_path):
    prompts = random_prompts(6, 20, 40, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    llm = llm_for(tiny_path, num_kvcache_blocks=12, max_model_len=128)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats()["num_preemptions"] > 0
    assert_matches_hf(tiny_path, prompts, outputs, max_tokens=30)


@pytest.mark.parametrize("policy", ["fcfs", "sjf", "priority"])
def test_each_scheduling_policy_matches_hf(tiny_path, policy):
    prompts = random_prompts(5, 5, 60, seed=10)
    llm = llm_for(tiny_path, scheduling_policy=policy, max_num_seqs=2, max_num_batched_tokens=32)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, priorities=[3, 1, 2, 0, 1])
    assert_matches_hf(tiny_path, prompts, outputs)
