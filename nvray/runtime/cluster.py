"""Connecting to Ray: join the running cluster if there is one, else start a local one.

An address that was asked for (``RAY_ADDRESS``) must answer: if nothing listens there, this
fails within seconds with a ConnectionError that says what was tried, instead of Ray's minutes
of retries. Without one, the cluster that ``ray start`` recorded on this machine is joined if
its head still answers; a record left by a head that was killed is reported in a warning and a
new local single-node cluster is started instead. ``resolve_device`` pins an engine's
device 'auto' to what the cluster has.
"""

from __future__ import annotations

import logging
import os
import socket

import ray

from nvray.config import EngineConfig

logger = logging.getLogger(__name__)
_PROBE_TIMEOUT_S = 2.0


def head_answers(address: str, timeout: float = _PROBE_TIMEOUT_S) -> bool:
    """Whether something accepts connections at a ``host:port`` GCS address."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout).close()
        return True
    except (OSError, ValueError):
        return False


def recorded_cluster_address() -> str | None:
    """The address ``ray.init(address="auto")`` would join: the cluster ``ray start`` recorded
    on this machine, else a GCS found running here."""
    from ray._private import services  # noqa: PLC0415 - Ray's own lookup for "auto"

    return services.find_bootstrap_address(None) or next(iter(services.find_gcs_addresses()), None)


def ensure_ray() -> None:
    """``ray.init(address="auto")`` semantics, falling back to a new local cluster."""
    if ray.is_initialized():
        return
    asked = os.environ.get("RAY_ADDRESS")
    if asked:
        if ":" in asked and "://" not in asked and not head_answers(asked):
            raise ConnectionError(
                f"RAY_ADDRESS={asked}: no Ray cluster answers there (is its head running? start "
                "one with `ray start --head`, or unset RAY_ADDRESS to run on a local cluster)")
        ray.init(log_to_driver=True)
        return
    recorded = recorded_cluster_address()
    if recorded and head_answers(recorded):
        ray.init(address=recorded)
        return
    if recorded:
        logger.warning("a Ray cluster was recorded at %s but its head does not answer (stopped "
                       "without `ray stop`?); starting a local cluster instead", recorded)
    ray.init(address="local", include_dashboard=False)


def cluster_has_gpus() -> bool:
    """GPUs in the connected cluster; before connecting, whether this machine has one (the
    local cluster that would start here)."""
    if not ray.is_initialized():
        import torch  # noqa: PLC0415

        return torch.cuda.is_available()
    return ray.cluster_resources().get("GPU", 0) > 0


def resolve_device(config: EngineConfig) -> EngineConfig:
    """Pin device 'auto' to what the cluster has: 'cuda' if it has GPUs, else 'cpu'."""
    if config.device != "auto":
        return config
    return config.replace(device="cuda" if cluster_has_gpus() else "cpu")
