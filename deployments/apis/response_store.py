"""Where ``/v1/responses`` keeps stored responses: one Ray actor per app, which every replica of
the app reaches by name, so that a response created through one replica is continued
(``previous_response_id``), read (``GET``) or deleted through any other.

The store is a named, detached actor (``nvray-responses:<app>`` in the ``nvray`` namespace,
no CPU reserved): it outlives the replica that created it (autoscaling removes replicas) and a
redeploy of the app, until ``ray stop`` or ``ray.kill``. It holds at most ``capacity``
records (the app arg ``responses_stored``), dropping the least recently used one beyond that;
a record is the response's JSON and its conversation as chat messages (what a continuation
replays as its prompt). A store that died is made again on next use (its records are lost).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import ray
from ray.exceptions import RayActorError

NAMESPACE = "nvray"


@ray.remote(num_cpus=0, max_restarts=-1)
class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.records: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def put(self, response_id: str, record: dict[str, Any]) -> None:
        self.records[response_id] = record
        self.records.move_to_end(response_id)
        while len(self.records) > self.capacity:
            self.records.popitem(last=False)

    def get(self, response_id: str) -> dict[str, Any] | None:
        record = self.records.get(response_id)
        if record is not None:
            self.records.move_to_end(response_id)
        return record

    def delete(self, response_id: str) -> bool:
        return self.records.pop(response_id, None) is not None


class StoredResponses:
    """A replica's way to its app's store (found or made on first use)."""

    def __init__(self, app_name: str, capacity: int) -> None:
        self.name, self.capacity = f"nvray-responses:{app_name}", capacity
        self._actor: Any = None

    def _store(self) -> Any:
        if self._actor is None:
            self._actor = ResponseStore.options(
                name=self.name, namespace=NAMESPACE, lifetime="detached",
                get_if_exists=True).remote(self.capacity)
        return self._actor

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            return await getattr(self._store(), method).remote(*args)
        except RayActorError:
            self._actor = None  # gone: found again, or made anew, once
            return await getattr(self._store(), method).remote(*args)

    async def put(self, response_id: str, record: dict[str, Any]) -> None:
        if self.capacity:
            await self._call("put", response_id, record)

    async def get(self, response_id: str) -> dict[str, Any] | None:
        return await self._call("get", response_id) if self.capacity else None

    async def delete(self, response_id: str) -> bool:
        return await self._call("delete", response_id) if self.capacity else False
