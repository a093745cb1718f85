"""A replica's admission gate (``deployments/routing/admission.py``) on its own, in one event
loop: at most ``max_running`` requests hold a slot, at most ``max_waiting`` more wait for one in
arrival order, the next is refused at once with OpenAI's 503 (``engine_overloaded``,
``Retry-After: 1``), a waiter that is cancelled or waits past its deadline leaves the queue,
and a slot is given back exactly once however the request ends. (The app's HTTP tests,
``test_edges.py``, see the same gate through Serve.)"""

from __future__ import annotations

import asyncio
import json

import pytest

from deployments.routing.admission import AdmissionGate, Overloaded

_WAIT_S = 5.0  # a waiter's deadline where the test does not mean it to expire


async def _settle() -> None:
    """Let every task that can run do so (the waiters reach their semaphore)."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_full_gate_queues_max_waiting_in_arrival_order_and_refuses_the_next() -> None:
    async def scenario() -> None:
        gate = AdmissionGate(max_running=2, max_waiting=2)
        held = [await gate.enter(_WAIT_S), await gate.enter(_WAIT_S)]
        admitted: list[str] = []

        async def wait(name: str):
            ticket = await gate.enter(_WAIT_S)
            admitted.append(name)
            return ticket

        first = asyncio.create_task(wait("first"))
        await _settle()
        second = asyncio.create_task(wait("second"))
        await _settle()
        assert (gate.num_running, gate.num_waiting, admitted) == (2, 2, [])

        with pytest.raises(Overloaded) as refused:
            await gate.enter(_WAIT_S)
        assert (gate.num_refused, gate.num_waiting) == (1, 2)
        response = refused.value.response("/v1/chat/completions")
        assert response.status_code == 503
        assert response.headers["Retry-After"] == "1"
        error = json.loads(response.body)["error"]
        assert error["code"] == "engine_overloaded"
        assert "2 requests running, 2 waiting" in error["message"]

        held[0].release()
        taken = await asyncio.wait_for(first, _WAIT_S)
        await _settle()
        assert admitted == ["first"] and not second.done()  # arrival order
        assert (gate.num_running, gate.num_waiting) == (2, 1)
        held[1].release()
        last = await asyncio.wait_for(second, _WAIT_S)
        assert admitted == ["first", "second"]
        taken.release()
        last.release()
        assert (gate.num_running, gate.num_waiting, gate.num_refused) == (0, 0, 1)

    asyncio.run(scenario())


def test_a_gate_with_a_free_slot_admits_at_once_and_one_without_waiting_room_refuses() -> None:
    async def scenario() -> None:
        gate = AdmissionGate(max_running=1, max_waiting=0)
        ticket = await asyncio.wait_for(gate.enter(0.01), 1.0)  # no wait: a slot is free
        assert (gate.num_running, gate.num_waiting) == (1, 0)
        for _ in range(2):
            with pytest.raises(Overloaded):
                await gate.enter(_WAIT_S)
        ticket.release()
        again = await asyncio.wait_for(gate.enter(0.01), 1.0)
        again.release()
        assert (gate.num_running, gate.num_refused) == (0, 2)  # every refusal counted

    asyncio.run(scenario())


def test_a_waiter_past_its_deadline_leaves_the_queue_and_takes_no_slot() -> None:
    async def scenario() -> None:
        gate = AdmissionGate(max_running=1, max_waiting=1)
        held = await gate.enter(_WAIT_S)
        late = asyncio.create_task(gate.enter(0.05))
        await asyncio.wait({late}, timeout=_WAIT_S)  # ends at its own deadline, long before
        assert late.done() and isinstance(late.exception(), TimeoutError)
        assert (gate.num_running, gate.num_waiting, gate.num_refused) == (1, 0, 0)
        waiter = asyncio.create_task(gate.enter(_WAIT_S))  # its place in the queue is free again
        await _settle()
        assert gate.num_waiting == 1
        held.release()
        (await asyncio.wait_for(waiter, _WAIT_S)).release()
        assert (gate.num_running, gate.num_waiting) == (0, 0)

    asyncio.run(scenario())


def test_a_cancelled_waiter_leaves_the_queue_and_the_slot_goes_to_the_next() -> None:
    async def scenario() -> None:
        gate = AdmissionGate(max_running=1, max_waiting=2)
        held = await gate.enter(_WAIT_S)
        gone = asyncio.create_task(gate.enter(_WAIT_S))
        await _settle()
        stays = asyncio.create_task(gate.enter(_WAIT_S))
        await _settle()
        assert gate.num_waiting == 2
        gone.cancel()  # its client went away
        await _settle()
        assert gone.cancelled() and gate.num_waiting == 1
        held.release()
        (await asyncio.wait_for(stays, _WAIT_S)).release()
        assert (gate.num_running, gate.num_waiting) == (0, 0)

    asyncio.run(scenario())


def test_a_slot_is_given_back_once_however_often_it_is_released() -> None:
    async def scenario() -> None:
        gate = AdmissionGate(max_running=1, max_waiting=1)
        ticket = await gate.enter(_WAIT_S)
        ticket.release()
        ticket.release()  # a second release gives nothing back
        assert gate.num_running == 0
        first = await gate.enter(_WAIT_S)
        second = asyncio.create_task(gate.enter(_WAIT_S))
        await _settle()
        assert not second.done() and gate.num_waiting == 1  # still one slot, not two
        first.release()
        (await asyncio.wait_for(second, _WAIT_S)).release()

    asyncio.run(scenario())


def test_the_slot_context_gives_the_slot_back_when_the_request_fails() -> None:
    async def scenario() -> None:
        gate = AdmissionGate(max_running=1, max_waiting=0)
        with pytest.raises(ValueError, match="the request failed"):
            async with gate.slot(_WAIT_S):
                assert gate.num_running == 1
                raise ValueError("the request failed")
        assert gate.num_running == 0
        async with gate.slot(0.01):  # free at once
            assert gate.num_running == 1
        assert gate.num_running == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("running,waiting", [(1, 0), (2, 2), (4, 0), (16, 64)])
def test_serve_routes_more_than_the_gate_holds_so_its_overflow_gets_the_gates_503(
        running, waiting) -> None:
    """Serve's limit for a gated replica leaves room for those running, those waiting and at
    least as many again (never fewer than 8), so a burst past the gate's bound reaches the
    gate and gets its JSON 503, not Serve's queue."""
    limit = AdmissionGate.serve_limit(running, waiting)
    assert limit >= running + waiting + 8
    assert limit >= 2 * (running + waiting)
