"""ClientLeft: an ASGI middleware that tells the app a client left the way ASGI says it.

When a client disconnects, Ray Serve cancels its request: the next ``receive()`` raises Ray's
``TaskCancelledError`` instead of returning ``{"type": "http.disconnect"}``. A streaming
response reads ``receive()`` to watch for the disconnect (Starlette's ``listen_for_disconnect``),
so the error escaped the app and asyncio logged "Task exception was never retrieved" with a
traceback for every stream cut short. Here ``receive()`` answers ``http.disconnect`` instead: the
response stops the way it does for any client that leaves (its generator is closed, its request
aborted), and the log stays clean. Errors raised by route handlers are mapped in ``errors.py``.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from ray.exceptions import TaskCancelledError

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]

DISCONNECT: Message = {"type": "http.disconnect"}


class ClientLeft:
    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def receive_or_disconnect() -> Message:
            try:
                return await receive()
            except TaskCancelledError:  # Serve cancelled the request: its client left
                return DISCONNECT

        await self.app(scope, receive_or_disconnect, send)
