"""Penalties, logit_bias, allowed_token_ids and bad_words against a reference written here:
greedy decoding over HF transformers' logits with each rule applied as vLLM defines it.
In-process, overlapped steps on and off, with other requests in the same batch."""

from __future__ import annotations

import pytest
import torch

from oracle import hf_model, random_prompts
from nvray import LLM, SamplingParams

STEPS = 10


def reference_greedy(path: str, prompt: list[int], steps: int, presence=0.0, frequency=0.0,
                     repetition=1.0, bias=None, allowed=None, bad_words=()) -> list[int]:
    model, out = hf_model(path), []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].double()
        if allowed is not None:  # vLLM's order: allowed ids, biases, then penalties
            keep = torch.full_like(logits, float("-inf"))
            keep[list(allowed)] = 0
            logits += keep
        for token, b in (bias or {}).items():
            logits[token] += b
        for token in set(prompt) | set(out):  # repetition: prompt and output
            if repetition != 1.0:
                logits[token] = logits[token] / repetition if logits[token] > 0 else logits[token] * repetition
        for token in set(out):  # frequency and presence: output only
            logits[token] -= frequency * out.count(token) + presence
        for word in bad_words:
            if len(word) == 1 or out[len(out) - len(word) + 1:] == list(word[:-1]):
                logits[word[-1]] = float("-inf")
        out.append(int(logits.argmax()))
    return out


@pytest.fixture(scope="module", params=[True, False], ids=["overlap", "no-overlap"])
def llm(request):
    llm = LLM("tiny", runtime="inprocess", max_model_len=128, overlap_scheduling=request.param)
    yield llm
    llm.shutdown()


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, **kw)


CASES = [dict(presence=1.5), dict(frequency=0.8), dict(presence=-0.5, frequency=1.2),
         dict(repetition=1.8), dict(repetition=0.6), dict(repetition=1.3, frequency=0.5),
         dict(bias={5: 30.0, 9: 29.5}), dict(allowed=(11, 12, 13, 40)),
         dict(bias={5: 8.0, 9: 7.0, 12: 6.0}, repetition=3.0)]


@pytest.mark.parametrize("case", CASES, ids=[str(sorted(c)) for c in CASES])
def test_greedy_tokens_equal_the_reference(llm, tiny_path, case):
    prompts = random_prompts(3, 4, 20, seed=21)
    params = _greedy(presence_penalty=case.get("presence", 0.0),
                     frequency_penalty=case.get("frequency", 0.0),
                     repetition_penalty=case.get("repetition", 1.0),
                     logit_bias=case.get("bias"), allowed_token_ids=case.get("allowed"))
    # each batch mixes requests with the rule and without it
    outs = llm.generate(prompts + prompts, [params] * 3 + [_greedy()] * 3, use_tqdm=False)
    for prompt, out in zip(prompts, outs[:3]):
        assert out.token_ids == reference_greedy(tiny_path, prompt, STEPS, **case)
    for prompt, out in zip(prompts, outs[3:]):
        assert out.token_ids == reference_greedy(tiny_path, prompt, STEPS)
    assert any(a.token_ids != b.token_ids for a, b in zip(outs[:3], outs[3:]))  # it mattered


def test_bad_words_single_and_multi_token(llm, tiny_path):
    tok = llm.tokenizer
    prompt = random_prompts(1, 8, 8, seed=4)[0]
    plain = reference_greedy(tiny_path, prompt, STEPS)
    one = tok.decode(plain[2:3])  # a word the plain output contains, and a two-token one
    two = tok.decode(plain[4:6])
    words = []
    for text in (one, two):
        for variant in dict.fromkeys((text, text if text.startswith(" ") else " " + text)):
            words.append(tuple(tok.encode(variant, add_special_tokens=False)))
    out = llm.generate(prompt, _greedy(bad_words=[one, two]), use_tqdm=False)[0]
    assert out.token_ids == reference_greedy(tiny_path, prompt, STEPS, bad_words=words)
    assert out.token_ids != plain


def test_out_of_vocabulary_ids_are_rejected_naming_the_parameter(llm):
    vocab = llm.engine.limits.vocab_size
    for name, value in (("logit_bias", {vocab: 1.0}), ("allowed_token_ids", [3, vocab])):
        with pytest.raises(ValueError, match=name):
            llm.generate("x", SamplingParams(**{name: value}), use_tqdm=False)


def test_logits_adjustment_counts_each_repeat_of_an_output_token():
    """``adjust_logits`` against the definitions written out here: frequency scales with the
    count (a token seen 4 times, the newest still on the device, loses 4 frequencies), presence
    and repetition do not; a row without penalties in the same batch is left alone."""
    from array import array

    from nvray.step_protocol import Penalties, SampleSpec
    from nvray.worker.logits_processors import adjust_logits

    prompt, output, pending = [1, 2], [3, 3, 5, 3], 3
    torch.manual_seed(0)
    logits = torch.randn(2, 8)
    # the seen tokens 1, 2, 3, 5 with a logit in (0, 1], a negative one, one above 1 and one of 0
    logits[1] = torch.tensor([0.3, 0.5, -0.75, 2.5, 1.2, 0.0, -0.2, 0.1])
    tokens = array("i", prompt + output).tobytes()
    penalized = SampleSpec(1.0, 1.0, -1, 0.0, None, len(output) + 1, penalties=Penalties(
        presence=0.25, frequency=0.5, repetition=2.0, tokens=tokens, num_prompt_tokens=2,
        pending_row=1))
    plain = SampleSpec(1.0, 1.0, -1, 0.0, None, 0)
    prev_sampled = torch.tensor([6, pending], dtype=torch.int32)  # row 1: the pending token
    adjusted = adjust_logits(logits.clone(), [plain, penalized], prev_sampled)
    expected = logits[1].clone()
    full_output = output + [pending]
    for token in set(prompt + full_output):
        expected[token] = expected[token] / 2 if expected[token] > 0 else expected[token] * 2
    for token in set(full_output):
        expected[token] -= 0.5 * full_output.count(token) + 0.25
    assert torch.equal(adjusted[0], logits[0])
    torch.testing.assert_close(adjusted[1], expected)
