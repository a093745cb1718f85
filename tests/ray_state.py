"""Live state of the test session's Ray cluster, through Ray's state API. Calls name the
cluster by its GCS address: other Ray clusters may run on this machine."""

from __future__ import annotations

from typing import Any


def _address() -> str:
    import ray

    return ray.get_runtime_context().gcs_address


def live_actors(classes: tuple[str, ...]) -> dict[str, Any]:
    """actor id -> state record of every live actor whose class is one of ``classes``."""
    from ray.util.state import list_actors

    actors = list_actors(address=_address(), filters=[("state", "=", "ALIVE")], limit=1000)
    return {a.actor_id: a for a in actors if a.class_name in classes}


def live_placement_groups() -> set[str]:
    from ray.util.state import list_placement_groups

    return {p.placement_group_id for p in list_placement_groups(address=_address(), limit=1000)
            if p.state != "REMOVED"}
