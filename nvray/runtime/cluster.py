"""Connecting to Ray: join the running cluster if there is one, else start a local one.

An address that was asked for (``RAY_ADDRESS``) must answer: if nothing listens there, this
fails within seconds with a ConnectionError that says what was tried, instead of Ray's minutes
of retries. Without one, the cluster that ``ray start`` recorded on this machine is joined if
its head still answers (with the token that Ray's default authentication keeps in
``~/.ray/auth_token``); a record left by a head that was killed is reported in a warning and
a new local single-node cluster is started instead (``start_local_cluster``: its processes keep
their Python bytecode where the environment keeps none); ``skip_a_dead_recorded_head`` makes a
``ray.init()`` to come (``serve run``'s) do the same. ``hide_token_auth_notice`` keeps Ray's
notice of its default token authentication off the console. ``resolve_device`` pins an
engine's device 'auto' to what the cluster has.
"""

from __future__ import annotations

import logging
import os
import socket

import ray

from nvray.cache_dirs import children_keep_bytecode
from nvray.config import EngineConfig

logger = logging.getLogger(__name__)
_PROBE_TIMEOUT_S = 2.0
_TOKEN_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
_TOKEN_AUTH_NOTICE = "Token authentication is enabled for this Ray cluster"


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


class _NotTheTokenAuthNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_TOKEN_AUTH_NOTICE)


def hide_token_auth_notice() -> None:
    """In this process, drop the notice Ray 2.60 logs at every ``ray.init`` that starts a local
    cluster or joins one found on this machine ("Token authentication is enabled for this Ray
    cluster. Set RAY_AUTH_MODE=disabled to opt out ..."): it reports Ray's default, on every
    ``LLM()`` script and ``serve run``. Every other line of that logger still shows (its warning
    that authentication is off among them)."""
    auth_log = logging.getLogger(_TOKEN_AUTH_LOGGER)
    if not any(isinstance(f, _NotTheTokenAuthNotice) for f in auth_log.filters):
        auth_log.addFilter(_NotTheTokenAuthNotice())


def ensure_ray() -> None:
    """``ray.init(address="auto")`` semantics, falling back to a new local cluster."""
    if ray.is_initialized():
        return
    hide_token_auth_notice()
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
        # "auto" finds the same head, and only then does Ray pick up the token that a plain
        # `ray start --head` turns authentication on with (never for an explicit address)
        ray.init(address="auto")
        return
    if recorded:
        _warn_dead_record(recorded)
    start_local_cluster()


def start_local_cluster() -> None:
    """A new single-node cluster of this process; where the environment keeps no Python
    bytecode and Ray came without any, its daemons and workers keep theirs under
    ``NVRAY_CACHE_DIR`` (``cache_dirs.children_keep_bytecode``): the next start reads it."""
    with children_keep_bytecode("ray"):
        ray.init(address="local", include_dashboard=False)


def _warn_dead_record(recorded: str) -> None:
    logger.warning("a Ray cluster was recorded at %s but its head does not answer (stopped "
                   "without `ray stop`? `ray stop --force` clears the record); starting a local "
                   "cluster instead", recorded)


def skip_a_dead_recorded_head() -> None:
    """For a ``ray.init()`` that someone else makes next (``serve run``, ``serve.run``): when no
    address is asked for and the cluster recorded on this machine no longer answers, make that
    call start a local cluster (``RAY_ADDRESS=local``, with ``ensure_ray``'s warning) instead of
    retrying the dead head forever."""
    if ray.is_initialized() or os.environ.get("RAY_ADDRESS"):
        return
    recorded = recorded_cluster_address()
    if recorded and not head_answers(recorded):
        _warn_dead_record(recorded)
        os.environ["RAY_ADDRESS"] = "local"


def cluster_has_gpus() -> bool:
    """GPUs in the connected cluster; before connecting, whether a Ray node started on this
    machine would report any (``serve run`` builds its app before it connects)."""
    if not ray.is_initialized():
        return local_gpu_count() > 0
    return ray.cluster_resources().get("GPU", 0) > 0


def local_gpu_count() -> int:
    """The GPUs Ray gives a node started here, counted as Ray counts them: what NVML sees,
    at most as many as CUDA_VISIBLE_DEVICES lists when it is set. No torch import (~3 s on a
    GPU host)."""
    from ray._private.accelerators import NvidiaGPUAcceleratorManager as nvidia  # noqa: PLC0415

    count = nvidia.get_current_node_num_accelerators()
    visible = nvidia.get_current_process_visible_accelerator_ids()
    return count if visible is None else min(count, len(visible))


def resolve_device(config: EngineConfig) -> EngineConfig:
    """Pin device 'auto' to what the cluster has: 'cuda' if it has GPUs, else 'cpu'."""
    if config.device != "auto":
        return config
    return config.replace(device="cuda" if cluster_has_gpus() else "cpu")
