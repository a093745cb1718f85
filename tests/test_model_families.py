"""Every model family against HF transformers' own classes (random checkpoints they write,
``hf_checkpoints.py``): fp32 logits of a prefill and of decode steps, and greedy tokens through
every engine path at once (a batch of varied lengths, chunked prefill, preemption, then prefix
hits) — Llama 3 (llama3 rope scaling, GQA) and its tied 1B/3B layout, Mistral, Qwen3-MoE (and
one with a dense layer, top-4 unnormalised, tied) and Gemma 3 (a window shorter than the
prompts, local and global rope)."""

from __future__ import annotations

import pytest
import torch

from hf_checkpoints import SHAPES
from oracle import greedy_step, hf_greedy, hf_model, random_prompts
from nvray import LLM, EngineConfig, SamplingParams
from nvray.worker.model_runner import ModelRunner

FAMILIES = list(SHAPES)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_hf_for_prefill_and_decode(family, family_path):
    path = family_path(family)
    runner = ModelRunner(EngineConfig(model=path, num_kvcache_blocks=16, kvcache_block_size=16), path)
    runner.allocate_kv_cache(16)
    prompt = random_prompts(1, 37, 37, seed=3)[0]
    table = list(range(15, -1, -1))  # shuffled physical blocks
    hf, tokens = hf_model(path), list(prompt)
    ours = runner.forward(greedy_step(prompt, 0, table))[0][0]
    for step in range(4):
        with torch.no_grad():
            ref = hf(torch.tensor([tokens])).logits[0, -1]
        torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4, msg=f"step {step}")
        tokens.append(int(ref.argmax()))
        ours = runner.forward(greedy_step([tokens[-1]], len(tokens) - 1, table))[0][0]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf_with_chunks_preemption_and_prefix_hits(family, family_path):
    path = family_path(family)
    prompts = random_prompts(6, 20, 45, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(path, runtime="inprocess", num_kvcache_blocks=12, max_model_len=128,
              max_num_batched_tokens=24)
    try:
        first = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.stats()["num_preemptions"] > 0
        cached = random_prompts(1, 40, 40, seed=10)[0]
        llm.generate([cached], params, use_tqdm=False)
        again = [cached, cached[:33] + [7, 8, 9]]  # the whole prompt again, a shared prefix
        second = llm.generate(again, params, use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts + again, first + second):
        assert out.token_ids == hf_greedy(path, prompt, 24), f"prompt of {len(prompt)} tokens"
    assert second[0].num_cached_tokens >= 16 and second[1].num_cached_tokens >= 32
