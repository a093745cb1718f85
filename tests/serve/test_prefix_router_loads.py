"""The prefix router's choice against stale loads (``deployments/routing/prefix_router.py``):
Serve's cached queue lengths still count a burst's requests after they ended, so wherever
affinity turns on the other replicas' loads the router asks the replicas. The router runs here as Serve
builds it, over replicas that report their loads, deciding from its own table (no shared index)."""

from __future__ import annotations

import asyncio

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

import deployments.routing.prefix_router as prefix_router
from deployments.routing.prefix_router import PrefixAwareRouter

IMBALANCE = 4
APP = DeploymentID(name="NvrayEngine", app_name="routed")


class Replica:
    """An engine replica as the router sees it: an id and the load it reports when asked."""

    def __init__(self, name: str, load: int) -> None:
        self.replica_id = ReplicaID(unique_id=name, deployment_id=APP)
        self.load = load

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.load


class Request:
    def __init__(self, key: str) -> None:
        self.kwargs = {"routing_key": key}
        self.metadata = type("Metadata", (), {"internal_request_id": None})()


@pytest.fixture
def router(monkeypatch):
    monkeypatch.setattr(prefix_router, "get_or_create_index", lambda app: None)  # no shared index
    r = PrefixAwareRouter(deployment_id=APP, handle_source=DeploymentHandleSource.REPLICA,
                          use_replica_queue_len_cache=True)
    r.initialize_state(block_chars=8, max_load_imbalance=IMBALANCE)
    return r


def choose(router: PrefixAwareRouter, replicas: list[Replica], key: str) -> str:
    ranked = asyncio.run(router.choose_replicas(replicas, Request(key)))
    return ranked[0][0].replica_id.unique_id


KEY = "a hot prefix that one replica took first " * 2


def test_a_hot_prefix_spreads_to_a_replica_whose_cached_load_is_stale(router):
    replicas = {"a": Replica("a", 0), "b": Replica("b", 0)}
    first = choose(router, list(replicas.values()), KEY)
    second = "b" if first == "a" else "a"
    # the holder at its real load; the cache still counts a burst that ended on the other
    replicas[first].load = IMBALANCE + 3
    for replica in replicas.values():
        router.replica_queue_len_cache.update(replica.replica_id, IMBALANCE + 3)
    assert choose(router, list(replicas.values()), KEY) == second


def test_affinity_holds_while_the_holder_is_within_the_bound(router):
    replicas = {"a": Replica("a", 0), "b": Replica("b", 0)}
    first = choose(router, list(replicas.values()), KEY)
    replicas[first].load = IMBALANCE
    router.replica_queue_len_cache.update(replicas[first].replica_id, IMBALANCE)
    assert all(choose(router, list(replicas.values()), KEY) == first for _ in range(5))


def test_affinity_holds_when_the_others_really_are_loaded(router):
    replicas = {"a": Replica("a", 0), "b": Replica("b", 0)}
    first = choose(router, list(replicas.values()), KEY)
    second = "b" if first == "a" else "a"
    replicas[first].load, replicas[second].load = IMBALANCE + 3, 4
    for replica in replicas.values():
        router.replica_queue_len_cache.update(replica.replica_id, replica.load)
    assert choose(router, list(replicas.values()), KEY) == first
