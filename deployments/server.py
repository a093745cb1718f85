"""NvrayServer: the Serve deployment — one replica = one whole nvray engine.

The replica lives in bundle 0 of its own placement group (laid out by
``nvray.runtime.placement.engine_bundles``); its EngineDriver shares that bundle and the rank
actors take the others, so autoscaling adds and removes whole engines. The replica serves the
OpenAI-compatible HTTP API (FastAPI ingress) and a Python handle API (``generate``,
``generate_stream``) for other Ray tasks; ``check_health`` reflects the engine's health so Serve
replaces a replica whose engine died.

``/tokenize`` and ``/detokenize`` ask the engine's driver rather than load a second tokenizer
here: the driver holds the tokenizer the engine runs and renders chat prompts on the one code
path (``nvray.chat_template``) that requests take, so the ids and counts a client sees are the
engine's by construction, at the cost of one Ray call (the replica shares its node and
placement-group bundle with the driver) and no second copy of a large tokenizer per replica.

All of the replica's requests, HTTP and handle alike, receive their outputs through ONE output
channel to the driver (an OutputRouter): one message per engine step. Each SSE body writes
everything that arrived for its request since its last write as one chunk per choice, so a
slow client or a slow hop merges tokens instead of queueing one chunk per token.

No ``from __future__ import annotations`` here: Serve re-wraps the route methods, and FastAPI
must see real (not string) annotations to find the request body models.
"""


import asyncio
import hmac
import logging
import time
from typing import Any, AsyncIterator

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.background import BackgroundTask
from ray import serve

from deployments.admission import AdmissionGate, Ticket
from deployments.args import AppArgs, parse_args
from deployments.body_limit import BodySizeLimit
from deployments.errors import OpenAIError, install_error_handlers, to_openai_error
from deployments.metrics import render_metrics
from deployments.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                  SamplingFields, TokenizeRequest)
from deployments.logprobs_format import TokenTexts
from deployments.responses import DONE, ChatFormat, CompletionFormat, sse, with_usage
from nvray.outputs import RequestOutput
from nvray.reasoning import reasoning_parser_for
from nvray.runtime import start_engine
from nvray.runtime.output_router import OutputRouter, RequestSink
from nvray.runtime.output_router import Request as EngineRequest
from nvray.sampling_params import BeamSearchParams, SamplingParams, num_choices

logger = logging.getLogger(__name__)
api = FastAPI(title="nvray", description="OpenAI-compatible API of an nvray engine")
install_error_handlers(api)
api.add_middleware(BodySizeLimit)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def usage_so_far(sink: RequestSink, index: int, counts: list[int]) -> dict[str, int]:
    """``stream_options.continuous_usage_stats``: one choice's token counts up to this chunk."""
    prompt = sink.num_prompt_tokens[index]
    return {"prompt_tokens": prompt, "completion_tokens": counts[index],
            "total_tokens": prompt + counts[index]}


def _params(value: Any) -> SamplingParams | BeamSearchParams:
    """A handle call's sampling params: a SamplingParams, a dict of its fields, None, or a
    BeamSearchParams."""
    return value if isinstance(value, BeamSearchParams) else SamplingParams.coerce(value)


def _end_stream(sink: RequestSink, ticket: Ticket) -> None:
    """A stream is over (or never began): abort what still runs, give its slot back."""
    sink.abort()
    ticket.release()


@serve.deployment
@serve.ingress(api)
class NvrayServer:
    def __init__(self, args: dict[str, Any] | AppArgs) -> None:
        self.args = parse_args(args)
        self.model_name = self.args.name_to_serve()
        self.api_key = self.args.resolved_api_key()
        self.timeout = self.args.request_timeout_s
        self.reasoning = reasoning_parser_for(self.args.reasoning_parser)
        self.gate = AdmissionGate(self.args.max_ongoing_requests, self.args.max_waiting())
        pg = ray.util.get_current_placement_group()
        self.client = start_engine(self.args.engine_config(), pg=pg)
        self.driver = self.client.driver
        self.router = OutputRouter(self.driver)
        self.router.open_now()  # here, not in a request: see OutputRouter.open_now
        self.created = int(time.time())
        self._texts: TokenTexts | None = None

    # --------------------------------------------------------------- plumbing
    def token_texts(self) -> TokenTexts:
        """Token texts for log-probabilities: the model's tokenizer, loaded in this replica
        the first time a request asks for them (a lookup per token: no call to the driver)."""
        if self._texts is None:
            from nvray.bootstrap import load_tokenizer  # noqa: PLC0415
            from nvray.models.tiny import resolve_model  # noqa: PLC0415

            self._texts = TokenTexts(load_tokenizer(resolve_model(self.args.model)))
        return self._texts

    def _echo_texts(self, prompts: list[Any], params: Any) -> list[str]:
        """Each choice's prompt text (``echo``): n per prompt."""
        texts = [p if isinstance(p, str) else self.token_texts().tokenizer.decode(p)
                 for p in prompts]
        return [t for t in texts for _ in range(num_choices(params))]
    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), self.api_key.encode()):
            raise OpenAIError(401, "missing or invalid API key", code="invalid_api_key")

    def _check_model(self, model: str | None, param: str | None = "model") -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(404, f"the model '{model}' does not exist", param, "model_not_found")

    def _check_request(self, request: Request, body: SamplingFields) -> None:
        self._authorize(request)
        self._check_model(body.model)
        body.check_supported()

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "nvray", "max_model_len": self.client.info.get("max_model_len"),
                "vocab_size": self.client.info.get("vocab_size")}

    async def _ask_driver(self, call: Any, param: str) -> Any:
        """A driver call's result; a ValueError it raises is a 400 naming ``param`` (unless it
        names its own)."""
        try:
            async with asyncio.timeout(self.timeout):
                return await call
        except Exception as e:  # noqa: BLE001 - mapped to the client's error below
            error = to_openai_error(e)
            if error.status == 400 and error.param is None:
                error.param = param
            raise error from None

    async def _finals(self, prompts: list[Any], params: SamplingParams | BeamSearchParams,
                      priority: int = 0) -> list[RequestOutput]:
        """Final outputs of ``prompts`` (all admitted or none: a rejected one raises)."""
        sink = await self.router.add([EngineRequest(p, params, priority=priority) for p in prompts])
        try:
            async with asyncio.timeout(self.timeout):
                results = await sink.results()
        finally:
            sink.abort()  # time-out, disconnect or failure: free what still runs
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results  # type: ignore[return-value]

    # ---------------------------------------------------------------- routes
    @api.get("/health")
    async def health(self) -> JSONResponse:
        try:
            await self.driver.check_health.remote()
        except Exception:  # noqa: BLE001 - any failure means unhealthy
            return OpenAIError(503, "the engine is unhealthy", code="engine_unavailable").response()
        return JSONResponse({"status": "ok"})

    @api.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    @api.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request) -> JSONResponse:
        self._authorize(request)
        self._check_model(model_id, param=None)
        return JSONResponse(self._model_card())

    @api.post("/tokenize")
    async def tokenize(self, body: TokenizeRequest, request: Request) -> JSONResponse:
        self._authorize(request)
        self._check_model(body.model)
        prompt = body.to_tokenize()
        tokens = await self._ask_driver(self.driver.tokenize.remote(prompt),
                                        "prompt" if isinstance(prompt, str) else "messages")
        return JSONResponse({"tokens": tokens, "count": len(tokens),
                             "max_model_len": self.client.info.get("max_model_len")})

    @api.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest, request: Request) -> JSONResponse:
        self._authorize(request)
        self._check_model(body.model)
        text = await self._ask_driver(self.driver.detokenize.remote(body.tokens), "tokens")
        return JSONResponse({"prompt": text})

    @api.get("/metrics")
    async def metrics(self) -> PlainTextResponse:
        stats = await self.driver.stats.remote()
        return PlainTextResponse(render_metrics(stats, self.model_name),
                                 media_type="text/plain; version=0.0.4")

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        self._check_request(request, body)
        params = body.completion_params()
        fmt = CompletionFormat(self.model_name,
                               self.token_texts() if body.logprobs is not None else None,
                               self._echo_texts(body.prompts(), params) if body.echo else None)
        if body.stream:
            return await self._streaming_response(body.prompts(), params, fmt, body)
        async with self.gate.slot(self.timeout):
            return JSONResponse(fmt.full(await self._finals(body.prompts(), params, body.priority)))

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Any:
        self._check_request(request, body)
        params = body.sampling_params(body.output_limit())
        prompts = [body.prompt()]
        fmt = ChatFormat(self.model_name, self.reasoning,
                         self.token_texts() if body.logprobs else None)
        if body.stream:
            return await self._streaming_response(prompts, params, fmt, body)
        async with self.gate.slot(self.timeout):
            return JSONResponse(fmt.full(await self._finals(prompts, params, body.priority)))

    # ------------------------------------------------------------- streaming
    async def _streaming_response(self, prompts: list[Any], params: SamplingParams | BeamSearchParams,
                                  fmt: CompletionFormat | ChatFormat,
                                  body: SamplingFields) -> StreamingResponse:
        """Admit every prompt first, so a request the engine rejects gets an HTTP 400 instead
        of a stream that fails at once; then stream. The slot is given back when the body ends
        (or, if the client left before it began, when the response is done)."""
        ticket = await self.gate.enter(self.timeout)
        try:
            sink = await self.router.add([EngineRequest(p, params, priority=body.priority)
                                          for p in prompts], stream=True)
        except BaseException:
            ticket.release()
            raise
        events = self._sse_body(sink, fmt, body.include_usage, body.continuous_usage, ticket)
        return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS,
                                 background=BackgroundTask(_end_stream, sink, ticket))

    async def _sse_body(self, sink: RequestSink, fmt: CompletionFormat | ChatFormat,
                        include_usage: bool, continuous_usage: bool,
                        ticket: Ticket) -> AsyncIterator[str]:
        counts = [0] * len(sink.request_ids)  # completion tokens so far, per choice
        deadline = time.monotonic() + self.timeout
        try:
            if first := fmt.first_chunks(len(counts)):  # chat: the role, before any token
                yield "".join(sse(with_usage(chunk, usage_so_far(sink, i, counts)
                                             if continuous_usage else None))
                              for i, chunk in enumerate(first))
            # all that arrived since the last write goes out as one write
            while batch := await sink.next_batch(deadline - time.monotonic()):
                events = []
                for index, out in batch:
                    counts[index] += len(out.delta_token_ids)
                    usage = usage_so_far(sink, index, counts) if continuous_usage else None
                    if (chunk := fmt.chunk(index, out, usage)) is not None:
                        events.append(sse(chunk))
                if events:
                    yield "".join(events)
            if include_usage:
                yield sse(fmt.usage_chunk(sink.finals))  # type: ignore[arg-type]
        except Exception as e:  # noqa: BLE001 - after the 200 header: an SSE error event
            yield to_openai_error(e).sse()
        finally:
            _end_stream(sink, ticket)  # disconnect or failure: free the blocks of what still runs
        yield DONE

    # ------------------------------------------------------------ handle API
    async def generate(self, prompt: Any, sampling_params: Any = None
                       ) -> RequestOutput | list[RequestOutput]:
        """Handle API: the final output (text, token_ids, finish_reason, usage); with ``n > 1``
        or a BeamSearchParams, the list of the choices' (beams', best first) final outputs."""
        async with self.gate.slot(self.timeout):
            outs = await self._finals([prompt], _params(sampling_params))
        return outs[0] if len(outs) == 1 else outs

    async def generate_stream(self, prompt: Any, sampling_params: Any = None
                              ) -> AsyncIterator[RequestOutput]:
        """Handle API (``handle.options(stream=True)``): deltas (coalesced while the caller
        reads slower than the engine steps), then the final output."""
        async with self.gate.slot(self.timeout):
            sink = await self.router.add([EngineRequest(prompt, _params(sampling_params))],
                                         stream=True)
            deadline = time.monotonic() + self.timeout
            try:
                while batch := await sink.next_batch(deadline - time.monotonic()):
                    for _, out in batch:
                        yield out
            finally:
                sink.abort()

    async def engine_client(self) -> Any:
        """Handle API: this replica's EngineClient, to call its engine directly from a Ray task
        (``client.stream(...)`` opens the caller's own output channel to the driver)."""
        return self.client

    async def check_health(self) -> None:
        """Serve's health check: raises if the engine, one of its ranks or this replica's
        output channel is gone."""
        if self.router.dead is not None:
            raise self.router.dead
        await self.driver.check_health.remote()

    def __del__(self) -> None:
        router = getattr(self, "router", None)
        if router is not None:
            router.close()
        client = getattr(self, "client", None)
        if client is not None:
            client.shutdown()

