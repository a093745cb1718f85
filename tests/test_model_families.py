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


def _run_bounded(llm: LLM, requests: list[tuple[list[int], SamplingParams]], max_steps: int) -> list:
    """Finished outputs of ``requests`` run through the engine, at most ``max_steps`` steps."""
    engine = llm.engine
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    done = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        done += [out for out in engine.step() if out.finished]
    assert not engine.has_unfinished_requests(), f"unfinished after {max_steps} steps"
    return sorted(done, key=lambda out: (out.request_id, out.index))


@pytest.mark.parametrize("family,num_blocks,full_layout_needs", [
    ("gemma3", 32, 50),  # 2 local, 2 global layers: 2 groups; 25 global blocks + a window's
    ("mistral-window", 8, 25),  # every layer windowed: one group of window's worth
])
def test_a_long_sequence_runs_in_a_cache_too_small_to_hold_it_in_every_layer(
        family, num_blocks, full_layout_needs, family_path, tiny_path, tmp_path):
    """A 200-token sequence (25 blocks of 8) whose windowed layers (window 8) give back the
    blocks they no longer read: it runs without preemption in fewer blocks than its layers
    would hold without windows, and n=2 choices fork its cached prompt; tokens equal HF's."""
    if family == "gemma3":
        path = family_path("gemma3")
    else:
        from hf_checkpoints import write_hf_checkpoint
        path = write_hf_checkpoint(str(tmp_path), {**SHAPES["mistral"], "sliding_window": 8},
                                   tiny_path, seed=7)
    prompt, short = random_prompts(2, 40, 40, seed=12)
    llm = LLM(path, runtime="inprocess", kvcache_block_size=8, num_kvcache_blocks=num_blocks,
              max_model_len=256, max_num_batched_tokens=32)
    try:
        long_out, = _run_bounded(llm, [(prompt, SamplingParams(temperature=0.0, max_tokens=160,
                                                               ignore_eos=True))], 400)
        stats = llm.engine.stats()
        forks = _run_bounded(llm, [(short[:30], SamplingParams(n=2, temperature=0.0, max_tokens=20,
                                                                ignore_eos=True))], 200)
    finally:
        llm.shutdown()
    assert long_out.token_ids == hf_greedy(path, prompt, 160)
    assert stats["num_preemptions"] == 0
    assert round(stats["kv_cache_peak_usage"] * num_blocks) < full_layout_needs
    assert [out.token_ids for out in forks] == [hf_greedy(path, short[:30], 20)] * 2
