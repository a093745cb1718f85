"""NvrayEngine: the engine deployment of the prefix-routed app — one replica = one whole engine.

The replica lives in bundle 0 of its own placement group (``nvray.runtime.placement``), beside
its EngineDriver and rank 0, so autoscaling adds and removes whole engines. It serves no HTTP:
the app's ingress (NvrayServer) leases it per request through the PrefixAwareRouter
(``deployments/routing/engines.py`` says how a lease works) and reaches its driver directly. Serve's
health check is the engine's.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from ray import serve

from deployments.args import AppArgs, parse_args
from deployments.routing.engines import LocalEngine


@serve.deployment
class NvrayEngine:
    def __init__(self, args: dict[str, Any] | AppArgs) -> None:
        self.args = parse_args(args)
        self.timeout = self.args.request_timeout_s
        self.engine = LocalEngine(self.args)

    async def lease(self, routing_key: str) -> AsyncIterator[tuple[str, Any]]:
        """Hold a slot of this engine for one request: yields (engine id, driver) once, then
        keeps the slot until the caller cancels the call (or the request time-out passes).
        ``routing_key`` is read by the caller's request router only."""
        lease = await self.engine.lease(routing_key, self.timeout)
        try:
            yield self.engine.engine_id, self.engine.driver
            await asyncio.sleep(self.timeout)
        finally:
            lease.release()

    async def describe(self) -> tuple[str, Any]:
        """(engine id, driver), without a slot: for stats."""
        return self.engine.engine_id, self.engine.driver

    async def info(self) -> dict[str, Any]:
        return await self.engine.info()

    async def tokenize(self, prompt: Any) -> list[int]:
        return await self.engine.tokenize(prompt)

    async def detokenize(self, tokens: list[int]) -> str:
        return await self.engine.detokenize(tokens)

    async def engine_client(self) -> Any:
        return await self.engine.engine_client()

    async def check_health(self) -> None:
        await self.engine.check_health()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
