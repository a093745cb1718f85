"""Log-probabilities and prompt scoring, against HF transformers' log_softmax of its logits.

The oracle is one HF forward over prompt + output (fp32): the log-probability of token t at
position i is log_softmax(logits[i - 1])[t]; the top-k at i are the k largest of that row.
Runs in-process on the tiny model and another Qwen3 shape, with overlapped steps on and off.
"""

from __future__ import annotations

import pytest
import torch

from oracle import hf_model, random_prompts
from nvray import LLM, SamplingParams

TOL = 2e-4


def hf_logprobs(path: str, token_ids: list[int]) -> torch.Tensor:
    """[len - 1, V]: row i is the distribution of token i + 1."""
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([token_ids])).logits[0]
    return logits.float().log_softmax(-1)[:-1]


def assert_matches(reported, rows: torch.Tensor, targets: list[int], k: int) -> None:
    assert len(reported) == len(targets) == rows.shape[0]
    for lp, row, target in zip(reported, rows, targets):
        assert lp.logprob == pytest.approx(row[target].item(), abs=TOL)
        assert len(lp.top_ids) == len(lp.top_logprobs) == k
        top = row.topk(k)
        assert set(lp.top_ids) == set(top.indices.tolist())
        assert lp.top_logprobs == pytest.approx(top.values.tolist(), abs=TOL)
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)


@pytest.fixture(scope="module", params=["tiny", "other"])
def model(request, tiny_path, other_qwen3_path):
    path = tiny_path if request.param == "tiny" else other_qwen3_path
    llm = LLM(path, runtime="inprocess", max_model_len=256, max_num_batched_tokens=24,
              kvcache_block_size=8)
    yield path, llm
    llm.shutdown()


def test_output_and_prompt_logprobs_equal_hf(model):
    path, llm = model
    prompts = random_prompts(3, 5, 40, seed=11)  # prompts over 24 tokens prefill in chunks
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=4,
                            prompt_logprobs=3)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        rows = hf_logprobs(path, prompt + out.token_ids)
        assert out.token_ids == rows[len(prompt) - 1:].argmax(-1).tolist()  # greedy = HF's
        assert_matches(out.logprobs, rows[len(prompt) - 1:], out.token_ids, 4)
        assert out.prompt_logprobs[0] is None
        assert_matches(out.prompt_logprobs[1:], rows[:len(prompt) - 1], prompt[1:], 3)


def test_logprobs_are_of_the_raw_logits_whatever_the_sampling(model):
    path, llm = model
    prompt = random_prompts(1, 12, 12, seed=3)[0]
    params = SamplingParams(temperature=0.7, top_k=5, seed=9, max_tokens=8, ignore_eos=True,
                            logprobs=0, presence_penalty=1.5, repetition_penalty=1.3,
                            logit_bias={7: 5.0})
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    rows = hf_logprobs(path, prompt + out.token_ids)
    assert_matches(out.logprobs, rows[len(prompt) - 1:], out.token_ids, 0)


def test_scoring_a_prompt_with_max_tokens_zero(model):
    """The evaluation-harness request: score a prompt, generate nothing; a prefix-cache hit
    must not cut the scores short."""
    path, llm = model
    prompt = random_prompts(1, 50, 50, seed=5)[0]
    llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)  # cache its blocks
    out = llm.generate(prompt, SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False)[0]
    assert out.token_ids == [] and out.text == "" and out.finish_reason == "length"
    assert out.usage["completion_tokens"] == 0
    rows = hf_logprobs(path, prompt)
    assert_matches(out.prompt_logprobs[1:], rows, prompt[1:], 0)


@pytest.mark.parametrize("overlap", [True, False])
def test_streamed_logprobs_add_up_to_the_final_ones(tiny_path, overlap):
    llm = LLM("tiny", runtime="inprocess", max_model_len=128, overlap_scheduling=overlap)
    engine = llm.engine
    try:
        prompt = random_prompts(1, 9, 9, seed=8)[0]
        engine.add_request("s", prompt, SamplingParams(temperature=0.0, max_tokens=7,
                                                       ignore_eos=True, logprobs=2,
                                                       prompt_logprobs=1), stream=True)
        outs = []
        for _ in range(50):
            outs += engine.step()
            if outs and outs[-1].finished:
                break
        final = outs[-1]
        assert [lp for o in outs for lp in o.delta_logprobs] == final.logprobs
        assert len(final.logprobs) == 7
        assert outs[0].prompt_logprobs == final.prompt_logprobs and len(final.prompt_logprobs) == 9
        rows = hf_logprobs(tiny_path, prompt + final.token_ids)
        assert_matches(final.logprobs, rows[8:], final.token_ids, 2)
    finally:
        llm.shutdown()


def test_logprobs_off_costs_nothing_in_the_output(model):
    _, llm = model
    out = llm.generate("no logprobs", SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert out.logprobs is None and out.prompt_logprobs is None
