"""A speculating app over HTTP (``speculative_config`` as ``serve run`` passes it, a JSON
string): the openai client gets the tokens of the app that does not speculate, /metrics counts
the drafts (vLLM's spec_decode counters) and so does the response's usage
(``completion_tokens_details``' accepted/rejected prediction tokens), and a request's
``speculate: false`` adds none."""

from __future__ import annotations

import openai
import pytest
from ray import serve

from deployments import build_app
from nvray.bench.http_load import wait_healthy
from serve_helpers import MAX_MODEL_LEN, metric

MSG = [{"role": "user", "content": "count: one two three one two three one two"}]
DRAFTS = "nvray_spec_decode_num_draft_tokens_total"


@pytest.fixture(scope="module")
def spec_url(serve_http):
    config = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    serve.run(build_app({"max_model_len": MAX_MODEL_LEN, "num_cpus_per_rank": 1,
                         "speculative_config": config}), name="spec", route_prefix="/spec")
    wait_healthy(f"{serve_http}/spec")
    yield f"{serve_http}/spec"
    serve.delete("spec")


def _chat(base: str, **extra):  # noqa: ANN202
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=40,
                                         temperature=0,
                                         extra_body={"ignore_eos": True, **extra})
    assert out.usage.completion_tokens == 40
    return out


def _answer(base: str, **extra) -> str:
    return _chat(base, **extra).choices[0].message.content


def test_a_speculating_app_answers_as_the_plain_one_and_counts_its_drafts(spec_url, base_url):
    before = metric(spec_url, DRAFTS)
    spec = _chat(spec_url)
    assert spec.choices[0].message.content == _answer(base_url)
    drafted = metric(spec_url, DRAFTS)
    assert drafted > before
    assert metric(spec_url, "nvray_spec_decode_num_drafts_total") > 0
    details = spec.usage.completion_tokens_details
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == drafted - before
    assert _chat(base_url).usage.completion_tokens_details is None  # nothing drafted
    opted_out = _chat(spec_url, speculate=False)
    assert opted_out.choices[0].message.content == _answer(base_url)
    assert metric(spec_url, DRAFTS) == drafted  # opted out: no drafts
    assert opted_out.usage.completion_tokens_details is None
