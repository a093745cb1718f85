"""PrefixIndex: one prefix-routed app's table of which engine replica holds which prompt
prefix, shared by all of its ingress replicas (one small named actor per app).

Serve's proxy spreads HTTP requests over the ingress replicas at random, so a conversation's
turns reach different ingresses; each ingress's router asks this index, not only what it saw
itself, where the conversation's history went. The index also counts the routers' decisions
for ``/metrics``. It is created by the first router that needs it and owned by that router's
process (it goes when that ingress replica goes, and the next router to need one creates it
again: routing then starts from an empty table, never fails). Lookups and records are a dict
walk over the prompt's block hashes: microseconds.
"""

from __future__ import annotations

from typing import Any

import ray

from deployments.routing.prefix_table import TABLE_SIZE, PrefixTable

_NAMESPACE = "serve"


class PrefixIndex:
    def __init__(self, capacity: int = TABLE_SIZE) -> None:
        self.table = PrefixTable(capacity)
        self.counts = {"prefix": 0, "load": 0}

    def holders(self, hashes: list[int], live: list[str]) -> list[str]:
        return self.table.longest_holders(hashes, set(live))

    def record(self, hashes: list[int], replica: str, by: str | None) -> None:
        self.table.record(hashes, replica)
        if by is not None:
            self.counts[by] += 1

    def routing_counts(self) -> dict[str, int]:
        return dict(self.counts)


def index_name(app_name: str) -> str:
    return f"nvray-prefix-index:{app_name}"


def get_or_create_index(app_name: str) -> Any:
    return ray.remote(PrefixIndex).options(
        name=index_name(app_name), namespace=_NAMESPACE, get_if_exists=True, num_cpus=0,
        max_restarts=0).remote()


async def routing_counts(app_name: str) -> dict[str, int]:
    """The app's routing decisions so far (zeros if its index has gone with its owner)."""
    try:
        return await get_or_create_index(app_name).routing_counts.remote()
    except Exception:  # noqa: BLE001 - the index's owner went just now: nothing to report
        return {"prefix": 0, "load": 0}
