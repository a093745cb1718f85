"""Streaming through the Serve app over real HTTP: many concurrent streams equal the
non-streamed answers byte for byte and token for token (completions with several prompts,
chat, stop strings, multi-byte characters), a client that stops reading stalls nobody, and
handle streams and EngineClient streams run interleaved with HTTP streams on one engine."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from serve_helpers import greedy, metric

PROMPTS = ["Streaming at engine speed", "One message per step", "Ray Serve", "paged KV blocks",
           "a prefix cache", "continuous batching", "tensor parallel ranks", "the step loop"]
CHATS = [[{"role": "user", "content": p}] for p in PROMPTS[:4]]
OPTIONS = {"include_usage": True, "continuous_usage_stats": True}


def sse_events(resp: requests.Response) -> list[dict]:
    events = []
    for line in resp.iter_lines():
        if line == b"data: [DONE]":
            events.append({"done": True})
        elif line.startswith(b"data: "):
            events.append(json.loads(line[len(b"data: "):]))
    return events


def stream_request(base_url: str, path: str, body: dict) -> list[dict]:
    with requests.post(f"{base_url}/v1/{path}", stream=True, timeout=120,
                       json={**body, "stream": True, "stream_options": OPTIONS}) as resp:
        assert resp.status_code == 200, resp.text
        return sse_events(resp)


def collect_choices(events: list[dict], chat: bool) -> dict[int, dict]:
    """Per choice: concatenated text, token count from the running usage, finish reason."""
    assert events[-1] == {"done": True} and not any("error" in e for e in events)
    choices: dict[int, dict] = {}
    for event in events[:-1]:
        for choice in event.get("choices") or ():
            c = choices.setdefault(choice["index"], {"text": "", "tokens": 0, "finish": None})
            c["text"] += (choice["delta"].get("content") or "") if chat else choice["text"]
            c["finish"] = choice["finish_reason"] or c["finish"]
            assert c["tokens"] <= event["usage"]["completion_tokens"]  # running counts only grow
            c["tokens"] = event["usage"]["completion_tokens"]
    return choices


def test_concurrent_streams_equal_the_non_streamed_answers(base_url, offline):
    stop = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    jobs = [("completions", {**stop, "prompt": PROMPTS[i:i + 2]}, False) for i in range(0, 8, 2)]
    jobs += [("completions", {**stop, "prompt": p, "stop": [p[-3:], "e"]}, False) for p in PROMPTS[:4]]
    jobs += [("chat/completions", {**stop, "messages": m}, True) for m in CHATS]
    with ThreadPoolExecutor(len(jobs)) as pool:
        streamed = list(pool.map(lambda j: collect_choices(stream_request(base_url, j[0], j[1]), j[2]),
                                 jobs))
    non_ascii = 0
    for (path, body, chat), choices in zip(jobs, streamed):
        unary = requests.post(f"{base_url}/v1/{path}", json=body, timeout=120).json()
        for choice in unary["choices"]:
            got = choices[choice["index"]]
            text = choice["message"]["content"] if chat else choice["text"]
            assert got["text"].encode() == text.encode()
            assert got["finish"] == choice["finish_reason"]
            non_ascii += any(ord(ch) > 127 for ch in text)
        assert sum(c["tokens"] for c in choices.values()) == unary["usage"]["completion_tokens"]
    # the oracle: the offline engine's greedy text for the plain prompts
    expected = offline.generate(PROMPTS, greedy(24), use_tqdm=False)
    assert [streamed[i // 2][i % 2]["text"] for i in range(8)] == [e.text for e in expected]
    assert non_ascii, "the outputs should include multi-byte characters (the tiny model's do)"
    stopped = [streamed[4 + i][0] for i in range(4)]
    assert any(c["finish"] == "stop" for c in stopped), "a stop string should have been hit"


def test_a_client_that_stops_reading_stalls_no_other_stream(base_url, offline):
    body = {"prompt": "a slow reader", "max_tokens": 300, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with requests.post(f"{base_url}/v1/completions", stream=True, timeout=120, json=body) as slow:
        lines = slow.iter_lines()
        assert next(lines).startswith(b"data: {")  # it started, and now it is not read
        start = time.monotonic()
        fast = collect_choices(stream_request(base_url, "completions", {
            "prompt": "a fast reader", "max_tokens": 40, "temperature": 0, "ignore_eos": True}), False)
        assert time.monotonic() - start < 60
        assert fast[0]["text"] == offline.generate("a fast reader", greedy(40), use_tqdm=False)[0].text
        rest = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
    assert rest[-1]["choices"][0]["finish_reason"] == "length"  # it resumes, complete
    assert metric(base_url, "nvray_num_requests_running") == 0


def test_handle_and_engine_client_streams_interleave_with_http_streams(base_url, ray_cluster, offline):
    ray = ray_cluster
    params = {"temperature": 0.0, "max_tokens": 20, "ignore_eos": True}

    @ray.remote(num_cpus=0.1)
    def handle_and_client_streams(prompt_a: str, prompt_b: str) -> tuple:
        from ray import serve as s

        handle = s.get_app_handle("default")
        client = handle.engine_client.remote().result()
        deltas_a = list(handle.options(stream=True).generate_stream.remote(prompt_a, params))
        deltas_b = list(client.stream(prompt_b, params))
        client.close()
        return ([(d.delta_text, d.delta_token_ids, d.finished) for d in deltas_a], deltas_a[-1].token_ids,
                [(d.delta_text, d.delta_token_ids, d.finished) for d in deltas_b], deltas_b[-1].token_ids)

    remote = handle_and_client_streams.remote("via a handle", "via an engine client")
    with ThreadPoolExecutor(3) as pool:
        http = list(pool.map(lambda p: collect_choices(stream_request(base_url, "completions", {
            "prompt": p, **params}), False)[0]["text"], PROMPTS[:3]))
    deltas_a, final_a, deltas_b, final_b = ray.get(remote, timeout=120)
    expected = offline.generate(["via a handle", "via an engine client", *PROMPTS[:3]],
                                greedy(20), use_tqdm=False)
    for deltas, final, exp in ((deltas_a, final_a, expected[0]), (deltas_b, final_b, expected[1])):
        assert [d[2] for d in deltas] == [False] * (len(deltas) - 1) + [True]
        assert "".join(d[0] for d in deltas) == exp.text
        assert [t for d in deltas for t in d[1]] == final == exp.token_ids
    assert http == [e.text for e in expected[2:]]
