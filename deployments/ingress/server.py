"""NvrayServer: the app's ingress — the OpenAI-compatible HTTP API (FastAPI,
``http_app.py``), Anthropic's Messages API on the same chat path
(``deployments/apis/messages_api.py``), and a Python handle API (``generate``,
``generate_stream``, ``engine_client``) for other Ray tasks. Two route
groups live in their own files and are mixed in: the Responses API
(``deployments/apis/responses_routes.py``) and pooling (``deployments/apis/pooling_routes.py``).

It finds its engine one of two ways (``deployments/routing/engines.py``):
- without prefix routing, each replica is one whole nvray engine: the replica lives in bundle 0
  of its own placement group (``nvray.runtime.placement.engine_bundles``) beside its
  EngineDriver and rank 0, so autoscaling adds and removes whole engines, and ``check_health``
  is the engine's, so Serve replaces a replica whose engine died. With one replica at most
  (``max_replicas`` 1), the engine starts in the background: the replica answers at once,
  ``/health`` with a 503 (``engine_starting``) until the engine is up, and requests wait for it.
  With more, the engine starts in the constructor, so that Serve routes requests only to
  replicas whose engine is up (a replica that answers while its engine loads would be sent a
  share of the requests that the engines already up could serve);
- with prefix routing (``deployments.build_app``), the engines are the replicas of the app's
  NvrayEngine deployment, and each request leases one through the PrefixAwareRouter, which
  sends it where its prompt's prefix is most likely cached. Outputs still come from the
  engine's driver straight to this replica, one message per engine step. ``/health`` answers
  503 while no engine replica answers within ``HEALTH_WAIT_S`` (none is up while the app
  deploys).

LoRA adapters (``deployments/ingress/lora_names.py``): a generation request's ``model`` may name an
adapter (or ``<base>:<adapter>``); its requests then run through it, and the response names it.
``/v1/models`` lists the adapters known so far with their parent; ``POST /v1/load_lora_adapter``
and ``/v1/unload_lora_adapter`` change them with ``allow_runtime_lora_updating``.

``/tokenize`` and ``/detokenize`` ask an engine's driver: the driver holds the tokenizer the
engine runs and renders chat prompts on the one code path (``nvray.chat_template``) that
requests take, so the ids and counts a client sees are the engine's by construction, at the
cost of one Ray call (the replica shares its node and placement-group bundle with the driver).
The replica loads the model's tokenizer itself only when a request first asks for
log-probabilities or echoes a token-id prompt (``token_texts``): token texts are looked up per
token, too often for a Ray call each; a replica that never serves those holds no second copy.

All of the replica's requests to one engine, HTTP and handle alike, receive their outputs through
ONE output channel to its driver (an OutputRouter): one message per engine step. Each SSE body writes
everything that arrived for its request since its last write as one chunk per choice, so a
slow client or a slow hop merges tokens instead of queueing one chunk per token.

No ``from __future__ import annotations`` here: Serve re-wraps the route methods, and FastAPI
must see real (not string) annotations to find the request body models.
"""


import asyncio
import logging
import time
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.background import BackgroundTask
from ray import serve

from deployments.args import AppArgs, parse_args
from deployments.apis.messages_api import CountTokensRequest, MessagesRequest
from deployments.apis.messages_format import MessagesFormat
from deployments.apis.pooling_routes import PoolingRoutes
from deployments.apis.response_store import StoredResponses
from deployments.apis.responses_routes import ResponsesRoutes
from deployments.ingress.auth import bearer_key_matches, header_key_matches
from deployments.ingress.console import quiet_health_polls
from deployments.routing.engines import EngineStarting, Lease, LeasedEngines, LocalEngine
from deployments.ingress.errors import OpenAIError, to_openai_error
from deployments.ingress.http_app import api
from deployments.ingress.lora_names import LoRANames, parse_lora_modules
from deployments.ingress.metrics import render_metrics
from deployments.routing.prefix_router import routing_key
from deployments.apis.tools import tool_parser_for
from deployments.apis.openai_api import (ChatCompletionRequest, CompletionRequest,
                                         DetokenizeRequest, LoadLoRARequest, SamplingFields,
                                         TokenizeRequest, UnloadLoRARequest)
from deployments.apis.logprobs_format import TokenTexts
from deployments.apis.openai_format import ChatFormat, CompletionFormat, StreamFormat, with_usage
from nvray.lora.request import LoRARequest
from nvray.outputs import RequestOutput
from nvray.model_config import architecture_of
from nvray.models.tiny import resolve_model
from nvray.pooling import PoolingTask
from nvray.reasoning import reasoning_parser_for
from nvray.request import EngineRequest
from nvray.runtime.output_router import RequestSink
from nvray.sampling_params import BeamSearchParams, SamplingParams, num_choices

logger = logging.getLogger(__name__)
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_MIN_HOLD_S = 0.002  # a stream's pause between writes below this is not worth a timer


def usage_so_far(sink: RequestSink, index: int, counts: list[int]) -> dict[str, int]:
    """``stream_options.continuous_usage_stats``: one choice's token counts up to this chunk."""
    prompt = sink.num_prompt_tokens[index]
    return {"prompt_tokens": prompt, "completion_tokens": counts[index],
            "total_tokens": prompt + counts[index]}


def _params(value: Any) -> SamplingParams | BeamSearchParams:
    """A handle call's sampling params: a SamplingParams, a dict of its fields, None, or a
    BeamSearchParams."""
    return value if isinstance(value, BeamSearchParams) else SamplingParams.coerce(value)


def _end_stream(sink: RequestSink, lease: Lease) -> None:
    """A stream is over (or never began): abort what still runs, give its engine back."""
    sink.abort()
    lease.release()


def end_stream_task(sink: RequestSink, lease: Lease) -> BackgroundTask:
    """What runs when a streaming response is done, also when its client left before the body
    began: ``_end_stream``, on the event loop (a plain function would run in a worker thread,
    and the lease's admission slot is an ``asyncio.Semaphore``, which only its loop may
    release)."""
    async def on_the_loop() -> None:
        _end_stream(sink, lease)

    return BackgroundTask(on_the_loop)


@serve.deployment
@serve.ingress(api)
class NvrayServer(ResponsesRoutes, PoolingRoutes):
    def __init__(self, args: dict[str, Any] | AppArgs, engines: Any = None) -> None:
        """``engines``: the NvrayEngine deployment's handle (prefix routing), or None to host
        this replica's own engine."""
        quiet_health_polls()
        self.args = parse_args(args)
        self.model_name = self.args.name_to_serve()
        self.loras = LoRANames(self.model_name, parse_lora_modules(self.args.lora_modules),
                               self.args.lora_path)
        self.api_key = self.args.resolved_api_key()
        self.timeout = self.args.request_timeout_s
        self.chunks_per_s = self.args.stream_chunks_per_s
        self.open_streams = 0  # SSE bodies being written (they share the chunk budget)
        self.reasoning = reasoning_parser_for(self.args.reasoning_parser)
        self.tool_parser = tool_parser_for(self.args.tool_call_parser,
                                           architecture_of(resolve_model(self.args.model)))
        self.engines = (LocalEngine(self.args, in_background=self.args.max_replicas == 1)
                        if engines is None else LeasedEngines(engines))
        self.created = int(time.time())
        self._texts: TokenTexts | None = None
        self.stored = StoredResponses(serve.get_replica_context().app_name,
                                      self.args.responses_stored)
        self._spellings: dict[str, list[int]] = {}  # the engine's ids of a few fixed words
        pooling = PoolingTask.of(resolve_model(self.args.model))
        self.task = pooling.task if self.args.task == "auto" else self.args.task
        self.normalize = pooling.normalize  # embeddings: the checkpoint's Normalize module

    # --------------------------------------------------------------- plumbing
    def token_texts(self) -> TokenTexts:
        """Token texts for log-probabilities: the model's tokenizer, loaded in this replica
        the first time a request asks for them (a lookup per token: no call to the driver)."""
        if self._texts is None:
            from nvray.tokenizer import load_tokenizer  # noqa: PLC0415
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
        if not (bearer_key_matches(request.headers.get("authorization", ""), self.api_key)
                or header_key_matches(request.headers.get("x-api-key", ""), self.api_key)):
            raise OpenAIError(401, "missing or invalid API key", code="invalid_api_key")

    def _check_model(self, model: str | None, param: str | None = "model") -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(404, f"the model '{model}' does not exist", param, "model_not_found")

    def _adapter(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a generation request's ``model`` names (None: the base model)."""
        if not self.args.serves_loras():
            self._check_model(model)
            return None
        return self.loras.resolve(model)

    def _name_for(self, lora: LoRARequest | None) -> str:
        """The model a response names: the adapter's, or the served model's."""
        return self.model_name if lora is None else lora.lora_name

    def _check_request(self, request: Request, body: SamplingFields) -> LoRARequest | None:
        self._authorize(request)
        lora = self._adapter(body.model)
        self._require("generate", request)
        body.check_supported()
        return lora

    def _require(self, task: str, request: Request) -> None:
        """A route of another task than the model's is a 400 naming both."""
        if self.task != task:
            routes = {"generate": "/v1/completions, /v1/chat/completions, /v1/responses, "
                                  "/v1/messages", "embed": "/v1/embeddings",
                      "score": "/v1/rerank, /v1/score"}[self.task]
            raise OpenAIError(400, f"the model '{self.model_name}' serves the task "
                                   f"'{self.task}' ({routes}); {request.url.path} needs a model "
                                   f"of the task '{task}'", "model", "wrong_task")

    async def _model_card(self) -> dict[str, Any]:
        info = await self.engines.info()
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "nvray", "max_model_len": info.get("max_model_len"),
                "vocab_size": info.get("vocab_size"), "dtypes": info.get("dtypes"),
                "architecture": info.get("architecture"), "parallelism": info.get("parallelism")}

    async def _lease(self, prompts: list[Any], lora: LoRARequest | None = None) -> Lease:
        """An engine for these prompts (routed by their adapter and the first one's prefix,
        with routing on)."""
        key = routing_key(prompts[0], lora.lora_name if lora is not None else None)
        return await self.engines.lease(key, self.timeout)

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
                      priority: int = 0, lora: LoRARequest | None = None
                      ) -> list[RequestOutput]:
        """Final outputs of ``prompts`` (all admitted or none: a rejected one raises)."""
        lease = await self._lease(prompts, lora)
        try:
            sink = await lease.router.add([EngineRequest(p, params, priority=priority,
                                                         lora_request=lora)
                                           for p in prompts])
            try:
                async with asyncio.timeout(self.timeout):
                    results = await sink.results()
            finally:
                sink.abort()  # time-out, disconnect or failure: free what still runs
        finally:
            lease.release()
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results  # type: ignore[return-value]

    async def _spelling(self, text: str) -> list[int]:
        """The engine's token ids of ``text`` (a tag, a word): asked of the driver once."""
        if text not in self._spellings:
            self._spellings[text] = await self._ask_driver(self.engines.tokenize(text), "model")
        return self._spellings[text]

    def _next_write_at(self) -> float | None:
        """When a stream that has just written may write again (the event loop's clock): the
        replica's ``stream_chunks_per_s`` shared by its open streams, so that under many
        streams each writes fewer, larger chunks and Serve's proxy relays fewer messages."""
        if not self.chunks_per_s:
            return None
        pause = self.open_streams / self.chunks_per_s
        return asyncio.get_running_loop().time() + pause if pause >= _MIN_HOLD_S else None

    # ---------------------------------------------------------------- routes
    @api.get("/health")
    async def health(self) -> JSONResponse:
        """200 once the engine is up and well; 503 while it starts or when it is not."""
        try:
            await self.engines.check_health()
        except EngineStarting as e:
            return OpenAIError(503, str(e), code="engine_starting").response()
        except Exception:  # noqa: BLE001 - any failure means unhealthy
            return OpenAIError(503, "the engine is unhealthy", code="engine_unavailable").response()
        return JSONResponse({"status": "ok"})

    @api.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        return JSONResponse({"object": "list",
                             "data": [await self._model_card(), *self.loras.cards(self.created)]})

    @api.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request) -> JSONResponse:
        self._authorize(request)
        if model_id != self.model_name:
            for card in self.loras.cards(self.created):
                if card["id"] == model_id:
                    return JSONResponse(card)
        self._check_model(model_id, param=None)
        return JSONResponse(await self._model_card())

    @api.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, body: LoadLoRARequest, request: Request
                                ) -> PlainTextResponse:
        """vLLM's: add an adapter by name (``allow_runtime_lora_updating``)."""
        self._authorize(request)
        self._require_lora_updating()
        self.loras.load(body.lora_name, body.lora_path, await self.engines.info())
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @api.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, body: UnloadLoRARequest, request: Request
                                  ) -> PlainTextResponse:
        self._authorize(request)
        self._require_lora_updating()
        self.loras.unload(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed "
                                 "successfully.")

    def _require_lora_updating(self) -> None:
        if not self.args.allow_runtime_lora_updating:
            raise OpenAIError(404, "loading and unloading LoRA adapters at run time is off: "
                                   "start the app with allow_runtime_lora_updating=true",
                              code="not_found")

    @api.post("/tokenize")
    async def tokenize(self, body: TokenizeRequest, request: Request) -> JSONResponse:
        self._authorize(request)
        self._check_model(body.model)
        prompt = body.to_tokenize()
        tokens = await self._ask_driver(self.engines.tokenize(prompt),
                                        "prompt" if isinstance(prompt, str) else "messages")
        info = await self.engines.info()
        return JSONResponse({"tokens": tokens, "count": len(tokens),
                             "max_model_len": info.get("max_model_len")})

    @api.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest, request: Request) -> JSONResponse:
        self._authorize(request)
        self._check_model(body.model)
        text = await self._ask_driver(self.engines.detokenize(body.tokens), "tokens")
        return JSONResponse({"prompt": text})

    @api.get("/metrics")
    async def metrics(self) -> PlainTextResponse:
        stats = await self.engines.stats_by_engine()
        routing = await self.engines.routing_counts()
        return PlainTextResponse(render_metrics(stats, self.model_name, routing),
                                 media_type="text/plain; version=0.0.4")

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        lora = self._check_request(request, body)
        params = body.completion_params()
        fmt = CompletionFormat(self._name_for(lora),
                               self.token_texts() if body.logprobs is not None else None,
                               self._echo_texts(body.prompts(), params) if body.echo else None)
        if body.stream:
            return await self._streaming_response(body.prompts(), params, fmt, body, lora=lora)
        return JSONResponse(fmt.full(await self._finals(body.prompts(), params, body.priority,
                                                        lora)))

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Any:
        lora = self._check_request(request, body)
        params = body.sampling_params(body.output_limit(), reasoning=self.reasoning is not None,
                                      tool_format=self.tool_parser.xgrammar_format)
        prompts = [body.prompt()]
        fmt = ChatFormat(self._name_for(lora), self.reasoning,
                         self.token_texts() if body.logprobs else None,
                         self.tool_parser if body.calls_tools else None, body.tool_schemas())
        if body.stream:
            return await self._streaming_response(prompts, params, fmt, body, lora=lora)
        return JSONResponse(fmt.full(await self._finals(prompts, params, body.priority, lora)))

    @api.post("/v1/messages")
    async def messages(self, body: MessagesRequest, request: Request) -> Any:
        """Anthropic's Messages API over the chat machinery (``apis/messages_api.py``)."""
        chat = self._chat_of_messages(body, request)
        lora = self._adapter(body.model)
        params = chat.sampling_params(chat.output_limit(), reasoning=self.reasoning is not None,
                                      tool_format=self.tool_parser.xgrammar_format)
        fmt = MessagesFormat(ChatFormat(self._name_for(lora), self.reasoning, None,
                                        self.tool_parser if chat.calls_tools else None,
                                        chat.tool_schemas()), body.shows_thinking)
        if body.stream:
            return await self._streaming_response([chat.prompt()], params, fmt, chat, lora=lora)
        return JSONResponse(fmt.full(await self._finals([chat.prompt()], params, lora=lora)))

    @api.post("/v1/messages/count_tokens")
    async def count_tokens(self, body: CountTokensRequest, request: Request) -> JSONResponse:
        chat = self._chat_of_messages(body, request)
        tokens = await self._ask_driver(self.engines.tokenize(chat.prompt()), "messages")
        return JSONResponse({"input_tokens": len(tokens)})

    def _chat_of_messages(self, body: MessagesRequest, request: Request) -> ChatCompletionRequest:
        self._authorize(request)
        self._adapter(body.model)
        self._require("generate", request)
        chat = body.to_chat()
        chat.check_supported()
        return chat

    # ------------------------------------------------------------- streaming
    async def _streaming_response(self, prompts: list[Any], params: SamplingParams | BeamSearchParams,
                                  fmt: StreamFormat, body: SamplingFields,
                                  wrap: Callable[[AsyncIterator[str]], AsyncIterator[str]]
                                  | None = None, lora: LoRARequest | None = None
                                  ) -> StreamingResponse:
        """Admit every prompt first, so a request the engine rejects gets an HTTP 400 instead
        of a stream that fails at once; then stream. The engine is given back when the body ends
        (or, if the client left before it began, when the response is done). ``wrap``: what
        the route does around the events (``responses`` stores its response)."""
        lease = await self._lease(prompts, lora)
        try:
            sink = await lease.router.add([EngineRequest(p, params, priority=body.priority,
                                                         lora_request=lora)
                                           for p in prompts], stream=True)
        except BaseException:
            lease.release()
            raise
        events = self._sse_body(sink, fmt, body.include_usage, body.continuous_usage, lease)
        if wrap is not None:
            events = wrap(events)
        return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS,
                                 background=end_stream_task(sink, lease))

    async def _sse_body(self, sink: RequestSink, fmt: StreamFormat,
                        include_usage: bool, continuous_usage: bool,
                        lease: Lease) -> AsyncIterator[str]:
        counts = [0] * len(sink.request_ids)  # completion tokens so far, per choice
        deadline = time.monotonic() + self.timeout
        not_before = None  # the first tokens are never held
        self.open_streams += 1
        try:
            # chat: the role, before any token; messages: message_start
            if first := fmt.first_chunks(len(counts), sink.num_prompt_tokens):
                yield "".join(fmt.sse(with_usage(chunk, usage_so_far(sink, i, counts)
                                                 if continuous_usage else None))
                              for i, chunk in enumerate(first))
            # all that arrived since the last write goes out as one write
            while batch := await sink.next_batch(deadline - time.monotonic(), not_before):
                events = []
                for index, out in batch:
                    counts[index] += len(out.delta_token_ids)
                    usage = usage_so_far(sink, index, counts) if continuous_usage else None
                    if (chunk := fmt.chunk(index, out, usage)) is not None:
                        events.append(fmt.sse(chunk))
                if events:
                    yield "".join(events)
                    not_before = self._next_write_at()
            if include_usage:
                yield fmt.sse(fmt.usage_chunk(sink.finals))  # type: ignore[arg-type]
        except Exception as e:  # noqa: BLE001 - after the 200 header: an SSE error event
            yield fmt.error_event(to_openai_error(e))
        finally:
            self.open_streams -= 1
            _end_stream(sink, lease)  # disconnect or failure: free the blocks of what still runs
        if fmt.done:
            yield fmt.done

    # ------------------------------------------------------------ handle API
    async def generate(self, prompt: Any, sampling_params: Any = None,
                       lora_request: LoRARequest | None = None
                       ) -> RequestOutput | list[RequestOutput]:
        """Handle API: the final output (text, token_ids, finish_reason, usage); with ``n > 1``
        or a BeamSearchParams, the list of the choices' (beams', best first) final outputs.
        ``lora_request``: the adapter to run through (the app must serve adapters)."""
        outs = await self._finals([prompt], _params(sampling_params), lora=lora_request)
        return outs[0] if len(outs) == 1 else outs

    async def generate_stream(self, prompt: Any, sampling_params: Any = None,
                              lora_request: LoRARequest | None = None
                              ) -> AsyncIterator[RequestOutput]:
        """Handle API (``handle.options(stream=True)``): deltas (coalesced while the caller
        reads slower than the engine steps), then the final output."""
        lease = await self._lease([prompt], lora_request)
        try:
            sink = await lease.router.add([EngineRequest(prompt, _params(sampling_params),
                                                         lora_request=lora_request)],
                                          stream=True)
            deadline = time.monotonic() + self.timeout
            try:
                while batch := await sink.next_batch(deadline - time.monotonic()):
                    for _, out in batch:
                        yield out
            finally:
                sink.abort()
        finally:
            lease.release()

    async def engine_client(self) -> Any:
        """Handle API: this replica's EngineClient, to call its engine directly from a Ray task
        (``client.stream(...)`` opens the caller's own output channel to the driver); with
        prefix routing, one engine replica's."""
        return await self.engines.engine_client()

    async def check_health(self) -> None:
        """Serve's health check: raises if this replica's own engine, one of its ranks or its
        output channel is gone (an ingress of leased engines has none: Serve checks those). An
        engine still starting passes: Serve would otherwise replace its replica mid-start."""
        if isinstance(self.engines, LocalEngine):
            try:
                await self.engines.check_health()
            except EngineStarting:
                pass

    def __del__(self) -> None:
        engines = getattr(self, "engines", None)
        if engines is not None:
            engines.close()

