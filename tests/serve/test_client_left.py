"""A client that leaves a stream: Serve cancels its request and the next ASGI ``receive()``
raises TaskCancelledError. The app must end the stream as for any disconnect (its generator
closed) instead of letting the error escape (asyncio then logged "Task exception was never
retrieved" with a traceback per cut stream, seen at the end of an H100 scale-up run)."""

from __future__ import annotations

import asyncio

import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from ray.exceptions import TaskCancelledError

from deployments.ingress.client_left import ClientLeft


def streaming_app(closed: list[str]) -> FastAPI:
    app = FastAPI()

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def events():
            try:
                while True:
                    yield b"data: token\n\n"
                    await asyncio.sleep(0.01)
            finally:
                closed.append("generator closed")
        return StreamingResponse(events(), media_type="text/event-stream")

    return app


async def serve_one_stream(app) -> list[dict]:
    """Drive ``app`` as Serve does for a GET whose client leaves after 5 chunks."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
             "scheme": "http", "path": "/stream", "raw_path": b"/stream", "query_string": b"",
             "root_path": "", "headers": [], "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    sent: list[dict] = []
    left = asyncio.Event()

    async def receive() -> dict:
        await left.wait()  # the request has no body; the next message is the client leaving
        raise TaskCancelledError()

    async def send(message: dict) -> None:
        sent.append(message)
        if sum(m.get("type") == "http.response.body" for m in sent) == 5:
            left.set()

    await asyncio.wait_for(app(scope, receive, send), timeout=10)
    return sent


def test_a_client_leaving_a_stream_closes_it_without_an_escaping_error():
    closed: list[str] = []
    sent = asyncio.run(serve_one_stream(ClientLeft(streaming_app(closed))))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert closed == ["generator closed"]


def test_without_the_middleware_the_cancellation_escapes():  # what the middleware is for
    with pytest.raises(TaskCancelledError):
        asyncio.run(serve_one_stream(streaming_app([])))


def test_the_app_serves_through_the_middleware():
    from deployments.ingress.server import api

    assert any(m.cls is ClientLeft for m in api.user_middleware)
