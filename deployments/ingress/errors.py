"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``; on Anthropic's
routes (``/v1/messages...``) in Anthropic's: ``{"type": "error", "error": {"type", "message"}}``.

Every failure reaching a client goes through here, with a short message: validation failures
are 400 (never 422 or 500; unknown fields too, all named in one error), a body not sent as
JSON 415 (naming the Content-Type it came with), a missing or wrong API key 401, an unknown
model 404, an unknown route 404 (listing the app's routes), an unhealthy
or overloaded engine 503, a time-out 504; a request whose client left (Serve cancels it) is
logged as a disconnect, not as an error, and answered 499 to nobody. Exceptions raised in Ray actors are unwrapped to their
cause so no traceback or file path leaks into a response.
"""

from __future__ import annotations

import email.message
import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from ray.exceptions import TaskCancelledError
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from nvray.runtime.errors import EngineDeadError

logger = logging.getLogger(__name__)
# "top_p=2 is invalid", "logit_bias: ...", "response_format.json_schema.schema: ..."
_PARAM_IN_MESSAGE = re.compile(r"^([\w.]+)(?:=|: )")
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 415: "invalid_request_error", 503: "service_unavailable",
          504: "timeout", 500: "internal_error"}


# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                    413: "request_too_large", 415: "invalid_request_error", 429: "rate_limit_error",
                    503: "overloaded_error", 504: "api_error", 500: "api_error"}
ANTHROPIC_ROUTES = ("/v1/messages",)


def is_anthropic_route(path: str) -> bool:
    """Whether ``path`` (under any route prefix) is one of Anthropic's API routes."""
    return any(path.endswith(r) or r + "/" in path for r in ANTHROPIC_ROUTES)


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        message = f"{self.param}: {self.message}" if self.param and not self.message.startswith(
            self.param) else self.message
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(self.status, "api_error"),
                                           "message": message}}

    def response(self, path: str = "") -> JSONResponse:
        """The error response, in Anthropic's shape on its routes (``path``)."""
        body = self.anthropic_body() if is_anthropic_route(path) else self.body()
        return JSONResponse(body, status_code=self.status)

    def sse(self) -> str:
        return f"data: {json.dumps(self.body())}\n\n"

    def anthropic_sse(self) -> str:
        return f"event: error\ndata: {json.dumps(self.anthropic_body())}\n\n"


def root_cause(e: BaseException) -> BaseException:
    """The user-level exception behind a Ray task error."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e


def to_openai_error(e: BaseException) -> OpenAIError:
    """Map any exception from request handling to the error a client should see."""
    e = root_cause(e)
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, EngineDeadError):
        return OpenAIError(503, "the engine is unavailable; retry shortly", code="engine_unavailable")
    if isinstance(e, TimeoutError):
        return OpenAIError(504, "the request timed out", code="timeout")
    if isinstance(e, TaskCancelledError):  # Serve cancelled the request: its client left
        logger.info("a client disconnected before its answer ended")
        return OpenAIError(499, "the client closed the request", code="client_closed_request")
    if isinstance(e, ValueError):
        message = str(e).splitlines()[0] if str(e) else "invalid request"
        param = getattr(e, "param", None)
        match = _PARAM_IN_MESSAGE.match(message)
        return OpenAIError(400, message, param or (match.group(1) if match else None))
    logger.exception("unexpected error while serving a request")
    return OpenAIError(500, "internal server error", code="internal_error")


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}
_MAX_NAMES_SHOWN, _MAX_NAME_CHARS = 5, 64  # keep an error short whatever the body holds


def _param_of(loc: list[str]) -> str | None:
    """The parameter a validation error is about: its path up to the first union-member tag
    that pydantic inserts (``stop.str`` -> ``stop``, ``messages.0.content.list[ContentPart]``
    -> ``messages.0.content``)."""
    path: list[str] = []
    for part in loc:
        if path and _is_union_tag(part):
            break
        path.append(part)
    return ".".join(path) or None


def _is_union_tag(part: str) -> bool:
    return "[" in part or part.lower() in _TYPE_TAGS or part[:1].isupper()


def _field_path(loc: list[str]) -> str:
    """A field's dotted path without pydantic's union-member tags (the name itself is kept
    whatever its spelling)."""
    return ".".join([p for p in loc[:-1] if not _is_union_tag(p)] + loc[-1:])


def _unknown_fields_error(errors: list[dict[str, Any]]) -> OpenAIError | None:
    """Fields the request models do not list (``extra="forbid"``): one 400 naming them all
    (``param``: their paths, comma-separated, e.g. ``frobnicate`` or ``messages.0.colour``)."""
    paths = [_field_path([str(p) for p in err.get("loc", ()) if p != "body"])
             for err in errors if err.get("type") == "extra_forbidden"]
    paths = list(dict.fromkeys(p for p in paths if p))
    if not paths:
        return None
    shown = [p[:_MAX_NAME_CHARS] for p in paths[:_MAX_NAMES_SHOWN]]
    more = f" and {len(paths) - len(shown)} more" if len(paths) > len(shown) else ""
    return OpenAIError(400, f"unknown field{'s' if len(paths) > 1 else ''} {', '.join(shown)}"
                            f"{more}: not a parameter nvray accepts (it rejects rather than "
                            "ignores them)", ",".join(shown), "unknown_parameter")


def _declares_json(content_type: str | None) -> bool:
    """Whether a Content-Type declares JSON (``application/json``, ``application/*+json``), as
    FastAPI decides whether to parse a body."""
    message = email.message.Message()
    message["content-type"] = content_type or ""
    subtype = message.get_content_subtype()
    return bool(content_type) and message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json"))


def _not_json_error(content_type: str | None) -> OpenAIError:
    """A body that did not say it is JSON. It is not read as JSON anyway (FastAPI's strict
    content type): a web page may send a body without a Content-Type, or as a form, to a local
    server without the browser asking the server first, but never as application/json."""
    sent = (f"Content-Type {_shown(content_type.split(';')[0])!r}" if content_type
            else "no Content-Type")
    hint = " (curl -d sends that: add -H 'Content-Type: application/json', or use curl --json)" \
        if content_type and content_type.startswith("application/x-www-form-urlencoded") else ""
    return OpenAIError(415, f"the request body must be JSON sent with 'Content-Type: "
                            f"application/json'; this one came with {sent}{hint}",
                       code="unsupported_media_type")


def _validation_error(exc: RequestValidationError, content_type: str | None = None
                      ) -> OpenAIError:
    """``content_type``: the request's Content-Type header."""
    errors = exc.errors()
    if not errors:
        return OpenAIError(400, "invalid request body")
    if unknown := _unknown_fields_error(list(errors)):
        return unknown
    first = errors[0]
    if first.get("type") == "json_invalid":
        return OpenAIError(400, "request body is not valid JSON", code="json_invalid")
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = _param_of(loc)
    if not loc and first.get("type") == "missing":
        return OpenAIError(400, "the request has no body: send a JSON object")
    if not loc and first.get("type") in ("model_attributes_type", "dict_type"):
        if not _declares_json(content_type):
            return _not_json_error(content_type)
        return OpenAIError(400, "request body must be a JSON object")
    message = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid")
    return OpenAIError(400, message, param)


def _no_such_route(request: Request, status: int) -> OpenAIError:
    """A 404 (or 405: the path is a route, the method is not) that lists the routes the app
    serves, as a client reaches them (under the app's route prefix)."""
    root = request.scope.get("root_path", "").rstrip("/")
    path = request.scope.get("path", "")
    path = path if path.startswith(root + "/") else root + path
    paths = request.app.openapi().get("paths", {})  # built once, then cached by FastAPI
    routes = ", ".join(f"{method.upper()} {root}{route}" for route, methods in paths.items()
                       for method in methods)
    what, code = ("URL", "unknown_url") if status == 404 else ("method", "method_not_allowed")
    return OpenAIError(status, f"Invalid {what} ({_shown(request.method)} {_shown(path)}): "
                               f"this app serves {routes}", code=code)


def _shown(text: str) -> str:
    """What a client sent, cut short enough to keep an error small."""
    return text if len(text) <= _MAX_NAME_CHARS else text[:_MAX_NAME_CHARS] + "..."


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc, request.headers.get("content-type")).response(
            request.url.path)

    @app.exception_handler(OpenAIError)
    async def on_openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(ValueError)
    async def on_bad_request(request: Request, exc: ValueError) -> JSONResponse:
        """An expected 400: one log line, answered here (a handler for ``Exception`` would
        answer too, but Starlette then re-raises it: a traceback in the log, and an exception
        Serve's proxy would have to unpickle)."""
        error = to_openai_error(exc)
        logger.info("%d %s: %s", error.status, error.param, error.message)
        return error.response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code in (404, 405):  # the router matched no route, or not this method
            response = _no_such_route(request, exc.status_code).response(request.url.path)
        else:
            response = OpenAIError(exc.status_code, str(exc.detail)).response(request.url.path)
        response.headers.update(exc.headers or {})  # a 405's Allow
        return response

    @app.exception_handler(Exception)
    async def on_any_error(request: Request, exc: Exception) -> JSONResponse:
        return to_openai_error(exc).response(request.url.path)
