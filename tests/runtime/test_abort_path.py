"""The consumer side's abort path on a real Ray engine (TP=1): a reader that leaves a stream
early and a sink aborted while some of its requests run end exactly those requests, as
'abort', while they still had tokens to generate; finished requests are not touched; every
choice of an ``n > 1`` request ends; an aborted id is free again once the engine has ended
the request (and a request reusing it gets its own outputs); no KV block stays held."""

from __future__ import annotations

import time

import pytest

from nvray import EngineConfig
from nvray.runtime import start_engine
from nvray.request import EngineRequest

LONG = {"max_tokens": 400, "ignore_eos": True}  # far more than any test reads
SETTLE_S = 30


@pytest.fixture(scope="module")
def client(ray_cluster, tiny_path):
    client = start_engine(EngineConfig(model="tiny", max_model_len=512, device="cpu"))
    yield client
    client.shutdown()


def finished(client) -> dict[str, int]:
    counts = client.stats()["num_finished"]
    return {reason: counts.get(reason, 0) for reason in ("abort", "length", "stop")}


def wait_idle(client) -> None:
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        stats = client.stats()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0:
            assert stats["kv_cache_usage"] == 0.0
            return
        time.sleep(0.05)
    raise AssertionError("the engine still runs requests that were aborted")


def ended_since(client, before: dict[str, int]) -> dict[str, int]:
    wait_idle(client)
    after = finished(client)
    return {reason: after[reason] - before[reason] for reason in after}


def reuse_when_free(client, request_id: str):
    """A one-token request under ``request_id``, sent again while the id is still in use."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        try:
            return client.generate("reuse", {"max_tokens": 1, "ignore_eos": True},
                                   request_id=request_id)
        except ValueError as e:
            assert "already in use" in str(e) and time.monotonic() < deadline, e
            time.sleep(0.01)


def test_a_reader_that_leaves_a_stream_early_aborts_its_request(client):
    before = finished(client)
    stream = client.stream("leave me early", LONG, request_id="left-early")
    first = next(stream)
    assert not first.finished
    stream.close()  # the reader goes away: the sink aborts what still runs
    assert ended_since(client, before) == {"abort": 1, "length": 0, "stop": 0}
    assert reuse_when_free(client, "left-early").finish_reason == "length"


def test_aborting_a_sink_ends_only_its_unfinished_requests(client):
    """A sink whose first request finished is aborted: its two running requests (three
    choices) end as aborted; the finished request's id, meanwhile reused by another caller, is
    not aborted; an aborted id, reused as soon as the router takes it, gets its own output."""
    before = finished(client)
    sink = client.submit([EngineRequest("short one", {"max_tokens": 1, "ignore_eos": True}, "short"),
                          EngineRequest("long one", {**LONG, "n": 2}, "long-pair"),
                          EngineRequest("long two", LONG, "long-single")], stream=True)
    deadline = time.monotonic() + SETTLE_S
    while sink.sink.finals[0] is None:  # the short one has finished
        assert time.monotonic() < deadline, "the one-token request never finished"
        sink.next_batch(timeout=SETTLE_S)
    reused = client.submit([EngineRequest("the id again", {"max_tokens": 8, "ignore_eos": True},
                                    "short")])
    sink.abort()
    again = reuse_when_free(client, "long-single")
    assert again.finish_reason == "length" and len(again.token_ids) == 1
    [other] = reused.results(timeout=SETTLE_S)
    assert other.finish_reason == "length" and len(other.token_ids) == 8
    assert ended_since(client, before) == {"abort": 3, "length": 3, "stop": 0}
    # nobody reads an aborted sink: the engine's abort outputs were dropped, not queued
    assert not [out for _, out in sink.next_batch(timeout=SETTLE_S) if out.finished]


def test_concurrent_callers_share_add_calls_and_each_gets_its_own_output(client):
    """Callers of one consumer who add at the same moment: their adds leave in fewer driver
    calls than requests (one in flight at a time), and each caller gets its own prompt's
    greedy tokens (those of the same prompt run alone)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    params = {"max_tokens": 6, "ignore_eos": True, "temperature": 0.0}
    prompts = [f"caller {k} says {'hello ' * (k % 4)}" for k in range(24)]
    alone = {p: client.generate(p, params).token_ids for p in prompts[:6]}
    calls_before = client.stats()["add_requests_calls"]
    start = threading.Barrier(len(prompts))

    def call(prompt: str) -> list[int]:
        start.wait(timeout=SETTLE_S)
        return client.generate(prompt, params).token_ids

    with ThreadPoolExecutor(len(prompts)) as pool:
        together = dict(zip(prompts, pool.map(call, prompts)))
    calls = client.stats()["add_requests_calls"] - calls_before
    assert calls < len(prompts)
    assert {p: together[p] for p in alone} == alone
    assert all(len(tokens) == 6 for tokens in together.values())
