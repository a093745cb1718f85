"""PrefixAwareRouter: a Ray Serve request router (Ray 2.60's ``RequestRouter`` API) that sends a
request to the engine replica most likely to hold its prompt's prefix in its KV cache, balanced
against load.

It runs in the caller's process, one instance per deployment handle: in the nvray app that is
the ingress replica, which leases an engine replica for each HTTP or handle request with
``lease(routing_key)`` (``deployments/engines.py``), so HTTP and handle requests are routed
alike. The routing key is the prompt's text (chat messages joined in order), so a
conversation's next turn, which resends the history, starts with the key of the turn before.

The router remembers, in a bounded LRU table, which replica last took a request whose key
started with each block of ``block_chars`` characters (chained xxh64 hashes of the leading
blocks, like the engine's prefix cache does with token blocks). A new request goes to the
replica that took its longest remembered prefix — *prefix affinity* — while that replica's
ongoing requests exceed the least-loaded candidate's by at most ``max_load_imbalance``;
otherwise, or with no remembered prefix, to the least-loaded replica (Serve's cached queue
lengths; ties broken at random). The chosen replica comes first and the others after it, taken
only if it refuses (its queue is full). Every request then marks its blocks as held by the
replica chosen for it, so under a skewed load a hot prefix spreads to a second replica instead
of piling onto one.

Decisions are counted per process (``deployments.routing_stats``; the ingress's ``/metrics`` exports them
as ``nvray_router_requests_total{by="prefix"|"load"}``).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

import xxhash
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deployments import routing_stats
from nvray.chat_template import as_chat_prompt, is_chat

BLOCK_CHARS = 64  # about a 16-token KV block of English text
MAX_LOAD_IMBALANCE = 4  # ongoing requests above the least-loaded replica that affinity may add
TABLE_SIZE = 200_000  # remembered prefix blocks (LRU)
_MAX_DECIDED = 10_000  # request ids remembered so that a retried routing counts once

def routing_key(prompt: Any) -> str:
    """The text a prompt is routed by: a string as is, token ids as digits, chat messages as
    their roles and contents in order (a longer conversation extends a shorter one's key)."""
    if isinstance(prompt, str):
        return prompt
    if is_chat(prompt):
        return "".join(f"\x1e{m.get('role', '')}\x1f{_content_text(m.get('content'))}"
                       for m in as_chat_prompt(prompt).messages)
    if isinstance(prompt, list):
        return ",".join(str(t) for t in prompt)
    return ""


def _content_text(content: Any) -> str:
    if isinstance(content, list):  # OpenAI content parts
        return "".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def prefix_hashes(key: str, block_chars: int = BLOCK_CHARS) -> list[int]:
    """Chained hashes of the key's whole leading blocks: hash i covers blocks 0..i."""
    hashes, prev = [], 0
    data = key.encode("utf-8", "surrogatepass")
    for start in range(0, len(data) - block_chars + 1, block_chars):
        prev = xxhash.xxh64_intdigest(data[start:start + block_chars], seed=prev)
        hashes.append(prev)
    return hashes


class PrefixTable:
    """Prefix block hash -> the replica that last took a request starting with it (LRU)."""

    def __init__(self, capacity: int = TABLE_SIZE) -> None:
        self.capacity = capacity
        self.owners: OrderedDict[int, ReplicaID] = OrderedDict()

    def longest_owner(self, hashes: list[int], live: set[ReplicaID]) -> ReplicaID | None:
        """The live replica holding the longest of these prefixes, if any holds one."""
        for h in reversed(hashes):
            owner = self.owners.get(h)
            if owner is not None and owner in live:
                return owner
        return None

    def record(self, hashes: list[int], replica: ReplicaID) -> None:
        for h in hashes:
            self.owners[h] = replica
            self.owners.move_to_end(h)
        while len(self.owners) > self.capacity:
            self.owners.popitem(last=False)


def _key_of(request: PendingRequest | None) -> str | None:
    """The routing key a request carries: the ``routing_key`` keyword of a ``lease`` call;
    other calls (engine facts, tokenizer, stats) carry none (None)."""
    key = request.kwargs.get("routing_key") if request is not None else None
    return key if isinstance(key, str) else None


class PrefixAwareRouter(RequestRouter):
    def initialize_state(self, block_chars: int = BLOCK_CHARS,
                         max_load_imbalance: int = MAX_LOAD_IMBALANCE,
                         table_size: int = TABLE_SIZE) -> None:
        self.block_chars = block_chars
        self.max_load_imbalance = max_load_imbalance
        self.table = PrefixTable(table_size)
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
        chosen, by = self._choose(candidate_replicas, hashes)
        self.table.record(hashes, chosen.replica_id)
        self._count_once(pending_request, by)
        return [[chosen], [r for r in candidate_replicas if r is not chosen]]

    def _choose(self, candidates: list[RunningReplica], hashes: list[int]
                ) -> tuple[RunningReplica, str]:
        loads = [self._load(r) for r in candidates]
        least = min(loads)
        by_id = {r.replica_id: (r, load) for r, load in zip(candidates, loads)}
        owner = self.table.longest_owner(hashes, set(by_id)) if hashes else None
        if owner is not None and by_id[owner][1] <= least + self.max_load_imbalance:
            return by_id[owner][0], "prefix"
        return random.choice([r for r, load in zip(candidates, loads) if load == least]), "load"

    def _count_once(self, request: PendingRequest | None, by: str) -> None:
        rid = request.metadata.internal_request_id if request is not None else None
        if rid is not None and rid in self.decided:
            return  # a retry of a request already counted
        if rid is not None:
            self.decided[rid] = None
            while len(self.decided) > _MAX_DECIDED:
                self.decided.popitem(last=False)
        routing_stats.count(by)
