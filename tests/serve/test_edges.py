"""Edges of the HTTP app that a user meets and no other test reached (issue 47): a chunked body
over the size limit, the last logprobs count OpenAI allows and the first it refuses, a stop
token's text kept out of a streamed answer, and the admission queue's exact bound."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from typing import Iterator

import pytest
import requests
from ray import serve

from deployments import build_app
from deployments.routing.admission import AdmissionGate
from deployments.ingress.body_limit import MAX_REQUEST_BODY_BYTES
from nvray.sampling_params import MAX_LOGPROBS
from serve_helpers import greedy

PROMPT = "Scoring the engine's prompt"


def _chunks(total: int, size: int = 2**20) -> Iterator[bytes]:
    """``total`` bytes in pieces: requests sends a generator chunked, with no Content-Length."""
    for start in range(0, total, size):
        yield b"x" * min(size, total - start)


def test_a_chunked_body_over_the_limit_is_refused_with_413(base_url):
    resp = requests.post(f"{base_url}/v1/completions", data=_chunks(MAX_REQUEST_BODY_BYTES + 1),
                         headers={"Content-Type": "application/json"}, timeout=120)
    assert resp.request.headers.get("Transfer-Encoding") == "chunked"
    assert "Content-Length" not in resp.request.headers
    assert resp.status_code == 413, resp.text[:500]
    assert resp.json()["error"]["code"] == "request_too_large"


def test_a_chunked_body_under_the_limit_is_read(base_url):
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
    resp = requests.post(f"{base_url}/v1/completions", data=iter([body[:5], body[5:]]),
                         headers={"Content-Type": "application/json"}, timeout=120)
    assert resp.request.headers.get("Transfer-Encoding") == "chunked"
    assert resp.status_code == 200, resp.text[:500]


def test_chat_top_logprobs_at_openais_maximum_is_served(client, offline):
    assert MAX_LOGPROBS == 20  # OpenAI's documented maximum, whatever the code says
    resp = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=20, extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == 3
    want = offline.chat([{"role": "user", "content": PROMPT}], greedy(3, logprobs=20),
                        use_tqdm=False)[0]
    for entry, x in zip(content, want.logprobs):
        assert len(entry.top_logprobs) == 20
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(x.top_logprobs, abs=1e-4)


def test_chat_top_logprobs_above_openais_maximum_is_a_400_naming_it(base_url):
    resp = requests.post(f"{base_url}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "logprobs": True, "top_logprobs": 21})
    assert resp.status_code == 400, resp.text[:500]
    error = resp.json()["error"]
    assert error["param"] == "top_logprobs" and "21" in error["message"]


@pytest.mark.parametrize("logprobs,status", [(20, 200), (21, 400)])
def test_completion_logprobs_bound_is_openais(base_url, offline, logprobs, status):
    resp = requests.post(f"{base_url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0,
        "ignore_eos": True, "logprobs": logprobs})
    assert resp.status_code == status, resp.text[:500]
    if status == 400:
        assert resp.json()["error"]["param"] == "logprobs"
        return
    want = offline.generate(PROMPT, greedy(2, logprobs=20), use_tqdm=False)[0]
    tops = resp.json()["choices"][0]["logprobs"]["top_logprobs"]
    assert len(tops) == 2
    for top, x, token in zip(tops, want.logprobs, want.token_ids):  # keyed by text: 20 or fewer
        assert len(x.top_ids) == 20
        texts = {offline.tokenizer.decode([i]) for i in [*x.top_ids, token]}
        assert set(top) == texts


def _streamed_text(resp: requests.Response) -> str:
    text = ""
    for line in resp.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            choices = json.loads(line[6:])["choices"]
            text += "".join(c["text"] for c in choices)
    return text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_stop_token_ids_text_is_not_in_the_answer(base_url, offline, stream):
    """The stop token id ends the answer; its text is not in it (vLLM's semantics)."""
    ids = offline.generate(PROMPT, greedy(16), use_tqdm=False)[0].token_ids
    texts = [offline.tokenizer.decode(ids[:k], skip_special_tokens=True)
             for k in range(len(ids) + 1)]
    # the first token after two that is not among those before it and adds whole characters
    k = next(k for k in range(2, len(ids)) if ids[k] not in ids[:k]
             and texts[k + 1].startswith(texts[k]) and len(texts[k + 1]) > len(texts[k])
             and "\ufffd" not in texts[k + 1][len(texts[k]):])
    before = offline.generate(PROMPT, greedy(k), use_tqdm=False)[0].text  # the text up to it
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0,
            "stop_token_ids": [ids[k]], "stream": stream}
    resp = requests.post(f"{base_url}/v1/completions", json=body, timeout=60, stream=stream)
    assert resp.status_code == 200, resp.text[:500]
    text = _streamed_text(resp) if stream else resp.json()["choices"][0]["text"]
    assert text == before


def test_exactly_max_queued_requests_wait_and_one_more_is_refused(serve_http):
    """One request runs (max_ongoing_requests 1), two wait (max_queued_requests 2): both are
    served once it ends; a third waiter is refused at once with a 503."""
    serve.run(build_app({"max_model_len": 2048, "max_ongoing_requests": 1,
                         "max_queued_requests": 2, "num_cpus_per_rank": 1}),
              name="edge-gate", route_prefix="/edge-gate")
    url = f"{serve_http}/edge-gate/v1/completions"
    body = {"model": "tiny", "prompt": "queue", "max_tokens": 4, "ignore_eos": True}
    try:
        assert requests.post(url, json=body, timeout=120).status_code == 200  # the engine is up
        with requests.post(url, stream=True, timeout=120, json={  # holds the slot ~15 s
                **body, "max_tokens": 1900, "stream": True}) as running:
            assert running.status_code == 200
            lines = running.iter_lines()  # kept: a dropped iterator closes the connection
            assert next(lines).startswith(b"data: ")  # it runs, holding the one slot
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                waiting = [pool.submit(requests.post, url, json=body, timeout=120)
                           for _ in range(2)]
                time.sleep(2.0)  # both reach the replica's gate and wait there
                assert not any(f.done() for f in waiting), [
                    (f.result().status_code, f.result().text[:300]) for f in waiting if f.done()]
                start = time.monotonic()
                refused = requests.post(url, json=body, timeout=120)
                assert refused.status_code == 503, refused.text[:500]
                assert time.monotonic() - start < 5.0  # at once, not after waiting
                assert refused.json()["error"]["code"] == "engine_overloaded"
                running.close()  # the client leaves: its slot goes to the waiters
                assert [f.result().status_code for f in waiting] == [200, 200]
    finally:
        serve.delete("edge-gate")


async def _fill_the_gate(max_waiting: int) -> tuple[list[str], str]:
    """One request runs, then ``max_waiting + 1`` more arrive: what each of those sees at once
    ("waits" or its HTTP status), and what the waiters see once the slot is given back."""
    gate = AdmissionGate(max_running=1, max_waiting=max_waiting)
    ticket = await gate.enter(timeout_s=5)
    arrivals = [asyncio.create_task(gate.enter(timeout_s=5)) for _ in range(max_waiting + 1)]
    await asyncio.sleep(0)
    seen = [str(t.exception().response().status_code) if t.done() else "waits"
            for t in arrivals]
    for task in arrivals:
        if not task.done():
            ticket.release()
            ticket = await asyncio.wait_for(task, 5)
    ticket.release()
    return seen, "served" if gate.num_running == gate.num_waiting == 0 else "stuck"


@pytest.mark.parametrize("max_waiting", [1, 3])
def test_the_gate_queues_exactly_max_waiting_and_refuses_the_next(max_waiting):
    assert asyncio.run(_fill_the_gate(max_waiting)) == (["waits"] * max_waiting + ["503"],
                                                        "served")
