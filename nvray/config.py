"""EngineConfig: every engine setting in one frozen dataclass, validated on construction.

Every engine default is written here once: the Serve app's arguments, the batch job's flags
and ``LLM`` take theirs from these fields. Values only known at run time (the KV block count, EOS ids, the model's HF config) are not
kept here: they live in the objects that discover them. A bad value raises ``ValueError``
naming the field, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from nvray.speculative import SpeculativeConfig

SCHEDULING_POLICIES = ("fcfs", "sjf", "priority")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash_attn")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "float16", "bfloat16")
QUANTIZATIONS = (None, "fp8")  # weights; an FP8 checkpoint is detected from its config.json
KV_CACHE_DTYPES = ("auto", "fp8")  # auto: the compute dtype; fp8: e4m3, scale 1
RUNTIMES = ("ray", "inprocess")
LOAD_FORMATS = ("auto", "dummy")  # dummy: random weights on the device, config.json only
RAY_DISPATCH = ("compiled", "actor_calls")
# auto: decode-sized TP all-reduces over P2P shared memory when every rank is on one host
# (nvray/layers/p2p_allreduce.py), NCCL for the rest; nccl: NCCL for all
ALL_REDUCES = ("auto", "nccl")
PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
# The Serve app's step token budget (deployments/args.py): smaller prefill chunks than the
# offline default keep streams' inter-token latency low while long prompts prefill.
SERVE_MAX_NUM_BATCHED_TOKENS = 8192


def _require(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: {allowed}")


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings. ``model`` is a path to an HF-format checkpoint or ``"tiny"``."""

    model: str = "tiny"
    max_num_seqs: int = 256
    # nano-vllm's default: offline throughput (eager prefill steps cost ~30 ms of host time
    # each, so fewer, larger ones pay); the Serve app's is SERVE_MAX_NUM_BATCHED_TOKENS
    max_num_batched_tokens: int = 16384
    max_model_len: int | None = None  # None: as far as the model's rope reaches
    # merged over config.json's top-level keys (vLLM's hf_overrides), e.g. YaRN for Qwen3:
    # {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    hf_overrides: dict[str, Any] | None = None
    # "dummy": random weights made on the device instead of read (benchmarks of a model's shape
    # from its config.json alone, as vLLM's --load-format dummy)
    load_format: str = "auto"
    kvcache_block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_kvcache_blocks: int | None = None  # override the block count computed from memory
    cpu_kvcache_space_gib: float = 0.5  # KV cache budget per rank when running on the CPU
    enforce_eager: bool = False
    max_prefill_graph_tokens: int = 512  # CUDA graphs for one-sequence prefills up to this; 0: off
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    enable_expert_parallel: bool = False  # MoE: whole experts per TP rank instead of slices
    overlap_scheduling: bool = True  # schedule step N+1 while the device runs step N
    scheduling_policy: str = "fcfs"
    sjf_aging_s: float = 10.0  # SJF: a request waiting this long goes ahead of shorter ones
    tensor_parallel_size: int = 1
    # stages of tensor_parallel_size ranks each, a run of layers per stage (nvray/layers/pp.py);
    # the engine keeps one step per stage in flight, over disjoint sequences
    pipeline_parallel_size: int = 1
    device: str = "auto"
    attention_backend: str = "auto"
    dtype: str = "auto"
    quantization: str | None = None  # "fp8": quantize a 16/32-bit checkpoint's linear layers at load
    kv_cache_dtype: str = "auto"  # "fp8": keys and values stored as e4m3 (about twice the blocks)
    seed: int = 0
    runtime: str = "ray"  # "ray": driver + rank actors; "inprocess": TP=1 in the calling process
    ray_dispatch: str = "compiled"  # per-step calls to the ranks: a Ray compiled graph or plain calls
    all_reduce: str = "auto"  # TP all-reduce: "auto" (P2P for decode sizes on one host) or "nccl"
    placement_strategy: str = "STRICT_PACK"
    num_cpus_per_rank: float = 0.9  # CPU per rank actor (CPU engines): TP=2 + driver fit 2 cores
    num_gpus_per_rank: float = 1.0  # GPU share per rank actor: 0.5 lets two TP=1 engines share one
    step_timeout_s: float = 600.0  # a step taking longer means a hung rank: the engine fails
    # speculative decoding (nvray/speculative.py), vLLM's keys, e.g. {"method": "ngram",
    # "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4} or
    # {"method": "draft_model", "model": "/ckpt/Qwen3-0.6B"}; None: off
    speculative_config: dict[str, Any] | None = None
    # multi-LoRA (nvray/lora): PEFT adapters named per request, batched in one step
    enable_lora: bool = False
    max_loras: int = 4  # adapters resident on the GPU at once (slots)
    max_lora_rank: int = 16  # the largest adapter rank a slot holds
    max_cpu_loras: int | None = None  # adapters kept read in host memory (None: max_loras)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._validate_sizes()
        self._validate_choices()
        spec = SpeculativeConfig.of(self.speculative_config)
        if spec is not None and spec.drafts_on_ranks:
            _require(self.pipeline_parallel_size == 1, "pipeline_parallel_size",
                     self.pipeline_parallel_size,
                     f"speculative method {spec.method!r} needs pipeline_parallel_size=1")
        if self.extra:
            raise ValueError(f"unknown engine option(s): {sorted(self.extra)}")

    def _validate_sizes(self) -> None:
        _require(isinstance(self.model, str) and bool(self.model), "model", self.model,
                 "a checkpoint directory or 'tiny'")
        _require(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "must be >= 1")
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
                 self.max_num_batched_tokens, "must be >= 1")
        _require(self.max_model_len is None or self.max_model_len >= 1, "max_model_len",
                 self.max_model_len, "must be >= 1 or None")
        bs = self.kvcache_block_size
        _require(bs >= 1 and bs & (bs - 1) == 0, "kvcache_block_size", bs,
                 "must be a power of two")
        _require(0 <= self.max_prefill_graph_tokens <= 4096, "max_prefill_graph_tokens",
                 self.max_prefill_graph_tokens, "must be in [0, 4096]")
        _require(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
                 self.gpu_memory_utilization, "must be in (0, 1]")
        _require(self.num_kvcache_blocks is None or self.num_kvcache_blocks >= 1,
                 "num_kvcache_blocks", self.num_kvcache_blocks, "must be >= 1 or None")
        _require(self.cpu_kvcache_space_gib > 0, "cpu_kvcache_space_gib",
                 self.cpu_kvcache_space_gib, "must be > 0")
        _require(self.sjf_aging_s > 0, "sjf_aging_s", self.sjf_aging_s, "must be > 0")
        _require(1 <= self.tensor_parallel_size <= 64, "tensor_parallel_size",
                 self.tensor_parallel_size, "must be in [1, 64]")
        _require(1 <= self.pipeline_parallel_size <= 64, "pipeline_parallel_size",
                 self.pipeline_parallel_size, "must be in [1, 64]")
        _require(self.num_cpus_per_rank > 0, "num_cpus_per_rank", self.num_cpus_per_rank,
                 "must be > 0")
        _require(0 < self.num_gpus_per_rank <= 1 and (self.num_gpus_per_rank == 1
                                                       or self.world_size == 1),
                 "num_gpus_per_rank", self.num_gpus_per_rank,
                 "must be in (0, 1], and 1 when an engine has several ranks (a rank per GPU)")
        _require(self.hf_overrides is None or (isinstance(self.hf_overrides, dict) and all(
            isinstance(k, str) for k in self.hf_overrides)), "hf_overrides", self.hf_overrides,
            "must be a dict of config.json keys (a JSON object) or None")
        _require(self.step_timeout_s > 0, "step_timeout_s", self.step_timeout_s, "must be > 0")
        _require(self.runtime == "ray" or self.world_size == 1, "runtime", self.runtime,
                 "tensor_parallel_size > 1 or pipeline_parallel_size > 1 needs runtime='ray'")
        self._validate_lora()

    def _validate_lora(self) -> None:
        _require(1 <= self.max_loras <= 256, "max_loras", self.max_loras, "must be in [1, 256]")
        _require(1 <= self.max_lora_rank <= 512, "max_lora_rank", self.max_lora_rank,
                 "must be in [1, 512]")
        _require(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
                 "max_cpu_loras", self.max_cpu_loras, f"must be >= max_loras={self.max_loras}")
        if not self.enable_lora:
            return
        _require(self.quantization is None, "quantization", self.quantization,
                 "enable_lora needs an unquantized model (LoRA on FP8 layers is not supported)")
        _require(self.pipeline_parallel_size == 1, "pipeline_parallel_size",
                 self.pipeline_parallel_size, "enable_lora needs pipeline_parallel_size=1")

    def _validate_choices(self) -> None:
        for name, allowed in (("scheduling_policy", SCHEDULING_POLICIES),
                              ("device", DEVICES),
                              ("attention_backend", ATTENTION_BACKENDS),
                              ("dtype", DTYPES),
                              ("quantization", QUANTIZATIONS),
                              ("kv_cache_dtype", KV_CACHE_DTYPES),
                              ("runtime", RUNTIMES),
                              ("load_format", LOAD_FORMATS),
                              ("ray_dispatch", RAY_DISPATCH),
                              ("all_reduce", ALL_REDUCES),
                              ("placement_strategy", PLACEMENT_STRATEGIES)):
            value = getattr(self, name)
            _require(value in allowed, name, value, f"must be one of {list(allowed)}")

    @property
    def world_size(self) -> int:
        """Rank actors per engine: ``tensor_parallel_size`` per pipeline stage."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def cpu_loras(self) -> int:
        """Adapters each rank keeps read in host memory."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.of(self.speculative_config)

    @property
    def max_sampled_rows(self) -> int:
        """Most rows a step samples: one per sequence, and with speculation k more for each of
        the at most ``disable_by_batch_size`` sequences that draft (the schedule may admit new
        sequences beside them; never above the token budget)."""
        rows, spec = self.max_num_seqs, self.speculative
        if spec is not None:
            drafting = min(spec.disable_by_batch_size, self.max_num_seqs)
            rows += drafting * spec.num_speculative_tokens
        return min(rows, self.max_num_batched_tokens)

    @property
    def overlaps_steps(self) -> bool:
        """Overlapped steps (placeholders for ids sampled on the device): not with pipeline
        stages, which keep a step per stage in flight instead. With speculation, only the steps
        no sequence may draft from overlap (drafts come from the tokens a step accepted, on
        the host: ``Engine.step``)."""
        return self.overlap_scheduling and self.pipeline_parallel_size == 1

    @classmethod
    def from_kwargs(cls, model: str = "tiny", **kwargs: Any) -> "EngineConfig":
        """Build from keyword arguments; unknown names are an error that lists them."""
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in kwargs.items() if k in names}
        unknown = {k: v for k, v in kwargs.items() if k not in names}
        return cls(model=model, extra=unknown, **known)

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)
