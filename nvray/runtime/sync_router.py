"""SyncRouter: an OutputRouter for synchronous callers (EngineClient, LLM, batch actors).

It runs the router on a private event loop in a daemon thread; the caller's thread submits
coroutines to it and blocks on their results. ``close`` ends the subscription (the driver
aborts what is still running) and stops the thread.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Coroutine, Iterator, TypeVar

from nvray.outputs import RequestOutput
from nvray.request import EngineRequest
from nvray.runtime.output_router import OutputRouter, RequestSink

T = TypeVar("T")
_CLOSE_TIMEOUT_S = 5.0


class SyncSink:
    """A RequestSink read from a synchronous thread."""

    def __init__(self, router: "SyncRouter", sink: RequestSink) -> None:
        self.router = router
        self.sink = sink

    @property
    def request_ids(self) -> list[str]:
        return self.sink.request_ids

    def next_batch(self, timeout: float | None = None) -> list[tuple[int, RequestOutput]]:
        """As RequestSink.next_batch; raises TimeoutError if nothing came within ``timeout``."""
        return self.router.run(self.sink.next_batch(timeout))

    def outputs(self) -> Iterator[tuple[int, RequestOutput]]:
        try:
            while batch := self.next_batch():
                yield from batch
        finally:
            self.abort()  # the reader went away early: free what is still running

    def results(self, timeout: float | None = None) -> list[RequestOutput | BaseException]:
        return self.router.run(self.sink.results(timeout))

    def abort(self) -> None:
        self.router.loop.call_soon_threadsafe(self.sink.abort)


class SyncRouter:
    def __init__(self, driver: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="nvray-output-router",
                                       daemon=True)
        self.thread.start()
        self.router: OutputRouter = self.run(self._make(driver))

    @staticmethod
    async def _make(driver: Any) -> OutputRouter:
        return OutputRouter(driver)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the router's loop and wait for it (time-outs belong inside it)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def add(self, requests: list[EngineRequest], stream: bool = False,
            all_or_nothing: bool = True) -> SyncSink:
        return SyncSink(self, self.run(self.router.add(requests, stream, all_or_nothing)))

    async def _close_all(self) -> None:
        """Close the channel (waiting sinks fail), then end whatever still runs on the loop,
        so no thread stays blocked on it."""
        async with asyncio.timeout(_CLOSE_TIMEOUT_S):
            await self.router.aclose()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    def close(self) -> None:
        if not self.loop.is_running():
            return
        try:
            self.run(self._close_all())
        except Exception:  # noqa: BLE001 - a driver already gone is closed enough
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=_CLOSE_TIMEOUT_S)
