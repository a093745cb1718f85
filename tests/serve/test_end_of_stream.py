"""The end of a stream whose client left before its body began: Starlette runs the response's
background task, which gives the engine back. The lease's admission slot is an
``asyncio.Semaphore``; releasing it from a worker thread (where Starlette runs a plain function)
wakes a waiting request off its event loop, which asyncio's debug mode refuses."""

from __future__ import annotations

import asyncio
import threading

from deployments.admission import AdmissionGate
from deployments.engines import Lease
from deployments.server import end_stream_task


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


def test_the_end_of_a_stream_gives_its_slot_back_on_the_event_loop():
    # in a thread of its own, bounded: a slot released off the loop wedges the waiting request
    # (and with it the loop's run) instead of raising in the test
    result: list = []
    run = threading.Thread(daemon=True, target=lambda: result.append(asyncio.run(
        _a_waiter_gets_the_slot_of_a_stream_that_never_began(), debug=True)))
    run.start()
    run.join(timeout=15)
    assert not run.is_alive(), "the waiting request never got the slot back"
    assert result == [(1, True)]
