"""The end of a stream whose client left before its body began: Starlette runs the response's
background task, which gives the engine back. The lease's admission slot is an
``asyncio.Semaphore``; releasing it from a worker thread (where Starlette runs a plain function)
wakes a waiting request off its event loop, which asyncio's debug mode refuses. Checked on the
task itself, and on the app's streaming response as Starlette runs it when its client left."""

from __future__ import annotations

import asyncio
import threading

from deployments.routing.admission import AdmissionGate
from deployments.routing.engines import Lease
from deployments.ingress.server import end_stream_task


class _Sink:
    """The stream's requests, as far as ending it goes: aborted once."""

    def __init__(self) -> None:
        self.aborted = 0

    def abort(self) -> None:
        self.aborted += 1


async def _a_waiter_gets_the_slot_of_a_stream_that_never_began() -> tuple[int, bool]:
    gate = AdmissionGate(max_running=1, max_waiting=1)
    ticket = await gate.enter(timeout_s=5)
    waiter = asyncio.create_task(gate.enter(timeout_s=5))
    await asyncio.sleep(0)  # the second request now waits for the slot
    sink = _Sink()
    await end_stream_task(sink, Lease(router=None, _release=ticket.release))()
    second = await asyncio.wait_for(waiter, 5)
    second.release()
    return sink.aborted, gate.num_running == 0


def _run_in_debug_mode_bounded(scenario) -> list:
    """``scenario()`` under asyncio's debug mode, in a thread of its own, bounded: a slot
    released off the loop wedges the waiting request (and with it the loop's run) instead of
    raising in the test."""
    result: list = []
    run = threading.Thread(daemon=True, target=lambda: result.append(asyncio.run(
        scenario(), debug=True)))
    run.start()
    run.join(timeout=15)
    assert not run.is_alive(), "the waiting request never got the slot back"
    return result


def test_the_end_of_a_stream_gives_its_slot_back_on_the_event_loop():
    assert _run_in_debug_mode_bounded(_a_waiter_gets_the_slot_of_a_stream_that_never_began) == [
        (1, True)]


class _Router:
    """Adds a stream's requests; hands back the sink that ends them."""

    def __init__(self, sink: _Sink) -> None:
        self.sink = sink

    async def add(self, requests: list, stream: bool) -> _Sink:
        return self.sink


class _Replica:
    """The parts of the app's replica that a streaming response reads: its engine lease (a slot
    of a real ``AdmissionGate``) and the SSE body, which never yields (the client leaves first)."""

    def __init__(self, gate: AdmissionGate, sink: _Sink) -> None:
        self.gate, self.sink = gate, sink

    async def _lease(self, prompts: list, lora: object = None) -> Lease:
        ticket = await self.gate.enter(timeout_s=5)
        return Lease(router=_Router(self.sink), _release=ticket.release)

    async def _sse_body(self, *args: object):
        await asyncio.Event().wait()
        yield "never"


async def _a_waiter_gets_the_slot_of_a_streaming_response_whose_client_left() -> tuple[int, bool]:
    from types import SimpleNamespace

    from deployments.ingress.server import NvrayServer

    gate, sink = AdmissionGate(max_running=1, max_waiting=1), _Sink()
    body = SimpleNamespace(priority=0, include_usage=False, continuous_usage=False)
    stream = NvrayServer.func_or_class._streaming_response  # the class under @serve.deployment
    response = await stream(_Replica(gate, sink), ["hi"], None, None, body)
    waiter = asyncio.create_task(gate.enter(timeout_s=5))
    await asyncio.sleep(0)  # the next request waits for the stream's slot
    # ASGI 2.3, as uvicorn speaks and Serve passes on: Starlette listens for the disconnect
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "method": "POST",
             "headers": []}

    async def receive() -> dict:
        return {"type": "http.disconnect"}  # the client is gone before the body begins

    async def send(message: dict) -> None:
        pass

    await asyncio.wait_for(response(scope, receive, send), 5)  # Starlette runs the end task
    second = await asyncio.wait_for(waiter, 5)
    second.release()
    return sink.aborted, gate.num_running == 0


def test_a_streaming_response_whose_client_left_gives_its_slot_back_on_the_event_loop():
    # the app's own streaming response, run by Starlette as Serve runs it
    assert _run_in_debug_mode_bounded(
        _a_waiter_gets_the_slot_of_a_streaming_response_whose_client_left) == [(1, True)]
