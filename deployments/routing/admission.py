"""AdmissionGate: a replica's limit on the requests it runs and lets wait, refused in JSON.

Serve's own ``max_queued_requests`` refuses at the proxy with a plain-text 503, which OpenAI
clients cannot parse. So when the app bounds the queue (``max_queued_requests >= 0``), the
replica keeps the bound itself: at most ``max_running`` requests run (hold a slot), at most
``max_waiting`` more wait for one in arrival order, and any further request is refused at once
with a 503 OpenAI error (``code: engine_overloaded``, ``Retry-After: 1``). Serve is then told to
route up to ``serve_limit()`` requests to a replica and to queue the rest without refusing, so
every refusal a client sees comes from here. A waiting request that is cancelled (its client
went away) or waits past its deadline leaves the queue; a slot is always given back.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from deployments.ingress.errors import OpenAIError

_OVERFLOW_MARGIN = 8  # requests Serve may route beyond running + waiting: each refused at once


class Overloaded(OpenAIError):
    def __init__(self, running: int, waiting: int) -> None:
        super().__init__(503, f"the engine is overloaded ({running} requests running, {waiting} "
                              "waiting); retry shortly", code="engine_overloaded")

    def response(self, path: str = ""):  # noqa: ANN201 - a JSONResponse
        response = super().response(path)
        response.headers["Retry-After"] = "1"
        return response


class Ticket:
    """A held slot; ``release`` gives it back once, however often it is called."""

    def __init__(self, gate: "AdmissionGate") -> None:
        self.gate: AdmissionGate | None = gate

    def release(self) -> None:
        gate, self.gate = self.gate, None
        if gate is not None:
            gate.num_running -= 1
            gate.slots.release()


class AdmissionGate:
    def __init__(self, max_running: int, max_waiting: int) -> None:
        self.max_running, self.max_waiting = max_running, max_waiting
        self.slots = asyncio.Semaphore(max_running)
        self.num_running = 0
        self.num_waiting = 0
        self.num_refused = 0

    @staticmethod
    def serve_limit(max_running: int, max_waiting: int) -> int:
        """Serve's max_ongoing_requests for a gated replica: room for those running, those
        waiting and a margin of overflow that gets its 503 here."""
        return max_running + max_waiting + max(_OVERFLOW_MARGIN, max_running + max_waiting)

    async def enter(self, timeout_s: float) -> Ticket:
        """Take a slot, waiting at most ``timeout_s``; raise Overloaded if the queue is full."""
        if self.slots.locked():
            if self.num_waiting >= self.max_waiting:
                self.num_refused += 1
                raise Overloaded(self.num_running, self.num_waiting)
            self.num_waiting += 1
            try:
                async with asyncio.timeout(timeout_s):
                    await self.slots.acquire()
            finally:
                self.num_waiting -= 1
        else:
            await self.slots.acquire()
        self.num_running += 1
        return Ticket(self)

    @contextlib.asynccontextmanager
    async def slot(self, timeout_s: float) -> AsyncIterator[None]:
        ticket = await self.enter(timeout_s)
        try:
            yield
        finally:
            ticket.release()
