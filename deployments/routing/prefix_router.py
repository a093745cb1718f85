"""PrefixAwareRouter: a Ray Serve request router (Ray 2.60's ``RequestRouter`` API) that sends a
request to the engine replica most likely to hold its prompt's prefix in its KV cache, balanced
against load.

It runs in the caller's process, one instance per deployment handle: in the nvray app that is
the ingress replica, which leases an engine replica for each HTTP or handle request with
``lease(routing_key)`` (``deployments/routing/engines.py``), so HTTP and handle requests are routed
alike. The routing key is the prompt's text (chat messages joined in order), so a
conversation's next turn, which resends the history, starts with the key of the turn before.
A request for a LoRA adapter has the adapter's name as its key's whole first block: the
replicas that served the adapter (and so hold it in a slot and its requests' KV, which only
its own requests can reuse) hold that block, and prefix affinity is *adapter affinity*, load
permitting; a hot adapter spreads to a second replica as a hot prefix does.

The app's routers share one table (``prefix_index.py``, a small actor per app, since
Serve's proxy spreads a conversation's turns over the ingress replicas): which replicas took a
request whose key started with each block of ``block_chars`` characters (chained xxh64 hashes
of the leading blocks, like the engine's prefix cache does with token blocks; an LRU of 200k
blocks; ``prefix_table.py``). If the index does not answer within 0.5 s (5 s while
it starts), a router decides from the requests it routed itself.

A new request goes to the least-loaded of the replicas that hold its longest remembered prefix
— *prefix affinity* — while that replica's ongoing requests exceed the least-loaded
candidate's by at most ``max_load_imbalance``; otherwise, or with no remembered prefix, to the
least-loaded replica (ties broken at random). A prefix every replica holds (a shared system
prompt) thus steers nothing: load decides among them, and only what one replica alone holds (a
conversation's own history) pulls a request there. The chosen replica comes first and the
others after it, taken only if it refuses (its queue is full). Every request then marks its
blocks as held by the replica chosen for it, so under a skewed load a hot prefix spreads to a
second replica instead of piling onto one.

Loads are Serve's cached queue lengths, but wherever the choice turns on the other replicas'
loads (the holders are loaded past the bound above an idle replica) it is made on the loads the
replicas report when asked: a router's cache takes a replica's whole count when it sends a
request there and then sees only its own requests finish, so after a burst through several
ingress replicas it counts, until its entries age out (10 s), requests that have ended; on
those figures alone a conversation's next turn would leave the replica holding its history, or
a hot prefix would pile onto its holder while the replica it should spread to sits idle.

Decisions are counted in the index, per app: "prefix" when affinity narrowed the choice to
the replicas holding the prefix, "load" otherwise (``/metrics`` exports them as
``nvray_router_requests_total{by="prefix"|"load"}``).
"""

from __future__ import annotations

import asyncio
import random
from collections import OrderedDict
from typing import Any

import ray
import xxhash
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from deployments.routing.prefix_index import get_or_create_index
from deployments.routing.prefix_table import BLOCK_CHARS, PrefixTable, prefix_hashes
from nvray.chat_template import as_chat_prompt, is_chat

MAX_LOAD_IMBALANCE = 4  # ongoing requests above the least-loaded replica that affinity may add
_INDEX_TIMEOUT_S = 0.5  # a slower shared index is skipped: this router's own table decides
_INDEX_START_TIMEOUT_S = 5.0  # ... once it has answered; before, it may still be starting
_PROBE_TIMEOUT_S = 0.5  # a replica asked for its load answers within this, else its cache counts
_MAX_DECIDED = 10_000  # request ids remembered so that a retried routing counts once


def routing_key(prompt: Any, adapter: str | None = None) -> str:
    """The text a prompt is routed by: a string as is, token ids as digits, chat messages as
    their roles and contents in order (a longer conversation extends a shorter one's key);
    after its ``adapter``'s block for a LoRA request."""
    if adapter is not None:
        return adapter_block(adapter) + routing_key(prompt)
    if isinstance(prompt, str):
        return prompt
    if is_chat(prompt):
        return "".join(f"\x1e{m.get('role', '')}\x1f{_content_text(m.get('content'))}"
                       for m in as_chat_prompt(prompt).messages)
    if isinstance(prompt, list):
        return ",".join(str(t) for t in prompt)
    return ""


def adapter_block(name: str) -> str:
    """A whole first block of the key that names the adapter (its hash if the name is long)."""
    tag = f"\x1dlora\x1f{name}"
    if len(tag) > BLOCK_CHARS:
        tag = f"\x1dlora\x1f{xxhash.xxh64_hexdigest(name)}"
    return tag.ljust(BLOCK_CHARS, "\x1d")


def _content_text(content: Any) -> str:
    if isinstance(content, list):  # OpenAI content parts
        return "".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def _key_of(request: PendingRequest | None) -> str | None:
    """The routing key a request carries: the ``routing_key`` keyword of a ``lease`` call;
    other calls (engine facts, tokenizer, stats) carry none (None)."""
    key = request.kwargs.get("routing_key") if request is not None else None
    return key if isinstance(key, str) else None


class PrefixAwareRouter(RequestRouter):
    def initialize_state(self, block_chars: int = BLOCK_CHARS,
                         max_load_imbalance: int = MAX_LOAD_IMBALANCE) -> None:
        self.block_chars = block_chars
        self.max_load_imbalance = max_load_imbalance
        self.table = PrefixTable()  # what this router saw: used when the shared index is not
        self.index: Any = None
        self.index_answered = False
        self._shared_index()  # created now, so that it has started by the first request
        self.decided: OrderedDict[str, None] = OrderedDict()  # requests counted (retries are not)

    def _load(self, replica: RunningReplica) -> int:
        return self.replica_queue_len_cache.get(replica.replica_id) or 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        """The chosen replica first, then the others (taken if it refuses: its queue is full)."""
        if not candidate_replicas:
            return []
        key = _key_of(pending_request)
        if key is None:  # not a request for an engine: Serve's shortest queue
            return [candidate_replicas]
        hashes = prefix_hashes(key, self.block_chars)
        holders = set(await self._holders(hashes,
                                          [r.replica_id.unique_id for r in candidate_replicas]))
        loads = {r.replica_id.unique_id: self._load(r) for r in candidate_replicas}
        if self._rests_on_others_loads(loads, holders):
            loads = await self._measured_loads(candidate_replicas, loads)
        chosen, by = self._choose(candidate_replicas, holders, loads)
        self._record(hashes, chosen.replica_id.unique_id, by if self._first_time(pending_request)
                     else None)
        return [[chosen], [r for r in candidate_replicas if r is not chosen]]

    def _rests_on_others_loads(self, loads: dict[str, int], holders: set[str]) -> bool:
        """Whether keeping (or giving up) affinity turns on the other replicas' loads: the
        holders are loaded past the bound above an idle replica. Cached loads are then not
        enough: a router's cache still counts the requests of a burst that has ended, and on
        another replica's stale count a hot prefix piles onto its holder."""
        return bool(holders) and min(loads[h] for h in holders) > self.max_load_imbalance

    def _within_bound(self, loads: dict[str, int], holders: set[str]) -> bool:
        """Whether affinity holds: no holder, or one loaded at most the bound above the least."""
        return not holders or (min(loads[h] for h in holders)
                               <= min(loads.values()) + self.max_load_imbalance)

    async def _measured_loads(self, candidates: list[RunningReplica], cached: dict[str, int]
                              ) -> dict[str, int]:
        """Each candidate's ongoing requests as it reports them now (its cached load if it does
        not answer within the deadline); the answers refresh Serve's cache too."""
        async def measure(replica: RunningReplica) -> int:
            rid = replica.replica_id
            try:
                load = await asyncio.wait_for(replica.get_queue_len(deadline_s=_PROBE_TIMEOUT_S),
                                              _PROBE_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - slow or gone: keep the cached estimate
                return cached[rid.unique_id]
            self.replica_queue_len_cache.update(rid, load)
            return load

        loads = await asyncio.gather(*(measure(r) for r in candidates))
        return {r.replica_id.unique_id: load for r, load in zip(candidates, loads)}

    def _choose(self, candidates: list[RunningReplica], holders: set[str],
                loads: dict[str, int]) -> tuple[RunningReplica, str]:
        """The least-loaded of the replicas holding the longest known prefix, while within the
        imbalance bound ("prefix"; "load" if every replica holds it); else the least-loaded."""
        if holders and self._within_bound(loads, holders):
            nearest = min(loads[h] for h in holders)
            chosen = random.choice([r for r in candidates if r.replica_id.unique_id in holders
                                    and loads[r.replica_id.unique_id] == nearest])
            return chosen, "prefix" if len(holders) < len(candidates) else "load"
        least = min(loads.values())
        return random.choice([r for r in candidates
                              if loads[r.replica_id.unique_id] == least]), "load"

    # ------------------------------------------------------------- the shared index
    def _shared_index(self) -> Any:
        if self.index is None:
            self.index = get_or_create_index(self.app_name)
        return self.index

    async def _holders(self, hashes: list[int], live: list[str]) -> list[str]:
        """Holders of the longest known prefix: the app's shared index, or (if it does not
        answer in time) this router's own table."""
        if not hashes:
            return []
        timeout = _INDEX_TIMEOUT_S if self.index_answered else _INDEX_START_TIMEOUT_S
        try:
            holders = await asyncio.wait_for(self._shared_index().holders.remote(hashes, live),
                                             timeout)
        except Exception as e:  # noqa: BLE001 - slow or gone: decide alone
            if isinstance(e, ray.exceptions.RayActorError):
                self.index, self.index_answered = None, False  # the next call makes a new one
            return self.table.longest_holders(hashes, set(live))
        self.index_answered = True
        return holders

    def _record(self, hashes: list[int], replica: str, by: str | None) -> None:
        self.table.record(hashes, replica)
        try:
            self._shared_index().record.remote(hashes, replica, by)
        except Exception:  # noqa: BLE001 - the index is an optimisation, never a failure
            self.index = None

    def _first_time(self, request: PendingRequest | None) -> bool:
        """Whether this request is routed for the first time (a retry is not counted again)."""
        rid = request.metadata.internal_request_id if request is not None else None
        if rid is None:
            return True
        if rid in self.decided:
            return False
        self.decided[rid] = None
        while len(self.decided) > _MAX_DECIDED:
            self.decided.popitem(last=False)
        return True
