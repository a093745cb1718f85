"""The request-body limit (``deployments/ingress/body_limit.py``) at the ASGI level, in front
of a FastAPI app that reads the body as the app's routes do: a body that declares a length over
the limit is refused with OpenAI's 413 before the app runs; a chunked body is counted as it
arrives and refused once past the limit, the app's own answer to the broken read dropped; a
body of exactly the limit, one under it and a non-HTTP scope pass; a response the app began
before the body passed the limit stands. (``test_edges.py`` sends the same bodies over HTTP.)"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import FastAPI, Request

from deployments.ingress.body_limit import BodySizeLimit

LIMIT = 1000


def _reading_app() -> tuple[FastAPI, list[int]]:
    """A FastAPI app answering the length of the body it read (and recording it)."""
    app, seen = FastAPI(), []

    @app.post("/v1/completions")
    async def read(request: Request) -> dict[str, int]:
        seen.append(len(await request.body()))
        return {"read": seen[-1]}

    return app, seen


def _call(app: Any, chunks: list[bytes], declared: int | None,
          scope_type: str = "http") -> list[dict[str, Any]]:
    """One request through ``app``: the body in ``chunks`` (declared with a Content-Length, or
    sent chunked), and the ASGI messages the client got back."""
    headers = [(b"content-type", b"application/json")]
    if declared is not None:
        headers.append((b"content-length", str(declared).encode()))
    scope = {"type": scope_type, "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path":
             b"/v1/completions", "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
    pending = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
               for i, c in enumerate(chunks)] or [{"type": "http.request", "body": b""}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop(0)
        await asyncio.sleep(3600)  # a client that sent all: waits for the answer
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10))
    return sent


def _status_and_body(sent: list[dict[str, Any]]) -> tuple[int, bytes]:
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert len(starts) == 1, sent  # one answer, never two
    return starts[0]["status"], b"".join(m.get("body", b"") for m in sent
                                         if m["type"] == "http.response.body")


def _assert_413(sent: list[dict[str, Any]]) -> None:
    status, body = _status_and_body(sent)
    assert status == 413
    start = next(m for m in sent if m["type"] == "http.response.start")
    headers = dict(start["headers"])  # ASGI's header names are lower-case
    assert headers[b"content-length"] == str(len(body)).encode()
    assert headers[b"content-type"] == b"application/json"
    error = json.loads(body)["error"]
    assert error == {"message": f"request body is larger than {LIMIT} bytes",
                     "type": "invalid_request_error", "param": None,
                     "code": "request_too_large"}


def test_a_declared_length_over_the_limit_is_refused_before_the_app_runs() -> None:
    app, seen = _reading_app()
    # the first 10 bytes of it have come: counted, they would pass; the length says they won't
    _assert_413(_call(BodySizeLimit(app, LIMIT), [b"x" * 10], declared=LIMIT + 1))
    assert seen == []


def test_a_chunked_body_past_the_limit_gets_413_not_the_apps_answer() -> None:
    app, seen = _reading_app()
    chunks = [b"x" * 400] * 3  # 1,200 bytes, no Content-Length
    _assert_413(_call(BodySizeLimit(app, LIMIT), chunks, declared=None))
    assert seen == []  # the read failed inside the app: it answered nothing the client saw


def test_bodies_of_exactly_the_limit_and_under_it_are_read_whole() -> None:
    for chunks, declared in [([b"x" * LIMIT], LIMIT), ([b"x" * 500, b"x" * 500], None),
                             ([b"x" * 10], 10), ([b"x" * 999], None)]:
        app, seen = _reading_app()
        status, body = _status_and_body(_call(BodySizeLimit(app, LIMIT), chunks, declared))
        total = sum(len(c) for c in chunks)
        assert (status, json.loads(body), seen) == (200, {"read": total}, [total])


def test_a_declared_length_that_is_no_number_is_counted_as_the_body_arrives() -> None:
    """``Content-Length: 12x`` is no length: the body is counted instead, and refused past the
    limit."""
    app, seen = _reading_app()
    limited = BodySizeLimit(app, LIMIT)

    async def with_a_bad_length(scope, receive, send):  # noqa: ANN001, ANN202
        scope["headers"] = [*scope["headers"], (b"content-length", b"12x")]
        await limited(scope, receive, send)

    _assert_413(_call(with_a_bad_length, [b"x" * 600, b"x" * 600], declared=None))
    assert seen == []


def test_a_response_begun_before_the_body_passed_the_limit_stands() -> None:
    async def answers_first(scope, receive, send):  # noqa: ANN001, ANN202
        await send({"type": "http.response.start", "status": 200, "headers": []})
        read = 0
        while True:
            message = await receive()
            read += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        await send({"type": "http.response.body", "body": str(read).encode()})

    sent = _call(BodySizeLimit(answers_first, LIMIT), [b"x" * 800, b"x" * 800], declared=None)
    assert _status_and_body(sent) == (200, b"1600")


def test_an_apps_own_error_is_not_turned_into_413() -> None:
    async def fails(scope, receive, send):  # noqa: ANN001, ANN202
        await receive()
        raise RuntimeError("the app's own failure")

    try:
        _call(BodySizeLimit(fails, LIMIT), [b"x" * 10], declared=10)
    except RuntimeError as e:
        assert "the app's own failure" in str(e)
    else:
        raise AssertionError("the app's error was swallowed")


def test_a_scope_other_than_http_passes_through_untouched() -> None:
    seen: list[str] = []

    async def lifespan(scope, receive, send):  # noqa: ANN001, ANN202
        message = await receive()  # the server's own channel, not a counted body
        seen.extend([scope["type"], len(message["body"])])
        await send({"type": "lifespan.startup.complete"})

    sent = _call(BodySizeLimit(lifespan, 1), [b"x" * 10], declared=10, scope_type="lifespan")
    assert seen == ["lifespan", 10] and sent == [{"type": "lifespan.startup.complete"}]


def test_a_request_whose_client_left_gets_nothing_sent() -> None:
    """An app that read a body under the limit and returned without answering (its client went
    away): nothing is sent for it, no 413 either."""
    async def client_left(scope, receive, send):  # noqa: ANN001, ANN202
        await receive()

    assert _call(BodySizeLimit(client_left, LIMIT), [b"x" * 10], declared=None) == []
