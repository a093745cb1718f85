"""Prefix-aware routing: two apps of two engine replicas each, one with nvray's PrefixAwareRouter
(``prefix_routing``: two ingress replicas, sharing one prefix index, lease an engine per
request) and one with Serve's default router in front of the same engines. Conversations whose every turn resends the history hit the
prefix cache more through the prefix router than through the default one, in the same test;
its decisions show in ``/metrics``; a skewed load (one hot prompt, many at once) still reaches
both engines; handle calls are routed too; and a request cancelled while its engine's output
channel was opened for it ends no other request. The apps serve LoRA adapters from a
``lora_path``: requests for one adapter land on the engine that loaded it (adapter affinity,
from the engines' ``nvray_lora_*`` metrics), and a burst of them spreads to both.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time

import pytest
import ray
import requests
from ray import serve

from deployments import build_app
from serve_helpers import greedy

MAX_MODEL_LEN = 1024
CONVERSATIONS, TURNS = 6, 4
HOT_CLIENTS = 16
IMBALANCE = 4  # ongoing requests above the least-loaded engine that affinity may add
HOLD_S = 180  # a held stream waits at most this for the rest to start (they get 120 s)
BURST_TOKENS = MAX_MODEL_LEN - 128  # a burst's answers: as long as its prompt leaves room for


def app_args(prefix_routing: bool, lora_path: str) -> dict:
    return {"max_model_len": MAX_MODEL_LEN, "min_replicas": 2, "max_replicas": 2,
            "prefix_routing": prefix_routing, "prefix_routing_max_imbalance": IMBALANCE,
            "lora_path": lora_path}


@pytest.fixture(scope="module")
def apps(serve_http, tmp_path_factory, tiny_path):
    """``/on``: prefix-routed; ``/off``: Serve's default router (both 2 engine replicas)."""
    from lora_adapters import ATTENTION, write_adapter

    loras = tmp_path_factory.mktemp("routed-loras")
    for seed, name in enumerate(("ad-a", "ad-b")):
        write_adapter(tiny_path, str(loras / name), 4, ATTENTION, seed=seed + 61)
    serve.run(build_app(app_args(True, str(loras))), name="prefix-on", route_prefix="/on")
    serve.run(build_app(app_args(False, str(loras))), name="prefix-off", route_prefix="/off")
    yield {"on": f"{serve_http}/on", "off": f"{serve_http}/off"}
    serve.delete("prefix-on")
    serve.delete("prefix-off")


def counter(url: str, name: str, reads: int = 1, **labels: str) -> dict[str, float]:
    """A /metrics family's samples whose labels include ``labels``: {label text: value}.
    Each ingress replica lists the engines it has leased from, so with ``reads`` > 1 the
    answers of several reads (whichever replicas answer) are merged."""
    found: dict[str, float] = {}
    for _ in range(reads):
        text = requests.get(f"{url}/metrics", timeout=30).text
        for label_text, value in re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M):
            if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
                found[label_text] = max(found.get(label_text, 0.0), float(value))
    return found


def stream_until_cut(url: str, body: dict, cut_after: int | None,
                     hold: threading.Event | None = None, started: threading.Event | None = None
                     ) -> int:
    """Stream a completion; with ``cut_after``, leave after that many SSE events (once ``hold``
    is set, if given; ``started`` is set when they have arrived). Returns the events read."""
    events = 0
    with requests.post(f"{url}/v1/completions", json={**body, "stream": True}, stream=True,
                       timeout=120) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                events += 1
                if cut_after is not None and events >= cut_after:
                    if started is not None:
                        started.set()
                    if hold is not None:
                        hold.wait(timeout=HOLD_S)
                    break
    return events


def test_a_cancelled_first_request_ends_no_other(apps, offline):
    """The ingress opens its channel to an engine inside its first request there; when that
    request is cancelled (its client leaves) while another runs on the same engine, the other
    must still get its whole answer."""
    prompt = "A long shared prefix that pins both requests to one engine by its affinity. " * 2
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 400, "temperature": 0,
            "ignore_eos": True}
    expected = offline.generate([prompt], greedy(400), use_tqdm=False)[0].text
    survivor: dict = {}

    def full() -> None:
        r = requests.post(f"{apps['on']}/v1/completions", json=body, timeout=120)
        survivor["status"], survivor["body"] = r.status_code, r.json()

    opened, leave = threading.Event(), threading.Event()
    first = threading.Thread(target=stream_until_cut, args=(apps["on"], body, 2, leave, opened))
    first.start()  # the first request to the app: it opens the channel to its engine
    assert opened.wait(timeout=120)
    other = threading.Thread(target=full)
    other.start()
    time.sleep(1.0)  # the other request runs on the same engine (prefix affinity)
    leave.set()  # the first client leaves: its request is cancelled
    first.join(timeout=120)
    other.join(timeout=120)
    assert survivor["status"] == 200, survivor
    assert survivor["body"]["choices"][0]["text"] == expected


def converse(url: str) -> tuple[int, int]:
    """CONVERSATIONS chats of TURNS turns, turn by turn across them (each turn resends its
    history); returns (cached prompt tokens, prompt tokens) over all turns."""
    histories = [[{"role": "user", "content": f"Conversation {c}: let us talk at length about "
                                              f"paged KV caches, block tables and topic {c}."}]
                 for c in range(CONVERSATIONS)]
    cached = prompt = 0
    for _ in range(TURNS):
        for history in histories:
            r = requests.post(f"{url}/v1/chat/completions", timeout=120, json={
                "model": "tiny", "messages": history, "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            body = r.json()
            cached += body["usage"]["prompt_tokens_details"]["cached_tokens"]
            prompt += body["usage"]["prompt_tokens"]
            history += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                        {"role": "user", "content": "Go on, and tell me more."}]
    return cached, prompt


def routed(url: str) -> dict[str, float]:
    """The ingress's routing decisions so far: {"prefix": n, "load": m}."""
    return {by: sum(counter(url, "nvray_router_requests_total", by=by).values())
            for by in ("prefix", "load")}


def test_conversations_hit_the_cache_more_with_the_prefix_router(apps):
    before = routed(apps["on"])
    on_cached, on_prompt = converse(apps["on"])
    off_cached, off_prompt = converse(apps["off"])
    assert on_prompt == off_prompt  # the same conversations, token for token
    assert on_cached > off_cached
    # a conversation's first turn went by load, every later one where its history was
    after = routed(apps["on"])
    assert after["load"] - before["load"] == CONVERSATIONS
    assert after["prefix"] - before["prefix"] == CONVERSATIONS * (TURNS - 1)


def burst(url: str, body: dict) -> None:
    """HOT_CLIENTS streams of ``body`` all in flight at once: each holds its connection after
    its first event until every one has started, then the clients leave (cancelling their
    requests). Each asks for BURST_TOKENS, so none can end while the others are still starting
    however slow the machine (16 streams took 4 s to start on an idle 2-core machine, a
    400-token answer about as long).

    Read /metrics after the burst, not during it: an ingress lists only the engines it has
    leased from, and while the streams are held Serve's proxy (the shorter queue of two) sends
    every /metrics request to the ingress holding fewer of them, which may never have leased
    the second engine: CI once saw one engine so."""
    hold, started = threading.Event(), [threading.Event() for _ in range(HOT_CLIENTS)]
    failures: list[BaseException] = []

    def client(event: threading.Event) -> None:
        try:
            stream_until_cut(url, body, 1, hold, event)
        except BaseException as e:  # noqa: BLE001 - reported by the test's thread below
            failures.append(e)
            event.set()

    threads = [threading.Thread(target=client, args=(event,)) for event in started]
    for t in threads:
        t.start()
    try:
        assert all(event.wait(timeout=120) for event in started), "a stream never started"
        assert not failures, failures
    finally:
        hold.set()
        for t in threads:
            t.join(timeout=120)
    assert not failures and not any(t.is_alive() for t in threads), failures


def test_a_hot_prompt_still_reaches_both_engines(apps):
    """Many requests for one prompt at once: affinity yields to load past the imbalance bound."""
    accepted = counter(apps["on"], "nvray_requests_accepted_total", reads=16)
    load_before = routed(apps["on"])["load"]
    body = {"model": "tiny", "prompt": "One hot prompt that every client sends at once, " * 3,
            "max_tokens": BURST_TOKENS, "temperature": 0, "ignore_eos": True}
    burst(apps["on"], body)
    took = wait_for_metric(lambda: _changes(apps["on"], "nvray_requests_accepted_total", accepted),
                           lambda v: len(v) == 2 and sum(v.values()) >= HOT_CLIENTS)
    assert len(took) == 2 and min(took.values()) > 0, took  # both engines took some
    assert sum(took.values()) == HOT_CLIENTS
    assert routed(apps["on"])["load"] > load_before


def _changes(url: str, name: str, before: dict[str, float], **labels: str) -> dict[str, float]:
    after = counter(url, name, reads=16, **labels)
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def wait_for_metric(read, done, timeout_s: float = 30.0):  # noqa: ANN001, ANN201
    """``read()`` again until ``done(value)`` or the deadline; the last value. The ingress's
    /metrics shows an engine's adapters and loads as of its latest stats, a moment behind."""
    deadline = time.monotonic() + timeout_s
    value = read()
    while not done(value) and time.monotonic() < deadline:
        time.sleep(0.5)
        value = read()
    return value


def test_requests_for_an_adapter_go_where_it_is_loaded_and_a_burst_spreads(apps):
    url = apps["on"]
    loads = counter(url, "nvray_lora_loads_total", reads=16)
    for i in range(6):  # different prompts: only the adapter's block is shared
        body = {"model": "ad-a", "prompt": f"{i} question number {i * 37} on topic {i * i}",
                "max_tokens": 4, "temperature": 0}
        r = requests.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200 and r.json()["model"] == "ad-a", r.text
    loaded = wait_for_metric(lambda: _changes(url, "nvray_lora_loads_total", loads),
                             lambda v: sum(v.values()) >= 1)
    assert sum(loaded.values()) == 1, loaded  # one engine loaded it, once
    resident = wait_for_metric(lambda: counter(url, "nvray_lora_resident", reads=16,
                                               adapter="ad-a"), lambda v: len(v) >= 1)
    assert len(resident) == 1, resident
    # a burst all in flight at once (each stream holds its connection after its first event
    # until every one has started): the engine that loaded the adapter runs past the
    # imbalance bound, so the burst spreads and the other engine loads it too
    body = {"model": "ad-b", "prompt": "a hot adapter's many requests at once",
            "max_tokens": BURST_TOKENS, "temperature": 0, "ignore_eos": True}
    burst(url, body)
    resident = wait_for_metric(lambda: counter(url, "nvray_lora_resident", reads=16,
                                               adapter="ad-b"), lambda v: len(v) >= 2)
    assert len(resident) == 2, resident


def test_handle_calls_are_routed_by_prefix(apps):
    handle = serve.get_app_handle("prefix-on")
    before = routed(apps["on"])["prefix"]
    prompt = "A handle caller's long prompt about Ray Serve request routers and caches. " * 2
    first = handle.generate.remote(prompt, greedy(8)).result(timeout_s=120)
    again = handle.generate.remote(prompt + first.text, greedy(8)).result(timeout_s=120)
    assert again.num_cached_tokens > 0  # the second call found the first one's blocks
    assert routed(apps["on"])["prefix"] == before + 1


@ray.remote(num_cpus=0)
class LeaseHolder:
    """Another caller of the prefix-routed engines, in a process (and request router) of its
    own: it holds engine leases, as an ingress does for the requests it serves."""

    def __init__(self, app: str) -> None:
        self.handle = serve.get_deployment_handle("NvrayEngine", app_name=app)
        self.calls: list = []

    async def hold(self, routing_key: str, n: int) -> list[str]:
        """Leases ``n`` engine slots, one at a time; returns the engine id of each."""
        engines = []
        for _ in range(n):
            call = self.handle.options(stream=True).lease.remote(routing_key=routing_key)
            engine_id, _ = await call.__anext__()
            self.calls.append(call)
            engines.append(engine_id)
        return engines

    async def release(self) -> None:
        """Ends every held lease and waits until each call has ended."""
        for call in self.calls:
            call.cancel()
        for call in self.calls:
            with contextlib.suppress(Exception):  # the cancellation, as the call's end
                await call.__anext__()
        self.calls.clear()


def lease_once(handle, routing_key: str) -> str:
    """One lease through ``handle`` (this process's request router), ended at once: its engine."""
    call = handle.options(stream=True).lease.remote(routing_key=routing_key)
    engine_id, _ = next(call)
    call.cancel()
    return engine_id


def test_affinity_outlives_another_callers_ended_requests(apps):
    """A router's cached load of an engine is the engine's whole count when the router last
    sent there, less the router's own requests that ended since: another caller's requests
    that end stay counted (until the cache ages out, 10 s). Affinity must not be given up on
    them: the next request for a conversation still goes to the engine that holds it."""
    key = "A conversation's history, held by one engine and leased by two callers. " * 2
    mine = serve.get_deployment_handle("NvrayEngine", app_name="prefix-on")
    home = lease_once(mine, key)  # the first request: by load; this router now knows the engine
    other = LeaseHolder.remote("prefix-on")
    try:
        held = ray.get(other.hold.remote(key, IMBALANCE + 1), timeout=60)
        assert held == [home] * (IMBALANCE + 1)  # affinity, up to the imbalance bound
        assert lease_once(mine, key) == home  # its cache still had the engine idle: it counts
        ray.get(other.release.remote(), timeout=60)  # ... the other's requests, now ended
        assert lease_once(mine, key) == home
    finally:
        ray.kill(other)


def test_responses_continue_through_either_ingress(apps):
    """``/v1/responses`` keeps an app's responses in one store that its replicas share: a chain
    of responses, each continuing the last, whose requests Serve's proxy spreads over both
    ingress replicas at random, replays the whole conversation every turn (its input tokens
    are ``/tokenize``'s count of the conversation so far)."""
    import openai

    client = openai.OpenAI(base_url=f"{apps['on']}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    previous, history = None, []
    for turn in range(6):
        history.append({"role": "user", "content": f"turn {turn}"})
        response = client.responses.create(model="tiny", input=f"turn {turn}",
                                           previous_response_id=previous, temperature=0,
                                           max_output_tokens=4)
        counted = requests.post(f"{apps['on']}/tokenize", json={"messages": history},
                                timeout=60).json()["count"]
        assert response.usage.input_tokens == counted, turn
        history.append({"role": "assistant", "content": response.output_text})
        previous = response.id


def test_without_prefix_routing_each_replicas_engine_has_its_own_series(apps):
    """Serve's proxy sends each /metrics read to one replica: with an engine label, two
    replicas' counters are two series (never one series jumping between two engines)."""
    healthy = counter(apps["off"], "nvray_engine_healthy", reads=16)
    engines = {re.search(r'engine="([^"]+)"', labels).group(1) for labels in healthy
               if 'engine="' in labels}
    assert len(healthy) == 2 and len(engines) == 2, healthy
