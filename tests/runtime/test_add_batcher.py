"""AddBatcher, the consumer side's queue of ``add_requests`` calls: one call in flight at a
time, requests added meanwhile leave together in the next call and each caller gets exactly its
own requests' results; a caller cancelled before its requests left takes them out (they never
reach the engine); a failed call fails exactly the callers whose requests it carried."""

from __future__ import annotations

import asyncio

import pytest

from nvray.request import EngineRequest


class RecordingDriver:
    """Stands in for the driver's reply to ``add_requests``: each request's prompt length,
    after a delay, so that later adds queue behind the call in flight."""

    def __init__(self, fail_call: int | None = None) -> None:
        self.calls: list[list[str]] = []
        self.fail_call = fail_call

    async def add_requests(self, requests: list[EngineRequest]) -> list[int]:
        self.calls.append([r.request_id for r in requests])
        await asyncio.sleep(0.05)
        if len(self.calls) - 1 == self.fail_call:
            raise RuntimeError("the driver is gone")
        return [len(r.prompt) for r in requests]


def requests_of(name: str, count: int) -> list[EngineRequest]:
    return [EngineRequest([1] * (len(name) + i), None, f"{name}-{i}") for i in range(count)]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_adds_during_a_call_leave_together_and_each_caller_gets_its_own_results():
    from nvray.runtime.output_router import AddBatcher

    async def main():
        driver = RecordingDriver()
        batcher = AddBatcher(driver.add_requests)
        callers = {f"c{k}": requests_of(f"c{k}", 1 + k % 3) for k in range(12)}
        first = asyncio.ensure_future(batcher.submit(callers["c0"]))
        await asyncio.sleep(0.01)  # its call is in flight: the others queue behind it
        rest = await asyncio.gather(*(batcher.submit(callers[f"c{k}"]) for k in range(1, 12)))
        return driver.calls, dict(zip(callers, [await first, *rest])), callers

    calls, results, callers = run(main())
    assert len(calls) == 2  # the first caller's call, then everyone who came meanwhile
    assert sorted(rid for call in calls for rid in call) == sorted(
        r.request_id for reqs in callers.values() for r in reqs)
    for name, reqs in callers.items():
        assert results[name] == [len(r.prompt) for r in reqs]


def test_a_caller_cancelled_before_its_call_left_never_reaches_the_driver():
    from nvray.runtime.output_router import AddBatcher

    async def main():
        driver = RecordingDriver()
        batcher = AddBatcher(driver.add_requests)
        first = asyncio.ensure_future(batcher.submit(requests_of("first", 1)))
        await asyncio.sleep(0.01)  # its call is in flight
        queued = [asyncio.ensure_future(batcher.submit(requests_of(f"q{k}", 2))) for k in range(3)]
        await asyncio.sleep(0.01)
        queued[1].cancel()
        done = await asyncio.gather(first, *queued, return_exceptions=True)
        return driver.calls, done

    calls, done = run(main())
    assert isinstance(done[2], asyncio.CancelledError)
    assert calls == [["first-0"], ["q0-0", "q0-1", "q2-0", "q2-1"]]
    assert done[1] == [2, 3] and done[3] == [2, 3]


def test_a_failed_call_fails_its_callers_and_the_next_call_goes_on():
    from nvray.runtime.output_router import AddBatcher

    async def main():
        driver = RecordingDriver(fail_call=0)
        batcher = AddBatcher(driver.add_requests)
        first = asyncio.ensure_future(batcher.submit(requests_of("first", 1)))
        await asyncio.sleep(0.01)
        later = asyncio.ensure_future(batcher.submit(requests_of("later", 1)))
        return await asyncio.gather(first, later, return_exceptions=True)

    first, later = run(main())
    assert isinstance(first, RuntimeError) and "driver is gone" in str(first)
    assert later == [len("later")]


@pytest.mark.parametrize("cancel_after_s", [0.0, 0.02])
def test_cancelled_in_flight_or_queued_the_batcher_stays_usable(cancel_after_s):
    """A caller cancelled while its call is in flight still lets the call finish for the others
    (the call is shared), and later adds go out as usual."""
    from nvray.runtime.output_router import AddBatcher

    async def main():
        driver = RecordingDriver()
        batcher = AddBatcher(driver.add_requests)
        a = asyncio.ensure_future(batcher.submit(requests_of("a", 1)))
        b = asyncio.ensure_future(batcher.submit(requests_of("bb", 1)))
        await asyncio.sleep(cancel_after_s)
        a.cancel()
        results = await asyncio.gather(a, b, return_exceptions=True)
        after = await batcher.submit(requests_of("ccc", 1))
        return results, after

    (a, b), after = run(main())
    assert isinstance(a, asyncio.CancelledError)
    assert b == [2] and after == [3]
