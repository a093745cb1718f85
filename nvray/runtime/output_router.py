"""OutputRouter: the consumer side of an engine's output channel (see ``runtime/driver.py``).

One router per consumer process (a Serve replica, an ``LLM``, a batch actor, an
``EngineClient``) keeps ONE streaming subscription to the driver open and fans each step's
message out to the requests it carries. ``add`` queues requests and returns a ``RequestSink``
that collects their outputs; a sink never blocks the router, so a reader that stops reading
stalls nobody else, and a reader that falls behind finds its outputs waiting, to be read all
at once (``coalesce``). No timer anywhere: an output is readable as soon as its step's
message arrives.

All methods run on one asyncio event loop (the replica's, or a SyncRouter's thread).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
import dataclasses
from typing import Any

from nvray.outputs import RequestOutput, coalesce, from_wire
from nvray.request import EngineRequest
from nvray.runtime.errors import EngineDeadError
from nvray.sampling_params import num_choices

logger = logging.getLogger(__name__)
# Steps the driver may run ahead of a slow consumer before its messages merge (Ray-side buffer).
_MESSAGES_IN_FLIGHT = 4


class RequestSink:
    """The outputs of one caller's requests (the choices of one HTTP request, a batch, ...).

    Outputs are kept per slot until read: one slot per request, or ``n`` consecutive slots for
    a request with ``n`` choices (slot = the request's first slot + the output's ``index``).
    ``request_ids[i]`` is slot ``i``'s request; ``errors[i]`` why it failed (rejected at
    admission, or the engine died), else None; ``num_prompt_tokens[i]`` its prompt's length
    once admitted.

    ``abort`` ends the sink's unfinished requests. Their ids stay routed to it, and in use,
    until the engine's final output for each arrives (the sink drops their outputs): an id is
    free for another request only once the engine has ended the aborted one, so a request that
    reuses it never receives the aborted one's outputs.
    """

    def __init__(self, router: "OutputRouter", request_ids: list[str]) -> None:
        self.router = router
        self.request_ids = request_ids
        self.pending: list[tuple[int, RequestOutput]] = []
        self.ready = asyncio.Event()
        self.finals: list[RequestOutput | None] = [None] * len(request_ids)
        self.errors: list[BaseException | None] = [None] * len(request_ids)
        self.num_prompt_tokens = [0] * len(request_ids)
        self.num_open = len(request_ids)
        self.aborted = False
        self.holding = False  # next_batch waits out not_before: only an end wakes it
        self.open_slots: dict[str, int] = {}  # request_id -> its slots still open
        for rid in request_ids:
            self.open_slots[rid] = self.open_slots.get(rid, 0) + 1

    # ------------------------------------------------------------- router side
    def push(self, index: int, out: RequestOutput) -> None:
        if out.finished:
            self._close(index)
        if self.aborted:  # nobody reads it: drop the output
            self.ready.set()
            return
        if out.finished:
            if out.finish_reason == "error":
                self.errors[index] = EngineDeadError(out.error or "engine failed")
                self.ready.set()
                return
            self.finals[index] = out
        self.pending.append((index, out))
        if out.finished or not self.holding:
            self.ready.set()

    def fail(self, index: int, error: BaseException) -> None:
        if self.finals[index] is None and self.errors[index] is None:
            self._close(index)
            self.errors[index] = error
            self.ready.set()

    def _close(self, index: int) -> None:
        self.num_open -= 1
        rid = self.request_ids[index]
        self.open_slots[rid] -= 1
        if not self.open_slots[rid]:
            self._unroute(rid)

    def _unroute(self, request_id: str) -> None:
        if self.router.sinks.get(request_id, (None,))[0] is self:
            del self.router.sinks[request_id]

    # ------------------------------------------------------------- reader side
    @property
    def done(self) -> bool:
        return self.num_open == 0

    async def next_batch(self, timeout: float | None = None, not_before: float | None = None
                         ) -> list[tuple[int, RequestOutput]]:
        """Everything that arrived since the last call, coalesced per request (waits for at
        least one output, TimeoutError after ``timeout`` s with nothing taken); [] once every
        request has ended and all was read. Raises the first request error.

        ``not_before`` (the event loop's clock): outputs that come earlier wait, merged, until
        then; an end (a final output, an error, every request done) is never held."""
        async with asyncio.timeout(timeout):
            while not self.pending and not self.done and not any(self.errors):
                self.ready.clear()
                await self.ready.wait()
            if not_before is not None:
                await self._hold_until(not_before)
        if any(self.errors):
            raise next(e for e in self.errors if e is not None)
        batch, self.pending = self.pending, []
        return coalesce_by_index(batch)

    async def _hold_until(self, when: float) -> None:
        if self.done or any(self.errors) or any(out.finished for _, out in self.pending):
            return
        self.holding = True
        self.ready.clear()
        try:
            async with asyncio.timeout_at(when):
                await self.ready.wait()
        except TimeoutError:
            pass
        finally:
            self.holding = False

    async def results(self, timeout: float | None = None) -> list[RequestOutput | BaseException]:
        """Per request, its final output or the error it ended with (waits for all)."""
        async with asyncio.timeout(timeout):
            while not self.done:
                self.ready.clear()
                await self.ready.wait()
        self.pending.clear()
        return [f if e is None else e for f, e in zip(self.finals, self.errors)]  # type: ignore[misc]

    def abort(self) -> None:
        """Abort every request of this sink that has not finished (fire and forget); their
        outputs are dropped from now on (see the class docstring)."""
        self.aborted = True
        open_ids = list(dict.fromkeys(rid for i, rid in enumerate(self.request_ids)
                                      if self.finals[i] is None and self.errors[i] is None))
        if open_ids:
            self.router.abort(open_ids)

    def forget(self) -> None:
        """Stop routing the sink's requests at once: the engine may never have received them
        (the call that queued them failed), so no final output may come to free their ids."""
        for rid in set(self.request_ids):
            self._unroute(rid)


def coalesce_by_index(batch: list[tuple[int, RequestOutput]]) -> list[tuple[int, RequestOutput]]:
    """One output per request index, in order of first appearance."""
    by_index: dict[int, list[RequestOutput]] = {}
    for index, out in batch:
        by_index.setdefault(index, []).append(out)
    return [(index, coalesce(outs)) for index, outs in by_index.items()]


class _QueuedAdd:
    def __init__(self, requests: list[EngineRequest]) -> None:
        self.requests = requests
        self.result: asyncio.Future = asyncio.get_running_loop().create_future()
        self.sent = False


class AddBatcher:
    """One ``add_requests`` call to the driver in flight at a time: requests added while one
    is on its way leave together in the next, so a burst of N requests costs the replica and the
    driver a few calls, not N (each call is a Ray task the driver runs beside its step loop).
    A lone request leaves at once.

    A caller cancelled before its requests left takes them out of the queue: they never reach
    the engine (an abort sent now would overtake them). Once sent, the caller aborts them as
    after any add; the abort follows the add on the same actor, so it finds them."""

    def __init__(self, send: Any) -> None:
        self._send = send  # requests -> awaitable of the driver's per-request results
        self._queue: list[_QueuedAdd] = []
        self._flusher: asyncio.Task | None = None

    async def submit(self, requests: list[EngineRequest]) -> list[Any]:
        queued = _QueuedAdd(requests)
        self._queue.append(queued)
        if self._flusher is None:
            # in a fresh context: the shared call is nobody's child task (see open_now)
            loop = asyncio.get_running_loop()
            self._flusher = contextvars.Context().run(loop.create_task, self._flush())
        try:
            return await asyncio.shield(queued.result)
        except asyncio.CancelledError:
            if not queued.sent:
                self._queue.remove(queued)
            raise

    async def _flush(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                for queued in batch:
                    queued.sent = True
                try:
                    results = await self._send([r for q in batch for r in q.requests])
                except BaseException as e:  # every caller of the call gets it
                    closed = isinstance(e, asyncio.CancelledError)  # the loop is closing
                    for queued in batch:
                        _settle(queued.result, error=_channel_closed() if closed else e)
                    if closed:
                        raise
                    continue
                start = 0
                for queued in batch:
                    end = start + len(queued.requests)
                    _settle(queued.result, results[start:end])
                    start = end
        finally:
            self._flusher = None
            for queued in self._queue:  # only if this task was cancelled (the loop is closing)
                _settle(queued.result, error=_channel_closed())


def _channel_closed() -> EngineDeadError:
    return EngineDeadError("the output channel was closed")


def _settle(future: asyncio.Future, value: Any = None, error: BaseException | None = None) -> None:
    if not future.done():
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)


class OutputRouter:
    def __init__(self, driver: Any) -> None:
        self.driver = driver
        self.consumer_id = f"consumer-{uuid.uuid4().hex}"
        self.sinks: dict[str, tuple[RequestSink, int]] = {}
        self.num_messages = 0  # step messages received, for stats and tests
        self.dead: BaseException | None = None
        self._subscription: asyncio.Task | None = None
        self._opening: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stream: Any = None  # the driver's subscription (an ObjectRefGenerator)
        self._adds = AddBatcher(lambda requests: self.driver.add_requests.remote(
            self.consumer_id, requests))

    def open_now(self) -> None:
        """Open the channel from synchronous code (blocks until the driver has it).

        A Ray call made while serving a request is that request's child task, and Ray cancels
        children with their parent: a subscription opened by the first request would end when
        that request is cancelled (its client went away), failing everyone else's. A Serve
        replica therefore opens its channel here, in its constructor."""
        import ray  # noqa: PLC0415

        ray.get(self.driver.open_channel.remote(self.consumer_id))
        self._stream = self._subscribe()

    def _subscribe(self) -> Any:
        return self.driver.subscribe.options(
            num_returns="streaming", _generator_backpressure_num_objects=_MESSAGES_IN_FLIGHT
        ).remote(self.consumer_id)

    async def _ensure_open(self) -> None:
        if self.dead is not None:
            raise self.dead
        if self._opening is None:
            self._loop = asyncio.get_running_loop()
            # In a fresh context: Ray tells an async actor's tasks apart by a context variable,
            # so a subscription opened from inside a request would be that request's child
            # task and end when it is cancelled (see open_now); opened here, it is nobody's.
            self._opening = contextvars.Context().run(self._loop.create_task, self._open())
        try:
            await asyncio.shield(self._opening)
        except Exception:
            self._opening = None  # e.g. the driver was busy starting: the next call retries
            raise

    async def _open(self) -> None:
        if self._stream is None:
            await self.driver.open_channel.remote(self.consumer_id)
            self._stream = self._subscribe()
        self._subscription = asyncio.ensure_future(self._route(self._stream))

    async def _route(self, stream: Any) -> None:
        try:
            async for ref in stream:
                message = await ref
                self.num_messages += 1
                for item in message:
                    self._dispatch(from_wire(item))
            reason: BaseException = EngineDeadError("the engine closed its output channel")
        except asyncio.CancelledError:
            reason = _channel_closed()
        except Exception as e:  # noqa: BLE001 - the driver died or the channel broke
            reason = e if isinstance(e, EngineDeadError) else EngineDeadError(
                f"the engine's driver is gone ({type(e).__name__})")
        self._fail_all(reason)

    def _dispatch(self, out: RequestOutput) -> None:
        entry = self.sinks.get(out.request_id)
        if entry is not None:
            entry[0].push(entry[1] + out.index, out)

    def _fail_all(self, error: BaseException) -> None:
        self.dead = error
        for sink, index in list(self.sinks.values()):
            sink.fail(index, error)
        self.sinks.clear()

    async def add(self, requests: list[EngineRequest], stream: bool = False,
                  all_or_nothing: bool = True) -> RequestSink:
        """Queue ``requests``; their outputs collect in the returned sink.

        ``all_or_nothing``: if the engine rejects one, the others are aborted and its
        ValueError is raised; otherwise rejected requests show in ``sink.errors``.
        """
        await self._ensure_open()
        ids = [r.request_id or uuid.uuid4().hex for r in requests]
        taken = next((rid for rid in ids if rid in self.sinks), None)
        if taken is not None or len(set(ids)) < len(ids):
            raise ValueError(f"request_id {taken or 'given twice'!r} is already in use")
        counts = [num_choices(r.params) for r in requests]
        firsts = [sum(counts[:i]) for i in range(len(counts))]
        sink = RequestSink(self, [rid for rid, n in zip(ids, counts) for _ in range(n)])
        for rid, first in zip(ids, firsts):  # before the call: outputs may come before its reply
            self.sinks[rid] = (sink, first)
        named = [dataclasses.replace(r, request_id=rid, stream=stream)
                 for rid, r in zip(ids, requests)]
        try:
            added_or_errors = await self._adds.submit(named)
        except BaseException:
            sink.abort()
            sink.forget()
            raise
        for first, n, added in zip(firsts, counts, added_or_errors):
            for slot in range(first, first + n):
                if isinstance(added, BaseException):
                    sink.fail(slot, added)
                else:
                    sink.num_prompt_tokens[slot] = added
        rejected = next((e for e in added_or_errors if isinstance(e, BaseException)), None)
        if rejected is not None and all_or_nothing:
            sink.abort()
            raise rejected
        return sink

    def abort(self, request_ids: list[str]) -> None:
        """Fire and forget, from a fresh context: an abort is often sent by a request that is
        being cancelled, and Ray cancels a cancelled task's child calls (see ``open_now``)."""
        contextvars.Context().run(self.driver.abort.remote, request_ids)

    def close(self) -> None:
        """End the subscription; the driver aborts whatever this consumer still has running.
        Callable from any thread."""
        if self._opening is not None or self._stream is not None:
            self.driver.close_channel.remote(self.consumer_id)
        if self._subscription is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._subscription.cancel)

    async def aclose(self) -> None:
        """``close``, and wait until the subscription task has ended."""
        self.close()
        if self._subscription is not None:
            self._subscription.cancel()
            await asyncio.gather(self._subscription, return_exceptions=True)
