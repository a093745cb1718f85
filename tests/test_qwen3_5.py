"""Qwen3.5 hybrids (Gated DeltaNet linear attention + gated full attention, dense and MoE)
against HF transformers' own classes (random checkpoints they write, ``hf_checkpoints.py``):
fp32 logits of a prefill three GDN chunks long and of decode steps; greedy tokens through the
engine's paths (chunks that cut inside a GDN chunk, preemption by recompute, overlapped steps);
prefix hits that resume from a kept state (and its eviction);
n = 3 choices and beam search (a fork takes its parent's state); the language model of a
vision-language checkpoint; and no state slot or block left held after aborts, preemptions and
a burst of n > 1 requests."""

from __future__ import annotations

import pytest
import torch

from oracle import greedy_step, hf_greedy, hf_model, random_prompts, reference_beam_search
from nvray import LLM, BeamSearchParams, EngineConfig, SamplingParams
from nvray.worker.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5-tied", "qwen3_5-moe"])
def test_logits_match_hf_for_prefill_and_decode(family, family_path):
    path = family_path(family)
    runner = ModelRunner(EngineConfig(model=path, num_kvcache_blocks=16, kvcache_block_size=16), path)
    runner.allocate_kv_cache(16, state_rows=2)
    prompt = random_prompts(1, 150, 150, seed=3)[0]  # three chunks of the GDN's 64
    table = list(range(15, -1, -1))
    hf, tokens = hf_model(path), list(prompt)
    ours = runner.forward(greedy_step(prompt, 0, table))[0][0]
    for step in range(4):
        with torch.no_grad():
            ref = hf(torch.tensor([tokens])).logits[0, -1]
        torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4, msg=f"step {step}")
        tokens.append(int(ref.argmax()))
        ours = runner.forward(greedy_step([tokens[-1]], len(tokens) - 1, table))[0][0]


def _hybrid_llm(path: str, **kw) -> LLM:
    """Small enough that six prompts preempt; 40-token chunks cut the GDN's 64-token chunks."""
    return LLM(path, runtime="inprocess", num_kvcache_blocks=14, kvcache_block_size=16,
               max_model_len=160, max_num_batched_tokens=40, max_num_seqs=8, **kw)


def _assert_nothing_held(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert not llm.engine.has_unfinished_requests()
    assert sorted(bm.states.free_slots) == list(range(bm.states.num_live))
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5-moe"])
def test_greedy_matches_hf_through_chunks_preemption_and_overlapped_steps(family, family_path):
    path = family_path(family)
    prompts = random_prompts(6, 20, 90, seed=9)
    llm = _hybrid_llm(path)
    try:
        assert llm.engine.overlap
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        stats = llm.engine.stats()
        _assert_nothing_held(llm)
    finally:
        llm.shutdown()
    assert stats["num_preemptions"] > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(path, prompt, 24), f"prompt of {len(prompt)} tokens"


@pytest.fixture(scope="module")
def hybrid(family_path):
    llm = _hybrid_llm(family_path("qwen3_5"))
    yield llm
    llm.shutdown()


def _sampled(seed: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=0.95, seed=seed, max_tokens=12,
                          ignore_eos=True, n=n)


def test_choices_equal_single_requests_and_greedy_choices_equal_hf(hybrid, family_path):
    prompt, other = random_prompts(2, 37, 50, seed=1)
    mixed = hybrid.generate([prompt, other], [_sampled(100, n=3), _sampled(7)], use_tqdm=False)
    alone = [hybrid.generate(prompt, _sampled(100 + i), use_tqdm=False)[0] for i in range(3)]
    assert [c.token_ids for c in mixed[:3]] == [a.token_ids for a in alone]
    assert len({tuple(c.token_ids) for c in mixed[:3]}) > 1
    fresh = random_prompts(1, 37, 37, seed=2)[0]  # no prefix of it cached before
    greedy = hybrid.generate(fresh, SamplingParams(n=3, temperature=0.0, max_tokens=16,
                                                   ignore_eos=True), use_tqdm=False)
    assert [c.token_ids for c in greedy] == [hf_greedy(family_path("qwen3_5"), fresh, 16)] * 3
    # the other choices start from the first one's state kept at its 32nd token
    assert [c.num_cached_tokens for c in greedy] == [0, 32, 32]
    _assert_nothing_held(hybrid)


def test_a_one_token_prompt_in_a_used_slot_starts_from_zero_state(hybrid, family_path):
    """A decode-only step (one token per sequence) whose sequence starts at position 0: its
    slot held another sequence's state a moment ago."""
    path = family_path("qwen3_5")
    long_prompt = random_prompts(1, 60, 60, seed=8)[0]
    hybrid.generate(long_prompt, GREEDY, use_tqdm=False)
    outs = hybrid.generate([[long_prompt[0]], [long_prompt[5]]], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(path, [long_prompt[0]], 24),
                                           hf_greedy(path, [long_prompt[5]], 24)]


def test_beams_equal_the_reference(hybrid, family_path):
    """Each round's beams are forks of the last round's: they continue from a copy of their
    parent's recurrent state."""
    path = family_path("qwen3_5")
    prompts = random_prompts(2, 5, 30, seed=4)
    eos = hybrid.engine.limits.eos_token_ids
    results = hybrid.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=6),
                                 use_tqdm=False)
    for prompt, beams in zip(prompts, results):
        expected = reference_beam_search(path, prompt, 3, 6, eos)
        assert [b.token_ids for b in beams] == [tokens for tokens, _ in expected]
    _assert_nothing_held(hybrid)


def test_aborts_preemptions_and_a_burst_of_choices_leave_no_slot_held(hybrid):
    engine = hybrid.engine
    prompts = random_prompts(6, 30, 90, seed=21)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"burst-{i}", prompt, _sampled(i, n=3) if i % 2 else GREEDY)
    preempted_before = engine.stats()["num_preemptions"]
    for step in range(400):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        if step == 3:
            engine.abort_request("burst-1")
            engine.abort_request("burst-2")
    assert engine.stats()["num_preemptions"] > preempted_before
    _assert_nothing_held(hybrid)


def test_prefix_hits_resume_from_the_kept_state_and_skip_its_prefill(family_path):
    """A prompt's state is kept at its last block boundary (its first chunk ends there): the
    same prompt again, and one sharing its first 33 tokens, start from that state (its tokens
    never recomputed in any layer) with HF's tokens; two prefix-state rows (max_num_seqs=2)
    keep the two newest prompts only, so the oldest misses, then hits again."""
    path = family_path("qwen3_5")
    first, other, third = random_prompts(3, 40, 40, seed=17)
    llm = LLM(path, runtime="inprocess", num_kvcache_blocks=40, kvcache_block_size=16,
              max_model_len=160, max_num_seqs=2)
    try:
        def run(prompts):
            outs = llm.generate(prompts, GREEDY, use_tqdm=False)
            for prompt, out in zip(prompts, outs):
                assert out.token_ids == hf_greedy(path, prompt, 24), f"{len(prompt)} tokens"
            return [out.num_cached_tokens for out in outs]

        assert run([first]) == [0]
        assert run([first, first[:33] + [7, 8, 9]]) == [32, 32]  # (40 - 1) // 16 blocks
        assert run([other]) == [0]
        assert run([third]) == [0]  # two rows: the first prompt's state is gone now
        assert run([first]) == [0]
        assert run([first]) == [32]
        _assert_nothing_held(llm)
    finally:
        llm.shutdown()


def test_prompts_sharing_a_system_prompt_resume_after_it_from_the_third_on(family_path):
    """The first prompt keeps its state at its own end only; the second shares the 48-token
    system prompt's KV but no state there, so it computes it, keeping the state where it
    leaves the cached KV; from the third on, prompts with that system prompt resume after it,
    with HF's tokens."""
    path = family_path("qwen3_5")
    system = random_prompts(1, 48, 48, seed=21)[0]
    questions = random_prompts(4, 20, 28, seed=22)
    llm = LLM(path, runtime="inprocess", num_kvcache_blocks=60, kvcache_block_size=16,
              max_model_len=160, max_num_seqs=4)
    try:
        cached = []
        for question in questions:
            prompt = system + question
            out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
            assert out.token_ids == hf_greedy(path, prompt, 24), f"question {len(cached)}"
            cached.append(out.num_cached_tokens)
        assert cached == [0, 0, 48, 48]
        _assert_nothing_held(llm)
    finally:
        llm.shutdown()


def test_a_cache_the_state_leaves_too_small_is_refused_naming_the_state(family_path):
    """The state rows come out of the cache budget first (513 slots of ~6 KiB here: 256 running
    sequences, 256 kept prefix states and the scratch row)."""
    with pytest.raises(ValueError, match=r"KV cache too small.*the linear-attention layers' "
                                         r"state 3\.\d\d MiB first \(512 slots of 6\.\d KiB"):
        LLM(family_path("qwen3_5"), runtime="inprocess", cpu_kvcache_space_gib=0.003,
            max_model_len=160)


def test_the_language_model_of_a_vision_language_checkpoint_matches_hf(family_path):
    path = family_path("qwen3_5-vl")
    prompts = random_prompts(2, 20, 70, seed=5)
    llm = LLM(path, runtime="inprocess", num_kvcache_blocks=32, max_model_len=160)
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        architecture = llm.engine.limits.architecture
    finally:
        llm.shutdown()
    assert architecture == "Qwen3_5ForConditionalGeneration"
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(path, prompt, 24)


# a hybrid whose every projection splits into Qwen's 128x128 FP8 blocks (but a and b: 4 rows)
FP8_HYBRID = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
              "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
              "layer_types": ["linear_attention", "full_attention"],
              "max_position_embeddings": 1024, "linear_num_key_heads": 2,
              "linear_num_value_heads": 4, "linear_key_head_dim": 64,
              "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4}


@pytest.fixture(scope="module")
def qwen3_5_fp8(tmp_path_factory, tiny_path) -> tuple[str, str]:
    from fp8_checkpoints import write_fp8_checkpoint
    from hf_checkpoints import write_hf_checkpoint

    root = tmp_path_factory.mktemp("qwen3_5-fp8")
    src = write_hf_checkpoint(str(root / "src"), FP8_HYBRID, tiny_path, seed=5)
    small = ("model.layers.0.linear_attn.in_proj_a", "model.layers.0.linear_attn.in_proj_b")
    return src, write_fp8_checkpoint(src, str(root / "fp8"), "qwen-fp8", ignore=small)


def test_qwens_fp8_checkpoint_of_a_hybrid_matches_transformers_reading_of_it(qwen3_5_fp8):
    """Qwen's FP8 format (128x128 block scales, dynamic activations) for a hybrid: the linear
    layers' fused q/k/v, z and out projections, the gated attention's and the MLP's are FP8
    (a and b, left unquantized by the config, full precision); prefill logits within a third of
    the quantization noise of transformers' own FP8 reading of the files, and greedy tokens
    its argmax (or a near-tie of it)."""
    from fp8_checkpoints import assert_near_argmax, hf_fp8_model

    src, path = qwen3_5_fp8
    runner = ModelRunner(EngineConfig(model=path, num_kvcache_blocks=16, kvcache_block_size=16),
                         path)
    runner.allocate_kv_cache(16, state_rows=2)
    linear, full = runner.model.model.layers[0], runner.model.model.layers[1]
    for layer in (linear.linear_attn.in_proj_qkv, linear.linear_attn.in_proj_z,
                  linear.linear_attn.out_proj, full.self_attn.qkv_proj, full.mlp.down_proj):
        assert layer.weight.dtype == torch.float8_e4m3fn
    assert linear.linear_attn.in_proj_a.weight.dtype == torch.float32
    oracle, unquantized = hf_fp8_model(path), hf_model(src)
    prompts = random_prompts(3, 30, 90, seed=4)
    for prompt in prompts:
        with torch.no_grad():
            ref = oracle(torch.tensor([prompt])).logits[0, -1]
            noise = float((ref - unquantized(torch.tensor([prompt])).logits[0, -1]).abs().max())
        ours = runner.forward(greedy_step(prompt, 0, list(range(15, -1, -1))))[0][0]
        assert noise > 0.05, "the FP8 files must differ visibly from the unquantized model"
        assert float((ours - ref).abs().max()) <= 0.35 * noise
    llm = LLM(path, runtime="inprocess", num_kvcache_blocks=32, max_model_len=160)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8,
                                                    ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    exact = [assert_near_argmax(oracle, prompt, out.token_ids, 0.35 * noise)
             for prompt, out in zip(prompts, outs)]
    assert sum(exact) / len(exact) >= 0.75, f"oracle argmax rate per prompt {exact}"
