"""Stream pacing (``stream_chunks_per_s``): a replica shares a budget of SSE chunks per second
among its open streams, so a stream under a small budget gets its tokens in fewer, larger
chunks, never in a different text: the merged stream equals the unstreamed answer, its first
chunk carries the first token, and its end (finish reason, usage) still arrives."""

from __future__ import annotations

import json

import pytest
import requests
from ray import serve

from deployments import build_app
from serve_helpers import greedy

PROMPT = "pace the stream of"
TOKENS = 64


@pytest.fixture(scope="module")
def paced_url(serve_http):
    # 2 chunks a second: one open stream writes at most every 500 ms
    serve.run(build_app({"max_model_len": 256, "num_cpus_per_rank": 1,
                         "stream_chunks_per_s": 2}), name="paced", route_prefix="/paced")
    yield f"{serve_http}/paced"
    serve.delete("paced")


def stream_events(url: str, path: str, body: dict) -> list[dict]:
    with requests.post(f"{url}{path}", json={**body, "stream": True}, stream=True,
                       timeout=120) as r:
        assert r.status_code == 200, r.text
        lines = [line for line in r.iter_lines() if line.startswith(b"data: ")]
    assert lines[-1] == b"data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_a_paced_stream_merges_tokens_into_fewer_chunks_with_the_same_text(paced_url, offline):
    expected = offline.generate(PROMPT, greedy(TOKENS), use_tqdm=False)[0].text
    events = stream_events(paced_url, "/v1/completions", {
        "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
        "stream_options": {"include_usage": True}})
    chunks = [e for e in events if e["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == TOKENS
    # the tiny model steps in well under 30 ms on CPU: unpaced, a lone stream gets a chunk
    # per token or so; paced at 500 ms, many tokens per chunk
    assert len(chunks) <= TOKENS // 3


def test_a_paced_chat_stream_sends_its_role_and_first_token_without_holding(paced_url, offline):
    """The role chunk is written at once and does not start a pause: the first token's chunk
    follows as soon as the engine has it, carrying a few tokens (held for the 500 ms pause,
    it would carry all that the engine makes in that time: every one of the 24 on an idle
    machine); the rest merges, and the text is the unstreamed answer's."""
    messages = [{"role": "user", "content": PROMPT}]
    events = stream_events(paced_url, "/v1/chat/completions", {
        "messages": messages, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    chunks = [e for e in events if e["choices"]]
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    with_text = [c for c in chunks if c["choices"][0]["delta"].get("content")]
    assert with_text[0]["usage"]["completion_tokens"] < 24 // 2
    assert len(with_text) <= 24 // 3
    text = "".join(c["choices"][0]["delta"]["content"] for c in with_text)
    assert text == offline.chat(messages, greedy(24), use_tqdm=False)[0].text
