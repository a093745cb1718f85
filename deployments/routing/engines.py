"""Where the app's HTTP and handle requests find an engine: ``LocalEngine`` or ``LeasedEngines``.

Both give the routes (``ingress/server.py``) one interface: ``lease(routing_key, timeout)``
returns a ``Lease`` whose ``router`` (an OutputRouter: one output channel to an engine's driver)
takes the request and whose ``release()`` ends it; plus the engine facts, tokenizer calls,
health and stats the routes need.

- ``LocalEngine``: the engine this replica hosts in its own placement group (the app without
  prefix routing, and every NvrayEngine replica). A lease is a slot of its AdmissionGate. It
  starts in the replica's constructor, or (``in_background``) on a thread while the replica
  already answers: ``check_health`` then raises ``EngineStarting`` (``/health``: 503) and
  requests wait for the engine, up to their time-out.
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
import concurrent.futures
import logging
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import ray
from ray import serve

from deployments.routing import prefix_index
from deployments.routing.admission import AdmissionGate
from deployments.args import AppArgs
from nvray.models.tiny import resolve_model
from nvray.runtime import start_engine
from nvray.runtime.errors import EngineDeadError
from nvray.runtime.output_router import OutputRouter

# Serve prints this logger's INFO lines on the console of `serve run` (other loggers' it drops)
serve_logger = logging.getLogger("ray.serve")
# How long an ingress's /health waits for an engine replica's answer: none comes while no engine
# replica is up yet (Serve holds the call until one is), and a load balancer's probe gives up
# after a few seconds.
HEALTH_WAIT_S = 2.0


class EngineStarting(Exception):
    """The engine is not up yet: ``/health`` answers 503 (``engine_starting``)."""


def ready_line(model: str, path: str, info: dict[str, Any], cluster: str) -> str:
    """What a user wants to see once an engine is up: model and its checkpoint, device, KV
    cache, graphs, start-up time, and the Ray cluster that scripts and jobs join."""
    blocks, block_size = info["num_kvcache_blocks"], info["block_size"]
    graphs = "CUDA graphs on" if info.get("cuda_graphs") else "no CUDA graphs"
    return (f"nvray engine ready: model {model!r} from {path} on {info.get('device')} "
            f"(tensor parallel {info.get('tensor_parallel_size')}, pipeline stages "
            f"{info.get('pipeline_parallel_size', 1)}), weights "
            f"{(info.get('dtypes') or {}).get('weights')}, KV cache {blocks:,} blocks "
            f"x {block_size} tokens ({blocks * block_size:,} tokens), {graphs}, "
            f"max_model_len {info['max_model_len']:,}, started in {info.get('startup_s')} s; "
            f"Ray cluster at {cluster} (a script on this machine joins it with "
            f"ray.init(address='auto'))")


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
    """The engine hosted by this replica.

    ``in_background``: the engine starts on a thread and the constructor returns at once, so the
    replica answers (``/health``: 503) while the engine loads; requests wait for it."""

    def __init__(self, args: AppArgs, in_background: bool = False) -> None:
        self.engine_id = uuid.uuid4().hex[:12]
        # several replicas behind Serve's router: each one's /metrics names its engine, so that
        # scrapes landing on different replicas never mix two engines' counters in one series
        self.metrics_id = self.engine_id if args.max_replicas > 1 else None
        self.gate = AdmissionGate(args.max_ongoing_requests, args.max_waiting())
        self.start_wait_s = args.request_timeout_s
        self.client: Any = None  # these three are set once the engine is up
        self.driver: Any = None
        self.router: OutputRouter | None = None
        pg = ray.util.get_current_placement_group()  # the replica's: read on its own thread
        self._started: concurrent.futures.Future[None] | None = None
        if in_background:
            self._started = _on_a_thread(self._start, args, pg)
            self._started.add_done_callback(_log_start_failure)
        else:
            self._start(args, pg)

    def _start(self, args: AppArgs, pg: Any) -> None:
        client = start_engine(args.engine_config(), pg=pg)
        self.router = OutputRouter(client.driver)
        self.router.open_now()  # here, not in a request: see OutputRouter.open_now
        self.client, self.driver = client, client.driver
        serve_logger.info(ready_line(args.name_to_serve(), resolve_model(args.model),
                                     client.info, ray.get_runtime_context().gcs_address))

    def started(self) -> bool:
        """True once the engine is up; raises its start-up error if it failed to start."""
        if self._started is None:
            return True
        if not self._started.done():
            return False
        if error := self._started.exception():
            raise EngineDeadError(f"the engine failed to start: {error}") from error
        return True

    async def ready(self) -> None:
        """Returns once the engine is up, waiting for it up to the request time-out (then
        TimeoutError); EngineDeadError if it failed to start."""
        if self._started is not None and not self._started.done():
            async with asyncio.timeout(self.start_wait_s):
                await asyncio.shield(asyncio.wrap_future(self._started))
        self.started()

    async def lease(self, routing_key: str, timeout: float) -> Lease:
        ticket = await self.gate.enter(timeout)  # a full queue refuses at once, started or not
        try:
            await self.ready()
        except BaseException:
            ticket.release()
            raise
        return Lease(self.router, ticket.release)

    async def info(self) -> dict[str, Any]:
        await self.ready()
        return self.client.info

    async def tokenize(self, prompt: Any) -> list[int]:
        await self.ready()
        return await self.driver.tokenize.remote(prompt)

    async def detokenize(self, tokens: list[int]) -> str:
        await self.ready()
        return await self.driver.detokenize.remote(tokens)

    async def stats_by_engine(self) -> dict[str | None, dict[str, Any]]:
        await self.ready()
        return {self.metrics_id: await self.driver.stats.remote()}

    async def routing_counts(self) -> None:
        return None  # no router in front of this engine

    async def check_health(self) -> None:
        """Raises EngineStarting while the engine starts, its start-up error if it failed to
        start, or an error if the engine, one of its ranks or this replica's output channel is
        gone."""
        if not self.started():
            raise EngineStarting("the engine is starting; retry shortly")
        if self.router.dead is not None:
            raise self.router.dead
        await self.driver.check_health.remote()

    async def engine_client(self) -> Any:
        await self.ready()
        return self.client

    def close(self) -> None:
        """Shut the engine down (one still starting: once it is up)."""
        if self._started is not None and not self._started.done():
            self._started.add_done_callback(lambda _: self.close())
            return
        if self.router is not None:
            self.router.close()
        if self.client is not None:
            self.client.shutdown()


def _log_start_failure(started: concurrent.futures.Future[None]) -> None:
    if error := started.exception():  # Serve logs it only as a failed health check
        serve_logger.error("nvray engine failed to start", exc_info=error)


def _on_a_thread(fn: Callable[..., None], *args: Any) -> concurrent.futures.Future[None]:
    """``fn(*args)`` on a thread of its own; its future."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nvray-engine-start")
    try:
        return pool.submit(fn, *args)
    finally:
        pool.shutdown(wait=False)  # the thread ends when fn returns


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
        """Raises unless an engine replica answers its health check within HEALTH_WAIT_S
        (EngineStarting if none answers: while the app deploys, none is up yet)."""
        call = self.handle.check_health.remote()
        try:
            async with asyncio.timeout(HEALTH_WAIT_S):
                await call
        except TimeoutError:
            call.cancel()
            raise EngineStarting(f"no engine replica answered within {HEALTH_WAIT_S:g} s "
                                 "(starting, or all busy); retry shortly") from None

    async def routing_counts(self) -> dict[str, int]:
        """The app's prefix-router decisions (shared by its ingress replicas)."""
        return await prefix_index.routing_counts(serve.get_replica_context().app_name)

    async def engine_client(self) -> Any:
        return await self.handle.engine_client.remote()

    def close(self) -> None:
        for router in self.routers.values():
            router.close()
