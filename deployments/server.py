"""NvrayServer: the Serve deployment — one replica = one whole nvray engine.

The replica lives in bundle 0 of its own placement group (laid out by
``nvray.runtime.placement.engine_bundles``); its EngineDriver shares that bundle and the rank
actors take the others, so autoscaling adds and removes whole engines. The replica serves the
OpenAI-compatible HTTP API (FastAPI ingress) and a Python handle API (``generate``,
``generate_stream``) for other Ray tasks; ``check_health`` reflects the engine's health so Serve
replaces a replica whose engine died.

No ``from __future__ import annotations`` here: Serve re-wraps the route methods, and FastAPI
must see real (not string) annotations to find the request body models.
"""


import asyncio
import hmac
import logging
import time
import uuid
from typing import Any, AsyncIterator

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from ray import serve

from deployments.args import AppArgs, parse_args
from deployments.errors import OpenAIError, install_error_handlers, to_openai_error
from deployments.metrics import render_metrics
from deployments.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from deployments.responses import DONE, ChatFormat, CompletionFormat, sse
from deployments.streaming import merge_streams
from nvray.outputs import RequestOutput
from nvray.runtime import start_engine
from nvray.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
api = FastAPI(title="nvray", description="OpenAI-compatible API of an nvray engine")
install_error_handlers(api)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@serve.deployment
@serve.ingress(api)
class NvrayServer:
    def __init__(self, args: dict[str, Any] | AppArgs) -> None:
        self.args = parse_args(args)
        self.model_name = self.args.name_to_serve()
        self.api_key = self.args.resolved_api_key()
        self.timeout = self.args.request_timeout_s
        pg = ray.util.get_current_placement_group()
        self.client = start_engine(self.args.engine_config(), pg=pg)
        self.driver = self.client.driver
        self.created = int(time.time())

    # --------------------------------------------------------------- plumbing
    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), self.api_key.encode()):
            raise OpenAIError(401, "missing or invalid API key", code="invalid_api_key")

    def _check_request(self, request: Request, body: SamplingFields) -> None:
        self._authorize(request)
        if body.model is not None and body.model != self.model_name:
            raise OpenAIError(404, f"the model '{body.model}' does not exist", "model",
                              "model_not_found")
        body.check_supported()

    async def _final(self, prompt: Any, params: SamplingParams) -> RequestOutput:
        request_id = uuid.uuid4().hex
        try:
            async with asyncio.timeout(self.timeout):
                return await self.driver.generate.remote(prompt, params, request_id)
        except BaseException:
            self.driver.abort.remote(request_id)  # time-out, disconnect or failure: free it
            raise

    async def _all_final(self, prompts: list[Any], params: SamplingParams) -> list[RequestOutput]:
        tasks = [asyncio.ensure_future(self._final(p, params)) for p in prompts]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            raise

    async def _stream(self, prompt: Any, params: SamplingParams, request_id: str
                      ) -> AsyncIterator[RequestOutput]:
        gen = self.driver.generate_stream.options(num_returns="streaming").remote(
            prompt, params, request_id)
        async for ref in gen:
            yield await ref

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
        card = {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "nvray", "max_model_len": self.client.info.get("max_model_len")}
        return JSONResponse({"object": "list", "data": [card]})

    @api.get("/metrics")
    async def metrics(self) -> PlainTextResponse:
        stats = await self.driver.stats.remote()
        return PlainTextResponse(render_metrics(stats, self.model_name),
                                 media_type="text/plain; version=0.0.4")

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        self._check_request(request, body)
        params = body.sampling_params(body.max_tokens)
        fmt = CompletionFormat(self.model_name)
        if body.stream:
            return await self._streaming_response(body.prompts(), params, fmt, body.include_usage)
        return JSONResponse(fmt.full(await self._all_final(body.prompts(), params)))

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Any:
        self._check_request(request, body)
        params = body.sampling_params(body.output_limit())
        prompts = [body.template_messages()]
        fmt = ChatFormat(self.model_name)
        if body.stream:
            return await self._streaming_response(prompts, params, fmt, body.include_usage)
        return JSONResponse(fmt.full(await self._all_final(prompts, params)))

    # ------------------------------------------------------------- streaming
    async def _streaming_response(self, prompts: list[Any], params: SamplingParams,
                                  fmt: CompletionFormat | ChatFormat,
                                  include_usage: bool) -> StreamingResponse:
        """Start every stream and wait for its first output, so a request the engine rejects
        still gets an HTTP 400 instead of a stream that fails at once."""
        ids = [uuid.uuid4().hex for _ in prompts]
        streams = [self._stream(p, params, rid) for p, rid in zip(prompts, ids)]
        try:
            firsts = await asyncio.gather(*(anext(s) for s in streams))
        except BaseException:
            for rid in ids:
                self.driver.abort.remote(rid)
            raise
        body = self._sse_body(streams, list(firsts), ids, fmt, include_usage)
        return StreamingResponse(body, media_type="text/event-stream", headers=_SSE_HEADERS)

    async def _sse_body(self, streams: list[AsyncIterator[RequestOutput]],
                        firsts: list[RequestOutput], ids: list[str],
                        fmt: CompletionFormat | ChatFormat, include_usage: bool) -> AsyncIterator[str]:
        finals: dict[int, RequestOutput] = {}
        try:
            async with asyncio.timeout(self.timeout):
                for chunk in fmt.first_chunks(len(streams)):
                    yield sse(chunk)
                async for index, out in merge_streams(streams, firsts):
                    yield sse(fmt.chunk(index, out))
                    if out.finished:
                        finals[index] = out
            if include_usage:
                yield sse(fmt.usage_chunk([finals[i] for i in sorted(finals)]))
        except Exception as e:  # noqa: BLE001 - after the 200 header: an SSE error event
            yield to_openai_error(e).sse()
        finally:
            for index, rid in enumerate(ids):
                if index not in finals:
                    self.driver.abort.remote(rid)  # disconnect or failure: free its blocks
        yield DONE

    # ------------------------------------------------------------ handle API
    async def generate(self, prompt: Any, sampling_params: Any = None) -> RequestOutput:
        """Handle API: the final output (text, token_ids, finish_reason, usage)."""
        return await self._final(prompt, SamplingParams.coerce(sampling_params))

    async def generate_stream(self, prompt: Any, sampling_params: Any = None
                              ) -> AsyncIterator[RequestOutput]:
        """Handle API (``handle.options(stream=True)``): deltas, then the final output."""
        request_id = uuid.uuid4().hex
        finished = False
        try:
            async for out in self._stream(prompt, SamplingParams.coerce(sampling_params), request_id):
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.driver.abort.remote(request_id)

    async def check_health(self) -> None:
        """Serve's health check: raises if the engine or one of its ranks is gone."""
        await self.driver.check_health.remote()

    def __del__(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.shutdown()

