"""BodySizeLimit: an ASGI middleware answering 413 (OpenAI's error shape) to a request whose
body is larger than the limit, before anything reads it.

A body that declares its length (``Content-Length``) is refused up front; a chunked body is
counted as it arrives and refused once it passes the limit. It is a plain ASGI wrapper (not
Starlette's BaseHTTPMiddleware), so streaming responses and disconnect detection are untouched.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

MAX_REQUEST_BODY_BYTES = 16 * 2**20

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BodyTooLarge(Exception):
    pass


def too_large_body(limit: int) -> bytes:
    return json.dumps({"error": {"message": f"request body is larger than {limit} bytes",
                                 "type": "invalid_request_error", "param": None,
                                 "code": "request_too_large"}}).encode()


class _CountedBody:
    """One request's body, counted as the app reads it. Past the limit, reading raises
    BodyTooLarge, and whatever the app answers to that (FastAPI turns any error while it reads
    a body into its own 400) is dropped: the client gets the 413."""

    def __init__(self, receive: Receive, send: Send, limit: int) -> None:
        self._receive, self._send, self.limit = receive, send, limit
        self.seen = 0
        self.too_large = False
        self.answered = False  # the app's response began before the body passed the limit

    async def receive(self) -> Message:
        message = await self._receive()
        self.seen += len(message.get("body", b""))
        if self.seen > self.limit and not self.answered:
            self.too_large = True
            raise BodyTooLarge()
        return message

    async def send(self, message: Message) -> None:
        if self.too_large:
            return
        self.answered = True
        await self._send(message)


class BodySizeLimit:
    def __init__(self, app: Callable, limit: int = MAX_REQUEST_BODY_BYTES) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(send)
            return
        body = _CountedBody(receive, send, self.limit)
        try:
            await self.app(scope, body.receive, body.send)
        except Exception:
            if not body.too_large:  # else: the app's failure to read the body, answered below
                raise
        if body.too_large and not body.answered:
            await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        body = too_large_body(self.limit)
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
