"""EngineLoop: runs LLMEngine.step in a dedicated thread while requests exist.

Callers live on an asyncio event loop (the driver actor). They never touch the engine: they
post commands (add, abort, stats) that the loop thread runs between steps. Each request names
the sink its outputs go to (``consumer_channel``); after every step the loop hands each sink
its outputs of that step in one call, so the cost of delivery per step grows with the number
of consumers, not of requests. After a second without requests or commands the loop tells the
executor it is idle (the ranks stop polling for steps). If a step fails (a rank died), every request gets an error
output, the loop records why and refuses new requests; nothing accepted is left hanging.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from typing import Any, Callable

from nvray.engine.engine import LLMEngine
from nvray.outputs import RequestOutput
from nvray.request import EngineRequest
from nvray.runtime.consumer_channel import OutputSink
from nvray.runtime.errors import EngineDeadError

logger = logging.getLogger(__name__)
_IDLE_WAIT_S = 1.0  # only a bound: commands wake the loop at once


class EngineLoop:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = \
            queue.SimpleQueue()
        self.wakeup = threading.Event()
        self.sinks: dict[str, OutputSink] = {}
        self.dead: str | None = None
        self.stopping = False
        self.step_times: list[float] = []  # recent step durations (s), for stats
        self.num_steps = 0
        self.idle = False  # the executor was told so, and no step ran since
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

    def add(self, requests: list[EngineRequest], sink: OutputSink) -> concurrent.futures.Future:
        """Queue requests whose outputs go to ``sink``; the future holds, per request, its
        number of prompt tokens or the ValueError that rejected it (then it is not queued)."""
        return self.call(lambda: [self._add_one(r, sink) for r in requests])

    def _add_one(self, request: EngineRequest, sink: OutputSink) -> int | ValueError:
        try:
            token_ids = self.engine.add_request(request.request_id, request.prompt,
                                                request.params, request.priority, request.stream,
                                                lora_request=request.lora_request)
        except ValueError as e:
            return e
        self.sinks[request.request_id] = sink
        return len(token_ids)

    def abort(self, request_ids: list[str]) -> concurrent.futures.Future:
        return self.call(lambda: self._deliver(
            [o for rid in request_ids for o in self.engine.abort_request(rid)]))

    def abort_sink(self, sink: OutputSink) -> concurrent.futures.Future:
        """Abort every request whose outputs go to ``sink`` (its consumer went away)."""
        return self.call(lambda: self._deliver([
            o for rid, s in list(self.sinks.items()) if s is sink
            for o in self.engine.abort_request(rid)]))

    def stop(self) -> None:
        self.stopping = True
        self.wakeup.set()
        self.thread.join(timeout=10)

    # -------------------------------------------------------------- loop side
    def _run(self) -> None:
        while not self.stopping:
            self.wakeup.clear()  # before draining: a command posted after this wakes the wait
            self._run_commands()
            if self.dead or not self.engine.has_unfinished_requests():
                if not self.wakeup.wait(_IDLE_WAIT_S) and not self.dead and not self.idle:
                    self.idle = True  # a whole wait without a command: let the ranks rest
                    self.engine.executor.idle()
                continue
            self.idle = False
            start = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - a failed step kills the engine, not the actor
                self.fail(str(e) if isinstance(e, EngineDeadError) else f"{type(e).__name__}: {e}")
                continue
            self.step_times.append(time.perf_counter() - start)
            del self.step_times[:-256]
            self.num_steps += 1
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
        """Hand each sink its share of ``outputs`` in one call."""
        by_sink: dict[int, tuple[OutputSink, list[RequestOutput]]] = {}
        for out in outputs:
            sink = self.sinks.get(out.request_id)
            if sink is not None:
                by_sink.setdefault(id(sink), (sink, []))[1].append(out)
        for rid in {out.request_id for out in outputs if out.finished}:
            if rid not in self.engine.requests:  # its last choice finished
                self.sinks.pop(rid, None)
        for sink, outs in by_sink.values():
            sink.deliver(outs)

    def fail(self, reason: str) -> None:
        """Mark the engine dead (loop thread only): error every request, refuse new ones."""
        if self.dead:
            return
        self.dead = reason
        logger.error("engine failed: %s", reason)
        self._deliver(self.engine.fail_all(f"engine failed: {reason}"))
