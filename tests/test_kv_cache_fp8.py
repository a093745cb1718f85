"""An FP8 KV cache (``kv_cache_dtype='fp8'``: keys and values stored as e4m3, scale 1) on the
CPU path, against HF transformers' Qwen3 whose attention reads keys and values through the same
FP8 round trip (fp8_checkpoints.hf_fp8_kv_model); the tolerance comes from the KV quantization
noise as in test_fp8.py."""

from __future__ import annotations

import pytest

from fp8_checkpoints import assert_near_argmax, hf_fp8_kv_model
from oracle import hf_greedy, hf_model, random_prompts
from test_fp8 import _error_ratios, _noise, _runner, assert_within_noise
from nvray import LLM, EngineConfig, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.mark.parametrize("model", ["tiny_path", "other_qwen3_path"])
def test_fp8_kv_logits_match_transformers_reading_fp8_keys_and_values(model, request):
    path = request.getfixturevalue(model)
    runner = _runner(path, kv_cache_dtype="fp8")
    assert runner.attention_layers[0].k_cache.dtype.itemsize == 1
    prompts = random_prompts(6, 10, 40, seed=17)
    assert_within_noise(_error_ratios(runner, hf_fp8_kv_model(path), hf_model(path), prompts))


def test_fp8_kv_greedy_tokens_match_with_chunks_and_prefix_hits(tiny_path):
    """Chunked prefill (a 32-token budget) and prefix-cache hits read the FP8 blocks that
    earlier steps wrote; the tokens must still be the oracle's."""
    oracle = hf_fp8_kv_model(tiny_path)
    prompts = random_prompts(4, 40, 90, seed=18)
    prompts += [prompts[0] + [7, 8, 9], prompts[1][:50] + [11]]  # shared prefixes, hit later
    llm = LLM(tiny_path, runtime="inprocess", kv_cache_dtype="fp8", max_num_batched_tokens=32,
              enable_chunked_prefill=True)
    first = llm.generate(prompts[:4], GREEDY, use_tqdm=False)
    again = llm.generate(prompts[4:], GREEDY, use_tqdm=False)
    assert again[0].num_cached_tokens >= 32 and again[1].num_cached_tokens >= 32
    tol = 0.35 * _noise(oracle, hf_model(tiny_path), prompts[0])
    exact = [assert_near_argmax(oracle, prompt, out.token_ids, tol)
             for prompt, out in zip(prompts, first + again)]
    assert sum(exact) / len(exact) >= 0.75, f"oracle argmax rate per prompt {exact}"


def test_fp8_kv_differs_from_the_full_precision_cache(tiny_path):
    """The round trip is real: on this random model it changes some greedy continuation."""
    prompts = random_prompts(8, 10, 60, seed=19)
    outs = LLM(tiny_path, runtime="inprocess", kv_cache_dtype="fp8").generate(
        prompts, GREEDY, use_tqdm=False)
    assert any(o.token_ids != hf_greedy(tiny_path, p, GREEDY.max_tokens)
               for p, o in zip(prompts, outs))


def test_fp8_kv_cache_holds_twice_the_blocks_in_the_same_memory(tiny_path):
    blocks = {}
    for kv in ("auto", "fp8"):
        llm = LLM(tiny_path, runtime="inprocess", kv_cache_dtype=kv, dtype="bfloat16",
                  cpu_kvcache_space_gib=0.05)
        blocks[kv] = llm.stats()["num_kvcache_blocks"]
        assert llm.stats()["dtypes"]["kv_cache"] == ("bfloat16" if kv == "auto" else "fp8 e4m3 (scale 1)")
    assert blocks["fp8"] >= 1.9 * blocks["auto"], blocks


def test_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        EngineConfig(kv_cache_dtype="int8")


def test_forked_choices_copy_fp8_blocks(tiny_path):
    """n > 1 shares the prompt's blocks and copies the partial one before each choice writes
    into it (copy-on-write of e4m3 blocks): every seeded choice equals the same request made
    alone, which prefilled its own blocks."""
    llm = LLM(tiny_path, runtime="inprocess", kv_cache_dtype="fp8")
    prompt = random_prompts(1, 37, 37, seed=20)[0]  # 36 shared tokens: the 3rd block is partial
    copied = llm.engine.block_manager.num_copied_blocks

    def sampled(seed: int, n: int = 1) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True, n=n)

    choices = llm.generate(prompt, sampled(100, n=3), use_tqdm=False)
    assert llm.engine.block_manager.num_copied_blocks > copied
    alone = LLM(tiny_path, runtime="inprocess", kv_cache_dtype="fp8", enable_prefix_caching=False)
    for i, choice in enumerate(choices):
        assert choice.token_ids == alone.generate(prompt, sampled(100 + i), use_tqdm=False)[0].token_ids
