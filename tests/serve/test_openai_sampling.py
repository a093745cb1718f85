"""Issue 11 over real HTTP with the real openai client: log-probabilities (completions and chat,
streamed and not), echo with max_tokens 0 (scoring a prompt), n choices, penalties and biases,
beam search; each compared with the offline engine, and each bad value a 400 naming it."""

from __future__ import annotations

import pytest
import requests

from nvray import BeamSearchParams, SamplingParams
from serve_helpers import greedy

PROMPT = "Scoring the engine's prompt"


def token_text(offline, token_id: int) -> str:
    return offline.tokenizer.decode([token_id])


def test_completion_logprobs_equal_the_offline_engine(client, offline):
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                     logprobs=3, extra_body={"ignore_eos": True})
    want = offline.generate(PROMPT, greedy(6, logprobs=3), use_tqdm=False)[0]
    lp = resp.choices[0].logprobs
    assert lp.tokens == [token_text(offline, t) for t in want.token_ids]
    assert lp.token_logprobs == pytest.approx([x.logprob for x in want.logprobs], abs=1e-4)
    for top, x, token in zip(lp.top_logprobs, want.logprobs, want.token_ids):
        expected = {token_text(offline, i): v for i, v in zip(x.top_ids, x.top_logprobs)}
        expected[token_text(offline, token)] = x.logprob
        assert top == pytest.approx(expected, abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert "".join(lp.tokens) == resp.choices[0].text


@pytest.mark.parametrize("as_ids", [False, True], ids=["text", "token-ids"])
def test_echo_with_max_tokens_zero_scores_the_prompt(client, offline, as_ids):
    ids = offline.tokenizer.encode(PROMPT, add_special_tokens=False)
    resp = client.completions.create(model="tiny", prompt=ids if as_ids else PROMPT, max_tokens=0,
                                     echo=True, logprobs=1)
    choice = resp.choices[0]
    assert choice.text == offline.tokenizer.decode(ids) and choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 0 and resp.usage.prompt_tokens == len(ids)
    want = offline.generate(ids, SamplingParams(max_tokens=0, prompt_logprobs=1),
                            use_tqdm=False)[0]
    assert choice.logprobs.tokens == [token_text(offline, t) for t in ids]
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(
        [x.logprob for x in want.prompt_logprobs[1:]], abs=1e-4)


def test_echo_with_generation_streams_the_prompt_first(client, offline):
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, echo=True,
                  logprobs=2, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs) if c.choices]
    assert chunks[0].text.startswith(PROMPT)
    assert "".join(c.text for c in chunks) == full.text
    assert sum((c.logprobs.tokens for c in chunks), []) == full.logprobs.tokens
    streamed = sum((c.logprobs.token_logprobs for c in chunks), [])
    assert streamed[0] is None and full.logprobs.token_logprobs[0] is None
    assert streamed[1:] == pytest.approx(full.logprobs.token_logprobs[1:], abs=1e-4)
    assert sum((c.logprobs.text_offset for c in chunks), []) == full.logprobs.text_offset
    assert full.text.startswith(PROMPT)


def test_chat_logprobs_streamed_and_not(client, offline):
    messages = [{"role": "user", "content": "Give me log-probabilities"}]
    kwargs = dict(model="tiny", messages=messages, max_tokens=6, temperature=0, logprobs=True,
                  top_logprobs=2, extra_body={"ignore_eos": True})
    resp = client.chat.completions.create(**kwargs)
    want = offline.chat(messages, greedy(6, logprobs=2), use_tqdm=False)[0]
    content = resp.choices[0].logprobs.content
    assert [c.token for c in content] == [token_text(offline, t) for t in want.token_ids]
    assert [c.logprob for c in content] == pytest.approx([x.logprob for x in want.logprobs],
                                                         abs=1e-4)
    assert all(c.bytes == list(c.token.encode()) and len(c.top_logprobs) == 2 for c in content)
    streamed = [e for chunk in client.chat.completions.create(stream=True, **kwargs)
                if chunk.choices and chunk.choices[0].logprobs
                for e in chunk.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [c.token for c in content]
    assert [e.logprob for e in streamed] == pytest.approx([c.logprob for c in content], abs=1e-4)


def test_n_choices_count_the_prompt_once(client, offline):
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, n=3, seed=9,
                                     temperature=1.0, extra_body={"ignore_eos": True})
    want = offline.generate(PROMPT, SamplingParams(max_tokens=6, n=3, seed=9, temperature=1.0,
                                                   ignore_eos=True), use_tqdm=False)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == [w.text for w in want]
    assert resp.usage.prompt_tokens == len(want[0].prompt_token_ids)
    assert resp.usage.completion_tokens == 18
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                            max_tokens=4, n=2, stream=True,
                                            extra_body={"ignore_eos": True})
    finishes = {c.choices[0].index: c.choices[0].finish_reason for c in stream
                if c.choices and c.choices[0].finish_reason}
    assert finishes == {0: "length", 1: "length"}


def test_penalties_and_biases_equal_the_offline_engine(client, offline):
    extra = {"ignore_eos": True, "repetition_penalty": 1.5, "allowed_token_ids": list(range(3, 60)),
             "bad_words": ["the"]}
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0,
                                     presence_penalty=0.5, frequency_penalty=1.0,
                                     logit_bias={"17": 4.0}, extra_body=extra)
    want = offline.generate(PROMPT, greedy(10, presence_penalty=0.5, frequency_penalty=1.0,
                                           logit_bias={17: 4.0}, repetition_penalty=1.5,
                                           allowed_token_ids=list(range(3, 60)),
                                           bad_words=["the"]), use_tqdm=False)[0]
    assert resp.choices[0].text == want.text
    assert resp.choices[0].text != offline.generate(PROMPT, greedy(10), use_tqdm=False)[0].text


def test_beam_search_over_http_equals_the_offline_one(client, offline):
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, n=3,
                                     extra_body={"use_beam_search": True, "ignore_eos": True})
    want = offline.beam_search(PROMPT, BeamSearchParams(beam_width=3, max_tokens=5,
                                                        ignore_eos=True), use_tqdm=False)[0]
    assert [c.text for c in resp.choices] == [w.text for w in want]
    assert resp.usage.completion_tokens == 15


BAD = [("completions", {"logprobs": 21}, "logprobs"),
       ("completions", {"max_tokens": 0}, "max_tokens"),
       ("completions", {"n": 0}, "n"),
       ("completions", {"n": 500}, "n"),
       ("completions", {"presence_penalty": 3}, "presence_penalty"),
       ("completions", {"frequency_penalty": -2.5}, "frequency_penalty"),
       ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
       ("completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
       ("completions", {"logit_bias": {"5": 300}}, "logit_bias"),
       ("completions", {"logit_bias": {"99999999": 1}}, "logit_bias"),
       ("completions", {"allowed_token_ids": [-1]}, "allowed_token_ids"),
       ("completions", {"allowed_token_ids": [99999999]}, "allowed_token_ids"),
       ("completions", {"bad_words": [""]}, "bad_words"),
       ("completions", {"use_beam_search": True, "n": 2, "temperature": 0.7}, "temperature"),
       ("completions", {"use_beam_search": True, "n": 2, "stream": True}, "stream"),
       ("completions", {"use_beam_search": True, "n": 2, "logprobs": 1}, "logprobs"),
       ("completions", {"use_beam_search": True, "n": 30}, "n"),
       ("chat/completions", {"logprobs": True, "top_logprobs": 25}, "top_logprobs"),
       ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
       ("chat/completions", {"use_beam_search": True, "n": 2}, "max_tokens"),
       ("chat/completions", {"max_tokens": 0}, "max_tokens")]


@pytest.mark.parametrize("path,fields,param", BAD, ids=[f"{p}-{f}" for p, f, _ in BAD])
def test_bad_values_are_a_400_naming_the_parameter(base_url, path, fields, param):
    body = {"model": "tiny", **fields}
    if path == "completions":
        body.setdefault("prompt", PROMPT)
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    resp = requests.post(f"{base_url}/v1/{path}", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.text


def test_handles_take_n_logprobs_and_beam_search(base_url, ray_cluster, offline):
    ray = ray_cluster

    @ray.remote(num_cpus=0.1)
    def call_handle(prompt: str) -> tuple:
        from ray import serve as s

        from nvray import BeamSearchParams as Beams

        handle = s.get_app_handle("default")
        choices = handle.generate.remote(prompt, {"n": 2, "seed": 3, "max_tokens": 4,
                                                  "logprobs": 1, "ignore_eos": True}).result()
        beams = handle.generate.remote(prompt, Beams(beam_width=2, max_tokens=4)).result()
        return ([(c.index, c.token_ids, [lp.logprob for lp in c.logprobs]) for c in choices],
                [(b.token_ids, b.cumulative_logprob) for b in beams])

    choices, beams = ray.get(call_handle.remote(PROMPT), timeout=120)
    want = offline.generate(PROMPT, SamplingParams(n=2, seed=3, max_tokens=4, logprobs=1,
                                                   ignore_eos=True), use_tqdm=False)
    assert [(i, ids) for i, ids, _ in choices] == [(w.index, w.token_ids) for w in want]
    assert [lp for _, _, lps in choices for lp in lps] == pytest.approx(
        [lp.logprob for w in want for lp in w.logprobs], abs=1e-4)
    want_beams = offline.beam_search(PROMPT, BeamSearchParams(beam_width=2, max_tokens=4),
                                     use_tqdm=False)[0]
    assert [ids for ids, _ in beams] == [b.token_ids for b in want_beams]
