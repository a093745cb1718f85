"""EngineLoop: runs LLMEngine.step in a dedicated thread while requests exist.

Callers live on an asyncio event loop (the driver actor). They never touch the engine: they
post commands (add, abort, stats) that the loop thread runs between steps, and receive each
request's outputs on an asyncio.Queue. If a step fails (a rank died), every request gets an
error output, the loop records why and refuses new requests; nothing accepted is left hanging.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from typing import Any, Callable

from nvray.engine.engine import LLMEngine
from nvray.outputs import RequestOutput
from nvray.runtime.errors import EngineDeadError

logger = logging.getLogger(__name__)
_IDLE_WAIT_S = 0.05


class RequestStream:
    """Where one request's outputs go: an asyncio.Queue on the caller's event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

    def put(self, out: RequestOutput) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, out)


class EngineLoop:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = \
            queue.SimpleQueue()
        self.wakeup = threading.Event()
        self.streams: dict[str, RequestStream] = {}
        self.dead: str | None = None
        self.stopping = False
        self.step_times: list[float] = []  # recent step durations (s), for stats
        self.thread = threading.Thread(target=self._run, name="nvray-engine-loop", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------ caller side
    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn`` on the loop thread between steps; returns a future of its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self.dead:
            fut.set_exception(EngineDeadError(self.dead))
            return fut
        self.commands.put((fn, fut))
        self.wakeup.set()
        return fut

    async def add(self, request_id: str, prompt: Any, params: Any, priority: int,
                  stream: bool) -> RequestStream:
        """Queue a request (ValueError if invalid); returns the stream its outputs arrive on."""
        sink = RequestStream()

        def add_on_loop() -> None:
            self.engine.add_request(request_id, prompt, params, priority, stream)
            self.streams[request_id] = sink

        await asyncio.wrap_future(self.call(add_on_loop))
        return sink

    def abort(self, request_id: str) -> concurrent.futures.Future:
        return self.call(lambda: self._deliver([o for o in [self.engine.abort_request(request_id)] if o]))

    def stop(self) -> None:
        self.stopping = True
        self.wakeup.set()
        self.thread.join(timeout=10)

    # -------------------------------------------------------------- loop side
    def _run(self) -> None:
        while not self.stopping:
            self._run_commands()
            if self.dead or not self.engine.has_unfinished_requests():
                self.wakeup.wait(_IDLE_WAIT_S)
                self.wakeup.clear()
                continue
            start = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - a failed step kills the engine, not the actor
                self.fail(str(e) if isinstance(e, EngineDeadError) else f"{type(e).__name__}: {e}")
                continue
            self.step_times.append(time.perf_counter() - start)
            del self.step_times[:-256]
            self._deliver(outputs)

    def _run_commands(self) -> None:
        while True:
            try:
                fn, fut = self.commands.get_nowait()
            except queue.Empty:
                return
            if self.dead:
                fut.set_exception(EngineDeadError(self.dead))
            elif fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            sink = self.streams.pop(out.request_id) if out.finished else self.streams.get(out.request_id)
            if sink is not None:
                sink.put(out)

    def fail(self, reason: str) -> None:
        """Mark the engine dead (loop thread only): error every request, refuse new ones."""
        if self.dead:
            return
        self.dead = reason
        logger.error("engine failed: %s", reason)
        self._deliver(self.engine.fail_all(f"engine failed: {reason}"))
