"""Where the app's HTTP and handle requests find an engine: ``LocalEngine`` or ``LeasedEngines``.

Both give the routes (``deployments/server.py``) one interface: ``lease(routing_key, timeout)``
returns a ``Lease`` whose ``router`` (an OutputRouter: one output channel to an engine's driver)
takes the request and whose ``release()`` ends it; plus the engine facts, tokenizer calls,
health and stats the routes need.

- ``LocalEngine``: the engine this replica hosts in its own placement group (the app without
  prefix routing, and every NvrayEngine replica). A lease is a slot of its AdmissionGate.
- ``LeasedEngines``: the engines of the app's NvrayEngine deployment, reached from the ingress
  through a DeploymentHandle whose request router is the PrefixAwareRouter. A lease is a
  streaming ``lease(routing_key=...)`` call, routed by the prompt's prefix: the chosen engine replica
  takes a slot of its gate and answers with its engine's id and driver; the ingress adds the
  request to that driver through its own output channel to it (opened once per engine), so
  outputs go from the driver straight to the ingress, one message per engine step, never
  through the engine replica. The call stays open for the request's life, so Serve counts the
  request as the engine replica's ongoing request (autoscaling, queue lengths, its
  ``max_ongoing_requests``); ``release()`` cancels it, which gives the slot back.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import ray
from ray import serve

from deployments import prefix_index
from deployments.admission import AdmissionGate
from deployments.args import AppArgs
from nvray.runtime import start_engine
from nvray.runtime.output_router import OutputRouter

# Serve prints this logger's INFO lines on the console of `serve run` (other loggers' it drops)
serve_logger = logging.getLogger("ray.serve")


def ready_line(model: str, info: dict[str, Any]) -> str:
    """What a user wants to see once an engine is up: model, device, KV cache, graphs, start."""
    blocks, block_size = info["num_kvcache_blocks"], info["block_size"]
    graphs = "CUDA graphs on" if info.get("cuda_graphs") else "no CUDA graphs"
    return (f"nvray engine ready: model {model!r} on {info.get('device')} "
            f"(tensor parallel {info.get('tensor_parallel_size')}), weights "
            f"{(info.get('dtypes') or {}).get('weights')}, KV cache {blocks:,} blocks "
            f"x {block_size} tokens ({blocks * block_size:,} tokens), {graphs}, "
            f"max_model_len {info['max_model_len']:,}, started in {info.get('startup_s')} s")


@dataclass
class Lease:
    """A request's hold on one engine: add its requests through ``router``, then ``release``."""

    router: OutputRouter
    _release: Callable[[], Any]
    _released: bool = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._release()


class LocalEngine:
    """The engine hosted by this replica."""

    def __init__(self, args: AppArgs) -> None:
        self.engine_id = uuid.uuid4().hex[:12]
        self.gate = AdmissionGate(args.max_ongoing_requests, args.max_waiting())
        self.client = start_engine(args.engine_config(),
                                   pg=ray.util.get_current_placement_group())
        self.driver = self.client.driver
        self.router = OutputRouter(self.driver)
        self.router.open_now()  # here, not in a request: see OutputRouter.open_now
        serve_logger.info(ready_line(args.name_to_serve(), self.client.info))

    async def lease(self, routing_key: str, timeout: float) -> Lease:
        ticket = await self.gate.enter(timeout)
        return Lease(self.router, ticket.release)

    async def info(self) -> dict[str, Any]:
        return self.client.info

    async def tokenize(self, prompt: Any) -> list[int]:
        return await self.driver.tokenize.remote(prompt)

    async def detokenize(self, tokens: list[int]) -> str:
        return await self.driver.detokenize.remote(tokens)

    async def stats_by_engine(self) -> dict[str | None, dict[str, Any]]:
        return {None: await self.driver.stats.remote()}

    async def routing_counts(self) -> None:
        return None  # no router in front of this engine

    async def check_health(self) -> None:
        """Raises if the engine, one of its ranks or this replica's output channel is gone."""
        if self.router.dead is not None:
            raise self.router.dead
        await self.driver.check_health.remote()

    async def engine_client(self) -> Any:
        return self.client

    def close(self) -> None:
        self.router.close()
        self.client.shutdown()


class LeasedEngines:
    """The engine replicas of the app's NvrayEngine deployment, leased per request."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.routers: dict[str, OutputRouter] = {}  # engine id -> channel to its driver
        self.drivers: dict[str, Any] = {}  # engine id -> its driver (for stats)
        self._info: dict[str, Any] | None = None

    async def lease(self, routing_key: str, timeout: float) -> Lease:
        call = self.handle.options(stream=True).lease.remote(routing_key=routing_key)
        try:
            async with asyncio.timeout(timeout):
                engine_id, driver = await call.__anext__()
        except BaseException:
            call.cancel()
            raise
        return Lease(self._router(engine_id, driver), call.cancel)

    def _router(self, engine_id: str, driver: Any) -> OutputRouter:
        router = self.routers.get(engine_id)
        if router is None or router.dead is not None:
            self._forget_dead()
            router = self.routers[engine_id] = OutputRouter(driver)
            self.drivers[engine_id] = driver
        return router

    def _forget_dead(self) -> None:
        """Engines that went away (scaled down, failed): their channels ended."""
        for engine_id in [e for e, r in self.routers.items() if r.dead is not None]:
            self.routers.pop(engine_id).close()
            self.drivers.pop(engine_id, None)

    async def info(self) -> dict[str, Any]:
        if self._info is None:
            self._info = await self.handle.info.remote()
        return self._info

    async def tokenize(self, prompt: Any) -> list[int]:
        return await self.handle.tokenize.remote(prompt)

    async def detokenize(self, tokens: list[int]) -> str:
        return await self.handle.detokenize.remote(tokens)

    async def stats_by_engine(self) -> dict[str | None, dict[str, Any]]:
        """Stats of every engine this ingress has leased from (one it asks for if none yet)."""
        self._forget_dead()
        if not self.drivers:
            engine_id, driver = await self.handle.describe.remote()
            self.drivers[engine_id] = driver
        ids = list(self.drivers)
        results = await asyncio.gather(*(self.drivers[e].stats.remote() for e in ids),
                                       return_exceptions=True)
        stats = {}
        for engine_id, result in zip(ids, results):
            if isinstance(result, BaseException):
                self.drivers.pop(engine_id, None)  # gone since: no longer reported
            else:
                stats[engine_id] = result
        return stats

    async def check_health(self) -> None:
        await self.handle.check_health.remote()

    async def routing_counts(self) -> dict[str, int]:
        """The app's prefix-router decisions (shared by its ingress replicas)."""
        return await prefix_index.routing_counts(serve.get_replica_context().app_name)

    async def engine_client(self) -> Any:
        return await self.handle.engine_client.remote()

    def close(self) -> None:
        for router in self.routers.values():
            router.close()
