"""AppArgs: the arguments of ``serve run deployments:build_app key=value ...`` (and of a Serve
config file's ``args``), validated by pydantic; every field has a description.

Unknown or invalid arguments fail at start-up with a message naming them. ``engine_config()``
turns the args into the engine's EngineConfig; ``routes_by_prefix()`` says which shape
``deployments.build_app`` gives the app.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, \
    field_validator

from deployments.routing.admission import AdmissionGate
from deployments.ingress.lora_names import parse_lora_modules
from nvray.config import SERVE_MAX_NUM_BATCHED_TOKENS, EngineConfig, exposed_options
from nvray.options import Option, options_of

_ENGINE = EngineConfig()  # the engine's defaults, the one source of each
# The app's own default and help where they differ from the engine's
_APP_DEFAULTS = {"max_num_batched_tokens": (SERVE_MAX_NUM_BATCHED_TOKENS, (
    f"token budget per engine step (the engine's offline default is "
    f"{_ENGINE.max_num_batched_tokens}; smaller prefill chunks keep streams' inter-token "
    f"latency low while long prompts prefill)"))}


def _engine_field(opt: Option) -> tuple[Any, Any]:
    """An engine option as a pydantic field: its type (choices as a Literal), default, help
    and bounds."""
    annotation = opt.annotation
    if opt.choices is not None:
        values = Literal[tuple(c for c in opt.choices if c is not None)]  # type: ignore[valid-type]
        annotation = values | None if None in opt.choices else values
    default, description = _APP_DEFAULTS.get(opt.name, (opt.default, opt.help))
    return annotation, Field(default, description=description, ge=opt.ge, gt=opt.gt, le=opt.le)


def _engine_arguments() -> type[BaseModel]:
    """``model`` and the engine options EngineConfig exposes, one app argument each."""
    model = next(o for o in options_of(EngineConfig) if o.name == "model")
    fields = {o.name: _engine_field(o) for o in (model, *exposed_options())}
    return create_model("EngineArguments", __config__=ConfigDict(
        extra="forbid", protected_namespaces=()), __module__=__name__, **fields)


EngineArguments = _engine_arguments()


class AppArgs(EngineArguments):  # type: ignore[misc, valid-type]
    """The engine's arguments (generated from EngineConfig) and the app's own."""

    served_model_name: str | None = Field(None, description="name clients pass as 'model'; "
                                                            "default: 'tiny' or the directory name")
    enable_lora: bool = Field(_ENGINE.enable_lora, description="serve LoRA adapters (on by "
                              "itself with lora_modules, lora_path or "
                              "allow_runtime_lora_updating)")
    lora_modules: list[Any] | dict[str, str] | None = Field(None, description="LoRA adapters "
                                                           "served by name: 'name=path' strings "
                                                           "or {'name', 'path'} objects; on the "
                                                           "command line 'a=/p/a,b=/p/b' or "
                                                           "JSON")
    lora_path: str | None = Field(None, description="LoRA: a directory of adapter directories; "
                                  "a request's model names one of them by its directory name "
                                  "(or '<base>:<name>'), found on first use")
    allow_runtime_lora_updating: bool = Field(False, description="LoRA: serve POST "
                                              "/v1/load_lora_adapter and /v1/unload_lora_adapter")
    engine_options: dict[str, Any] = Field(default_factory=dict, description="any other "
                                           "EngineConfig option, e.g. {'cpu_kvcache_space_gib': 1} "
                                           "(a JSON object string on the command line)")
    min_replicas: int = Field(1, ge=0, description="autoscaling: fewest engine replicas")
    max_replicas: int = Field(1, ge=1, description="autoscaling: most engine replicas")
    target_ongoing_requests: float = Field(16, gt=0, description="autoscaling: ongoing requests "
                                                                 "per replica to aim for")
    upscale_delay_s: float = Field(30.0, ge=0, description="autoscaling: sustained load before "
                                                           "adding a replica")
    downscale_delay_s: float = Field(600.0, ge=0, description="autoscaling: sustained low load "
                                                              "before removing a replica")
    metrics_interval_s: float = Field(1.0, gt=0, description="autoscaling: how often replicas "
                                      "and handles report their load to Serve (Serve's own "
                                      "default, 10 s, makes a burst wait ~10 s to be seen)")
    look_back_period_s: float = Field(10.0, gt=0, description="autoscaling: the window of load "
                                      "that Serve averages to decide (Serve's default: 30 s)")
    max_ongoing_requests: int = Field(256, ge=1, description="requests a replica takes at once")
    max_queued_requests: int = Field(-1, ge=-1, description="requests that may wait at a replica "
                                                            "beyond max_ongoing_requests; one more "
                                                            "gets an immediate 503 (OpenAI error "
                                                            "JSON); -1: no limit")
    stream_chunks_per_s: float = Field(2000, ge=0, description="SSE chunks a replica writes per "
                                       "second over all its open streams at most: with many "
                                       "streams, each one's tokens merge into fewer, larger "
                                       "chunks (a stream's first tokens and its end are never "
                                       "held); 0: every engine step's tokens at once")
    api_key: str | None = Field(None, description="if set, /v1 requests need 'Authorization: "
                                                  "Bearer <key>' (env NVRAY_API_KEY also works)")
    request_timeout_s: float = Field(600.0, gt=0, description="a request running longer is "
                                                              "aborted (HTTP 504)")
    reasoning_parser: Literal["qwen3"] | None = Field(None, description="'qwen3': chat answers "
                                                      "move <think>...</think> into "
                                                      "reasoning_content (streamed too)")
    tool_call_parser: Literal["hermes", "qwen3_xml", "llama3_json"] | None = Field(
        None, description="the format of the model's tool calls: 'hermes' (<tool_call> blocks "
                          "of JSON: Qwen3), 'qwen3_xml' (<tool_call> blocks of XML: Qwen3.5), "
                          "'llama3_json' (Llama 3.1's JSON objects); default: the checkpoint's "
                          "architecture's (LlamaForCausalLM: llama3_json; Qwen3.5: qwen3_xml)")
    prefix_routing: bool | None = Field(None, description="route each request to the engine "
                                        "replica most likely to hold its prompt's prefix in "
                                        "its KV cache (load permitting); default: on when "
                                        "max_replicas > 1")
    prefix_routing_max_imbalance: int = Field(4, ge=0, description="prefix routing: ongoing "
                                              "requests above the least-loaded replica's that "
                                              "prefix affinity may add")
    ingress_replicas: int | None = Field(None, ge=1, description="prefix routing: replicas of "
                                         "the HTTP/handle ingress in front of the engine "
                                         "replicas; default: max_replicas")
    task: Literal["auto", "generate", "embed", "score"] = Field("auto", description=(
        "what the app serves: 'generate' (completions, chat, messages, responses), 'embed' "
        "(/v1/embeddings) or 'score' (a reranker: /v1/rerank, /v1/score); 'auto': 'embed' for "
        "an embedding checkpoint (sentence-transformers Pooling, a bare Qwen3Model), else "
        "'generate'"))
    responses_stored: int = Field(10_000, ge=0, description="/v1/responses: the most responses "
                                  "kept for previous_response_id and GET (the app's replicas "
                                  "share them; the least recently used go first); 0: none kept")

    def routes_by_prefix(self) -> bool:
        return self.max_replicas > 1 if self.prefix_routing is None else self.prefix_routing

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _lora_modules_from_text(cls, value: Any) -> Any:
        """``lora_modules='sql=/ckpt/sql,chat=/ckpt/chat'`` or a JSON list/object string."""
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError:
                return [item for item in value.split(",") if item]
        return value

    @field_validator("engine_options", "hf_overrides", "speculative_config", mode="before")
    @classmethod
    def _engine_options_from_json(cls, value: Any) -> Any:
        """``serve run ... engine_options='{"num_kvcache_blocks": 4096}'`` passes a string."""
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"not a JSON object: {e}") from None
        return value

    def max_waiting(self) -> int:
        """Requests a replica lets wait for a slot (no limit: Serve's own queue holds them)."""
        return self.max_queued_requests if self.max_queued_requests >= 0 else sys.maxsize

    def serve_max_ongoing_requests(self) -> int:
        """What Serve routes to a replica at once: with a bounded queue, enough that the
        replica's own gate refuses the overflow (in JSON) instead of Serve's proxy."""
        if self.max_queued_requests < 0:
            return self.max_ongoing_requests
        return AdmissionGate.serve_limit(self.max_ongoing_requests, self.max_queued_requests)

    def resolved_api_key(self) -> str | None:
        return self.api_key or os.environ.get("NVRAY_API_KEY") or None

    def name_to_serve(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return os.path.basename(os.path.normpath(self.model)) or self.model

    def engine_config(self) -> EngineConfig:
        """The exposed options from their arguments, any other from ``engine_options``."""
        fields = {o.name: getattr(self, o.name) for o in exposed_options()}
        options = dict(self.engine_options)
        enable_lora = self.serves_loras() or bool(options.pop("enable_lora", False))
        doubled = sorted(set(options) & (set(fields) | {"model"}))
        if doubled:
            raise ValueError(f"engine_options {doubled}: each is an app argument of its own; "
                             "give it as one")
        return EngineConfig.from_kwargs(self.model, **fields, enable_lora=enable_lora, **options)

    def serves_loras(self) -> bool:
        return bool(self.enable_lora or self.lora_modules or self.lora_path
                    or self.allow_runtime_lora_updating)


def parse_args(args: dict[str, Any] | AppArgs | None) -> AppArgs:
    """Validate app args; the error lists every bad or unknown argument by name."""
    if isinstance(args, AppArgs):
        return args
    try:
        parsed = AppArgs.model_validate(dict(args or {}))
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'args'}: {err['msg']}"
                             for err in e.errors())
        raise ValueError(f"invalid nvray app arguments: {problems}") from None
    if parsed.min_replicas > parsed.max_replicas:
        raise ValueError(f"invalid nvray app arguments: min_replicas={parsed.min_replicas} > "
                         f"max_replicas={parsed.max_replicas}")
    try:
        parsed.engine_config()  # engine option errors surface at start-up too
        parse_lora_modules(parsed.lora_modules)
    except ValueError as e:
        raise ValueError(f"invalid nvray app arguments: {e}") from None
    return parsed
