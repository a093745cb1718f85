"""The nvray Serve application.

- ``serve run deployments:app`` — the embedded tiny model, on the GPU if there is one, else the
  CPU, answering on 127.0.0.1:8000;
- ``serve run deployments:build_app model=/path tensor_parallel_size=2 ...`` or
  ``serve run deployments/config.yaml`` — any checkpoint, autoscaled engine replicas.

``build_app(args)`` validates the args (AppArgs: unknown or invalid ones fail here, naming
them) and returns the bound application, in one of two shapes:
- one deployment, NvrayServer, each replica one whole engine in its own placement group,
  Serve's default router in front (``prefix_routing`` off: the default with one replica);
- prefix-routed (the default when ``max_replicas > 1``): an NvrayServer ingress (HTTP and
  handles, ``ingress_replicas`` of them) in front of the NvrayEngine deployment, whose replicas
  are the engines, autoscaled, reached through the PrefixAwareRouter.
"""

from __future__ import annotations

import warnings
from typing import Any

from ray.serve import Application
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from deployments.args import AppArgs, parse_args
from deployments.ingress.console import quiet_serve_shutdown_notice
from deployments.routing.engine_replica import NvrayEngine
from deployments.ingress.server import NvrayServer
from nvray.config import EngineConfig
from nvray.runtime.cluster import (hide_token_auth_notice, resolve_device,
                                   skip_a_dead_recorded_head)
from nvray.preflight import check_model
from nvray.runtime.placement import engine_bundles

__all__ = ["AppArgs", "NvrayEngine", "NvrayServer", "app", "build_app"]
REPLICA_CPUS = 0.1  # a replica mostly relays; an engine's shares bundle 0 with its driver
_ROUTER = "deployments.routing.prefix_router:PrefixAwareRouter"
_INGRESS_QUEUE_MARGIN = 64  # requests an ingress takes beyond what its engines admit


def _bundles(config: EngineConfig) -> list[dict[str, float]]:
    bundles = engine_bundles(config, config.device == "cuda")
    bundles[0] = {**bundles[0], "CPU": bundles[0]["CPU"] + REPLICA_CPUS}
    return bundles


def _autoscaling_config(parsed: AppArgs) -> AutoscalingConfig:
    """Serve's autoscaling of the engine replicas.

    Ray 2.60 deprecates ``metrics_interval_s`` for two environment variables
    (``RAY_SERVE_{REPLICA,HANDLE}_AUTOSCALING_METRIC_PUSH_INTERVAL_S``) that it does not read
    yet: the field is still the only setting that works (Serve's default, 10 s, sees a burst
    ~10 s late), so it is set, and its DeprecationWarning (one per app built) is not shown. An
    instance, not a dict, goes to ``.options``: Serve keeps it without validating it again."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The `metrics_interval_s` field",
                                category=DeprecationWarning)
        return AutoscalingConfig(
            min_replicas=parsed.min_replicas, max_replicas=parsed.max_replicas,
            target_ongoing_requests=parsed.target_ongoing_requests,
            upscale_delay_s=parsed.upscale_delay_s, downscale_delay_s=parsed.downscale_delay_s,
            metrics_interval_s=parsed.metrics_interval_s,
            look_back_period_s=parsed.look_back_period_s)


def _engine_options(parsed: AppArgs, config: EngineConfig) -> dict[str, Any]:
    """Serve options of a deployment whose replicas are whole engines."""
    return {
        "ray_actor_options": {"num_cpus": REPLICA_CPUS},
        "placement_group_bundles": _bundles(config),
        "placement_group_strategy": config.placement_strategy,
        "autoscaling_config": _autoscaling_config(parsed),
        # a bounded queue is kept by the replica (routing/admission.py), refusing in JSON
        "max_ongoing_requests": parsed.serve_max_ongoing_requests(),
        "max_queued_requests": -1,
        "health_check_period_s": 10,
        "health_check_timeout_s": 30,
        "graceful_shutdown_timeout_s": 20,
    }


def build_app(args: dict[str, Any] | AppArgs | None = None) -> Application:
    skip_a_dead_recorded_head()  # `serve run` calls ray.init() after building the app
    hide_token_auth_notice()  # which would print Ray's notice that token auth is on
    quiet_serve_shutdown_notice()  # and prints Serve's shutdown notice after a clean Ctrl-C
    parsed = parse_args(args)
    config = parsed.engine_config()
    check_model(config)  # before anything deploys: a running app stays up
    config = resolve_device(config)
    parsed = parsed.model_copy(update={"device": config.device})
    if not parsed.routes_by_prefix():
        return NvrayServer.options(name="NvrayServer",
                                   **_engine_options(parsed, config)).bind(parsed.model_dump())
    router = RequestRouterConfig(
        request_router_class=_ROUTER,
        request_router_kwargs={"max_load_imbalance": parsed.prefix_routing_max_imbalance})
    engines = NvrayEngine.options(name="NvrayEngine", request_router_config=router,
                                  **_engine_options(parsed, config)).bind(parsed.model_dump())
    ingress_limit = parsed.max_replicas * parsed.serve_max_ongoing_requests() + _INGRESS_QUEUE_MARGIN
    return NvrayServer.options(
        name="NvrayServer", num_replicas=parsed.ingress_replicas or parsed.max_replicas,
        ray_actor_options={"num_cpus": REPLICA_CPUS}, max_ongoing_requests=ingress_limit,
        max_queued_requests=-1, graceful_shutdown_timeout_s=20,
    ).bind(parsed.model_dump(), engines)


def __getattr__(name: str) -> Application:
    """``app`` (what ``serve run deployments:app`` imports) is built when first asked for, not at
    import: importing ``deployments`` starts nothing and resolves no device."""
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()["app"] = built = build_app({})
    return built
