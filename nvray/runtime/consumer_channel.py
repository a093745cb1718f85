"""Driver-side sinks for request outputs: where the step loop puts each step's outputs.

The step loop thread groups a step's outputs by sink (an ``OutputSink``) and hands each sink
its share in ONE call (``deliver``), which crosses to the driver's event loop once, whatever the
number of requests.

A ``ConsumerChannel`` is the sink of all requests of one consumer (a Serve replica, an ``LLM``,
a batch actor, an ``EngineClient``). Outputs wait in a buffer until the consumer's long-lived
``subscribe`` stream takes them; everything that arrived meanwhile leaves as one message, so a
consumer that falls behind gets fewer, larger messages and never one per token per request.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Protocol

from nvray.outputs import RequestOutput, WireOutput, to_wire


class OutputSink(Protocol):
    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Called on the step loop thread with this sink's outputs of one step."""


class ConsumerChannel:
    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.pending: list[WireOutput] = []
        self.ready = asyncio.Event()
        self.closed = False
        self.num_messages = 0  # messages sent to the consumer, for stats and tests

    def deliver(self, outputs: list[RequestOutput]) -> None:
        items = [to_wire(o) for o in outputs]
        self.loop.call_soon_threadsafe(self._extend, items)

    def _extend(self, items: list[WireOutput]) -> None:
        self.pending.extend(items)
        self.ready.set()

    def close(self) -> None:
        self.closed = True
        self.ready.set()

    async def messages(self) -> AsyncIterator[list[WireOutput]]:
        """Everything pending, as one message, each time something arrived; ends on close."""
        while True:
            await self.ready.wait()
            self.ready.clear()
            items, self.pending = self.pending, []
            if items:
                self.num_messages += 1
                yield items
            if self.closed:
                return
