"""Counts of the prefix-aware router's decisions in this process (``by``: prefix or load).

A module of its own, referenced by module: Serve ships a deployment's request-router class to
each caller pickled, and a by-value copy of the router's own module globals would count apart
from what ``/metrics`` reads.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_counts = {"prefix": 0, "load": 0}


def count(by: str) -> None:
    with _lock:
        _counts[by] += 1


def routing_counts() -> dict[str, int]:
    """Requests this process routed by prefix affinity and by load, so far."""
    with _lock:
        return dict(_counts)
