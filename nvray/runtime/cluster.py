"""Connecting to Ray: join the running cluster if there is one, else start a local one.

A new local cluster is a single-node cluster on this machine.
"""

from __future__ import annotations

import os

import ray


def ensure_ray() -> None:
    """``ray.init(address="auto")`` semantics, falling back to a new local cluster."""
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=True)
        return
    try:
        ray.init(address="auto")
    except ConnectionError:
        ray.init(include_dashboard=False)


def cluster_has_gpus() -> bool:
    """GPUs in the connected cluster; before connecting, whether this machine has one (the
    local cluster that would start here)."""
    if not ray.is_initialized():
        import torch  # noqa: PLC0415

        return torch.cuda.is_available()
    return ray.cluster_resources().get("GPU", 0) > 0
