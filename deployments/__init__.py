"""The nvray Serve application.

- ``serve run deployments:app`` — the embedded tiny model, on the GPU if there is one, else the
  CPU, answering on 127.0.0.1:8000;
- ``serve run deployments:build_app model=/path tensor_parallel_size=2 ...`` or
  ``serve run deployments/config.yaml`` — any checkpoint, autoscaled engine replicas.

``build_app(args)`` validates the args (AppArgs: unknown or invalid ones fail here, naming
them) and returns the bound deployment: one replica = one engine in its own placement group.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from deployments.args import AppArgs, parse_args
from deployments.server import NvrayServer
from nvray.config import EngineConfig
from nvray.runtime.client import resolve_device
from nvray.runtime.placement import engine_bundles

__all__ = ["AppArgs", "NvrayServer", "app", "build_app"]
REPLICA_CPUS = 0.1  # the replica mostly relays; it shares bundle 0 with the engine's driver


def _bundles(config: EngineConfig) -> list[dict[str, float]]:
    bundles = engine_bundles(config, config.device == "cuda")
    bundles[0] = {**bundles[0], "CPU": bundles[0]["CPU"] + REPLICA_CPUS}
    return bundles


def build_app(args: dict[str, Any] | AppArgs | None = None) -> Application:
    parsed = parse_args(args)
    config = resolve_device(parsed.engine_config())
    parsed = parsed.model_copy(update={"device": config.device})
    deployment = NvrayServer.options(
        name="NvrayServer",
        ray_actor_options={"num_cpus": REPLICA_CPUS},
        placement_group_bundles=_bundles(config),
        placement_group_strategy=config.placement_strategy,
        autoscaling_config={"min_replicas": parsed.min_replicas,
                            "max_replicas": parsed.max_replicas,
                            "target_ongoing_requests": parsed.target_ongoing_requests,
                            "upscale_delay_s": parsed.upscale_delay_s,
                            "downscale_delay_s": parsed.downscale_delay_s},
        # a bounded queue is kept by the replica (deployments/admission.py), refusing in JSON
        max_ongoing_requests=parsed.serve_max_ongoing_requests(),
        max_queued_requests=-1,
        health_check_period_s=10,
        health_check_timeout_s=30,
        graceful_shutdown_timeout_s=20,
    )
    return deployment.bind(parsed.model_dump())


app = build_app({})
