"""Two Ray nodes on this machine (the session's ``two_nodes``: ``ray start --head`` on 127.0.0.1,
``ray start --address`` on 127.0.0.2, 2 CPUs each): a TP=2 engine and a PP=2 engine whose
placement groups put one rank on each node give the greedy outputs of TP=1; a Serve app under a bounded burst
scales from one engine replica to two, the second on the other node (one 1.1-CPU engine is all
a node can hold beside another), every request succeeds, and it scales back down afterwards.

Each driver is its own Python process connected to that cluster (``Cluster.run_driver``); the
test process talks to the app over HTTP on 127.0.0.1 only.
"""

from __future__ import annotations

import threading
import time

import pytest
import requests

from ray_nodes import SECOND_NODE_IP, Cluster, free_ports

PROMPTS = ["Hello, nvray", "The quick brown fox jumps over the lazy dog.",
           "Ray is a unified framework for scaling AI", "def main(): print('hello, world')"]
MAX_TOKENS, MAX_MODEL_LEN = 12, 128
APP = "two-nodes"
SCALE_DEADLINE_S, SERVE_DEADLINE_S = 240, 120
# the burst lasts until the test stops it, at most through both waits: clients that ran out
# of requests while the second replica was still starting would leave it nothing to serve
BURST_CLIENTS, BURST_MAX_REQUESTS_EACH = 6, 600
BURST_S = SCALE_DEADLINE_S + SERVE_DEADLINE_S + 30


@pytest.fixture(scope="module")
def tp1_greedy() -> list[str]:
    from nvray import LLM, SamplingParams

    llm = LLM("tiny", runtime="inprocess", max_model_len=MAX_MODEL_LEN)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                    ignore_eos=True), use_tqdm=False)
        return [o.text for o in outs]
    finally:
        llm.shutdown()


def spread_driver(sizes: dict[str, int]) -> str:
    return f"""
import json, ray
from ray.util.state import list_actors
from nvray import LLM, SamplingParams

llm = LLM("tiny", placement_strategy="STRICT_SPREAD", max_model_len={MAX_MODEL_LEN}, **{sizes!r})
outs = llm.generate({PROMPTS!r}, SamplingParams(temperature=0.0, max_tokens={MAX_TOKENS},
                                                ignore_eos=True), use_tqdm=False)
ips = {{n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}}
ranks = list_actors(filters=[("class_name", "=", "RankWorker"), ("state", "=", "ALIVE")])
print(json.dumps({{"texts": [o.text for o in outs],
                  "rank_nodes": sorted(ips[a.node_id] for a in ranks)}}))
llm.shutdown()
"""


@pytest.mark.parametrize("sizes", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
                         ids=["tp2", "pp2"])
def test_an_engine_spread_over_two_nodes_matches_tp1(two_nodes: Cluster, tp1_greedy, sizes):
    """TP=2 (all-reduces between the nodes) or PP=2 (a stage per node, activations sent
    from one to the other)."""
    result = two_nodes.run_driver(spread_driver(sizes), timeout=300)
    assert result["rank_nodes"] == ["127.0.0.1", SECOND_NODE_IP]  # one rank on each node
    assert result["texts"] == tp1_greedy


# --------------------------------------------------------------------------------- Serve
def deploy_driver(port: int) -> str:
    args = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2,
            "upscale_delay_s": 1, "downscale_delay_s": 5, "max_model_len": MAX_MODEL_LEN}
    return f"""
import json
from ray import serve
from deployments import build_app

serve.start(http_options={{"host": "127.0.0.1", "port": {port}}}, proxy_location="HeadOnly")
serve.run(build_app({args!r}), name="{APP}", route_prefix="/", blocking=False)
print(json.dumps("deployed"))
"""


SHUTDOWN_DRIVER = """
import json
from ray import serve
serve.shutdown()
print(json.dumps("down"))
"""


def engine_replica_nodes(cluster: Cluster) -> list[str]:
    """Node IPs of the app's live engines (one EngineDriver per engine replica)."""
    ips = cluster.node_ips()
    return sorted(ips.get(a["node_id"], "?") for a in cluster.live_actors()
                  if a["class_name"] == "EngineDriver")


def wait_for(condition, deadline_s: float, what: str, *, poll_s: float = 1.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(poll_s)


class Burst:
    """Clients sending completions until stopped (each at most ``max_each``, for at most
    ``duration_s``)."""

    def __init__(self, url: str, clients: int, max_each: int, duration_s: float) -> None:
        self.url, self.stop = url, threading.Event()
        self.until = time.monotonic() + duration_s
        self.statuses: list[int] = []
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._client, args=(i, max_each), daemon=True)
                        for i in range(clients)]

    def _client(self, i: int, max_each: int) -> None:
        for j in range(max_each):
            if self.stop.is_set() or time.monotonic() > self.until:
                return
            body = {"model": "tiny", "prompt": f"client {i} request {j}: {PROMPTS[j % 4]}",
                    "max_tokens": 48, "temperature": 0, "ignore_eos": True}
            try:
                r = requests.post(f"{self.url}/v1/completions", json=body, timeout=120)
                self.statuses.append(r.status_code)
                if r.status_code != 200:
                    self.errors.append(r.text[:300])
            except requests.RequestException as e:
                self.statuses.append(0)
                self.errors.append(repr(e))

    def __enter__(self) -> "Burst":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=180)


def test_the_app_scales_to_the_second_node_and_back(two_nodes: Cluster):
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    two_nodes.run_driver(deploy_driver(port), timeout=240)
    try:
        wait_for(lambda: _healthy(url), 180, "the app never became healthy")
        assert len(engine_replica_nodes(two_nodes)) == 1
        with Burst(url, BURST_CLIENTS, BURST_MAX_REQUESTS_EACH, BURST_S) as burst:
            wait_for(lambda: len(set(engine_replica_nodes(two_nodes))) == 2 or burst.stop.is_set(),
                     SCALE_DEADLINE_S, "the app did not scale to a second replica", poll_s=2)
            nodes = engine_replica_nodes(two_nodes)
            served_before = len(burst.statuses)
            # the second engine takes requests too before the burst ends
            wait_for(lambda: len(burst.statuses) >= served_before + 2 * BURST_CLIENTS,
                     SERVE_DEADLINE_S, "no requests completed after the second replica started")
        assert nodes == ["127.0.0.1", SECOND_NODE_IP]  # one engine per node
        assert burst.errors == [] and set(burst.statuses) == {200}, burst.errors[:3]
        wait_for(lambda: len(engine_replica_nodes(two_nodes)) == 1, SCALE_DEADLINE_S,
                 "the app did not scale back down", poll_s=2)
        assert _healthy(url)
    finally:
        two_nodes.run_driver(SHUTDOWN_DRIVER, timeout=120)


def _healthy(url: str) -> bool:
    try:
        return requests.get(f"{url}/health", timeout=10).status_code == 200
    except requests.RequestException:
        return False


def test_serve_is_gone_after_shutdown(two_nodes: Cluster):
    """The app's engines left nothing behind on either node."""
    wait_for(lambda: not [a for a in two_nodes.live_actors()
                          if a["class_name"] in ("EngineDriver", "RankWorker")], 60,
             "engine actors outlived the app")
    assert sorted(two_nodes.node_ips().values()) == ["127.0.0.1", SECOND_NODE_IP]
