"""merge_streams: interleave several requests' output streams (one completion, several prompts)."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from nvray.outputs import RequestOutput


async def merge_streams(streams: list[AsyncIterator[RequestOutput]], firsts: list[RequestOutput]
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (choice index, output), first outputs first."""
    for index, out in enumerate(firsts):
        yield index, out
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((index, out))
            await queue.put((index, None))
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            await queue.put((index, e))

    pending = [i for i, out in enumerate(firsts) if not out.finished]
    tasks = [asyncio.ensure_future(pump(i, streams[i])) for i in pending]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for t in tasks:
            t.cancel()
