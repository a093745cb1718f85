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

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from deployments.admission import AdmissionGate
from deployments.lora_names import parse_lora_modules
from nvray.config import SERVE_MAX_NUM_BATCHED_TOKENS, EngineConfig

_ENGINE = EngineConfig()  # the engine's defaults, the one source of each


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field("tiny", description="HF checkpoint directory, or 'tiny' for the embedded "
                                           "random-weight Qwen3 (no download)")
    served_model_name: str | None = Field(None, description="name clients pass as 'model'; "
                                                            "default: 'tiny' or the directory name")
    tensor_parallel_size: int = Field(_ENGINE.tensor_parallel_size, ge=1, le=64, description="GPUs (rank actors) per pipeline stage")
    pipeline_parallel_size: int = Field(_ENGINE.pipeline_parallel_size, ge=1, le=64,
                                        description="pipeline stages per engine, each of "
                                        "tensor_parallel_size GPUs (a run of the layers each)")
    enable_expert_parallel: bool = Field(_ENGINE.enable_expert_parallel, description="MoE: whole "
                                         "experts per rank instead of a slice of each")
    all_reduce: Literal["auto", "nccl"] = Field(_ENGINE.all_reduce, description="TP all-reduce: "
                                                "'auto' (over shared GPU memory where it pays) "
                                                "or 'nccl'")
    device: Literal["auto", "cpu", "cuda"] = Field(_ENGINE.device, description="'auto': cuda when a GPU "
                                                                       "is visible, else cpu")
    max_model_len: int | None = Field(None, ge=1, description="prompt + completion limit; "
                                                              "default: the model's")
    max_num_seqs: int = Field(_ENGINE.max_num_seqs, ge=1, description="sequences per engine batch")
    max_num_batched_tokens: int = Field(SERVE_MAX_NUM_BATCHED_TOKENS, ge=1, description=(
        f"token budget per engine step (the engine's offline default is "
        f"{_ENGINE.max_num_batched_tokens}; smaller prefill chunks keep streams' inter-token "
        f"latency low while long prompts prefill)"))
    gpu_memory_utilization: float = Field(_ENGINE.gpu_memory_utilization, gt=0, le=1, description="share of the GPU's memory "
                                                                       "this engine may use (weights, activations, graphs, KV cache)")
    kvcache_block_size: int = Field(_ENGINE.kvcache_block_size, ge=1, description="tokens per KV cache block")
    enable_prefix_caching: bool = Field(_ENGINE.enable_prefix_caching, description="reuse KV of shared prompt prefixes")
    enforce_eager: bool = Field(_ENGINE.enforce_eager, description="disable CUDA graphs")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(_ENGINE.dtype, description="weights "
                                                                                        "and KV dtype")
    quantization: Literal["fp8"] | None = Field(_ENGINE.quantization, description="'fp8': "
                                                "quantize a 16/32-bit checkpoint's linear layers "
                                                "to FP8 at load (FP8 checkpoints are detected "
                                                "from config.json)")
    kv_cache_dtype: Literal["auto", "fp8"] = Field(_ENGINE.kv_cache_dtype, description="'fp8': "
                                                   "keys and values stored as e4m3 (scale 1), "
                                                   "about twice the KV cache tokens")
    scheduling_policy: Literal["fcfs", "sjf", "priority"] = Field(_ENGINE.scheduling_policy, description="admission "
                                                                                      "order")
    num_cpus_per_rank: float = Field(_ENGINE.num_cpus_per_rank, gt=0, description="CPUs per rank actor (CPU engines; "
                                     "0.9 lets a TP=2 engine and its replica fit 2 cores)")
    num_gpus_per_rank: float = Field(_ENGINE.num_gpus_per_rank, gt=0, le=1, description="GPU share "
                                     "per rank actor: 0.5 puts two TP=1 replicas on one GPU (give "
                                     "each a gpu_memory_utilization of its share)")
    hf_overrides: dict[str, Any] | None = Field(None, description="merged over the checkpoint's "
                                                "config.json keys, e.g. YaRN on Qwen3: "
                                                "'{\"rope_scaling\": {\"rope_type\": \"yarn\", "
                                                "\"factor\": 4.0, \"original_max_position_embeddings\""
                                                ": 32768}}' (a JSON object string on the command line)")
    speculative_config: dict[str, Any] | None = Field(None, description="speculative decoding, "
                                                      "vLLM's keys, e.g. '{\"method\": \"ngram\", "
                                                      "\"num_speculative_tokens\": 4}' (a JSON "
                                                      "object string on the command line)")
    enable_lora: bool = Field(_ENGINE.enable_lora, description="serve LoRA adapters (on by "
                              "itself with lora_modules, lora_path or "
                              "allow_runtime_lora_updating)")
    max_loras: int = Field(_ENGINE.max_loras, ge=1, description="LoRA: adapters resident on "
                           "the GPU at once (one step batches them all)")
    max_lora_rank: int = Field(_ENGINE.max_lora_rank, ge=1, description="LoRA: the largest "
                               "adapter rank served")
    max_cpu_loras: int | None = Field(_ENGINE.max_cpu_loras, ge=1, description="LoRA: adapters "
                                      "kept read in host memory; default: max_loras")
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
        fields = {k: getattr(self, k) for k in (
            "tensor_parallel_size", "pipeline_parallel_size", "enable_expert_parallel",
            "all_reduce", "device",
            "max_model_len", "max_num_seqs",
            "max_num_batched_tokens", "gpu_memory_utilization", "kvcache_block_size",
            "enable_prefix_caching", "enforce_eager", "dtype", "quantization", "kv_cache_dtype", "scheduling_policy",
            "num_cpus_per_rank", "num_gpus_per_rank", "hf_overrides", "speculative_config",
            "max_loras", "max_lora_rank", "max_cpu_loras")}
        options = dict(self.engine_options)
        enable_lora = self.serves_loras() or bool(options.pop("enable_lora", False))
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
