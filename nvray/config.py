"""EngineConfig: every engine setting in one frozen dataclass, validated on construction.

Every engine option is declared here once, with ``nvray.options.option()``: its default, its
help, its bounds and choices, and whether the Serve app and the batch job offer it as an
argument of their own (``exposed``); they and ``LLM`` take their defaults from these fields.
Values only known at run time (the KV block count, EOS ids, the model's HF config) are not kept
here: they live in the objects that discover them. A bad value raises ``ValueError`` naming the
field, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from nvray.options import Option, option, options_of
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

    model: str = option("tiny", "HF checkpoint directory, or 'tiny' for the embedded "
                        "random-weight Qwen3 (no download)")
    max_num_seqs: int = option(256, "sequences per engine batch", ge=1, exposed=True)
    # nano-vllm's default: offline throughput (eager prefill steps cost ~30 ms of host time
    # each, so fewer, larger ones pay); the Serve app's is SERVE_MAX_NUM_BATCHED_TOKENS
    max_num_batched_tokens: int = option(16384, "token budget per engine step", ge=1,
                                         exposed=True)
    max_model_len: int | None = option(None, "prompt + completion limit; default: as far as "
                                       "the model's rope reaches", ge=1, exposed=True)
    hf_overrides: dict[str, Any] | None = option(
        None, "merged over the checkpoint's config.json keys (vLLM's hf_overrides), e.g. YaRN "
        "on Qwen3: '{\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0, "
        "\"original_max_position_embeddings\": 32768}}' (a JSON object string on the command "
        "line)", exposed=True)
    load_format: str = option("auto", "'dummy': random weights made on the device instead of "
                              "read (benchmarks of a model's shape from its config.json alone, "
                              "as vLLM's --load-format dummy)", choices=LOAD_FORMATS)
    kvcache_block_size: int = option(16, "tokens per KV cache block (a power of two)", ge=1,
                                     exposed=True)
    gpu_memory_utilization: float = option(0.9, "share of the GPU's memory this engine may use "
                                           "(weights, activations, graphs, KV cache)", gt=0,
                                           le=1, exposed=True)
    num_kvcache_blocks: int | None = option(None, "KV cache blocks, instead of the count "
                                            "computed from memory", ge=1)
    cpu_kvcache_space_gib: float = option(0.5, "KV cache budget per rank when running on the "
                                          "CPU", gt=0)
    enforce_eager: bool = option(False, "disable CUDA graphs", exposed=True)
    max_prefill_graph_tokens: int = option(512, "CUDA graphs for one-sequence prefills up to "
                                           "this many tokens; 0: off", ge=0, le=4096)
    enable_prefix_caching: bool = option(True, "reuse KV of shared prompt prefixes",
                                         exposed=True)
    enable_chunked_prefill: bool = option(True, "split long prompts over several steps")
    enable_expert_parallel: bool = option(False, "MoE: whole experts per rank instead of a "
                                          "slice of each", exposed=True)
    overlap_scheduling: bool = option(True, "schedule step N+1 while the device runs step N")
    scheduling_policy: str = option("fcfs", "admission order", choices=SCHEDULING_POLICIES,
                                    exposed=True)
    sjf_aging_s: float = option(10.0, "SJF: a request waiting this long goes ahead of shorter "
                                "ones", gt=0)
    tensor_parallel_size: int = option(1, "GPUs (rank actors) per pipeline stage", ge=1, le=64,
                                       exposed=True)
    # the engine keeps one step per stage in flight, over disjoint sequences (nvray/layers/pp.py)
    pipeline_parallel_size: int = option(1, "pipeline stages per engine, each of "
                                         "tensor_parallel_size GPUs (a run of the layers each)",
                                         ge=1, le=64, exposed=True)
    device: str = option("auto", "'auto': cuda when a GPU is visible, else cpu",
                         choices=DEVICES, exposed=True)
    attention_backend: str = option("auto", "attention kernels", choices=ATTENTION_BACKENDS)
    dtype: str = option("auto", "weights and KV dtype", choices=DTYPES, exposed=True)
    quantization: str | None = option(None, "'fp8': quantize a 16/32-bit checkpoint's linear "
                                      "layers to FP8 at load (FP8 checkpoints are detected "
                                      "from config.json)", choices=QUANTIZATIONS, exposed=True)
    kv_cache_dtype: str = option("auto", "'fp8': keys and values stored as e4m3 (scale 1), "
                                 "about twice the KV cache tokens", choices=KV_CACHE_DTYPES,
                                 exposed=True)
    seed: int = option(0, "the seed of weights made at random (load_format='dummy')")
    runtime: str = option("ray", "'ray': driver + rank actors; 'inprocess': TP=1 in the calling "
                          "process", choices=RUNTIMES)
    ray_dispatch: str = option("compiled", "per-step calls to the ranks: a Ray compiled graph "
                               "or plain actor calls", choices=RAY_DISPATCH)
    all_reduce: str = option("auto", "TP all-reduce: 'auto' (over shared GPU memory where it "
                             "pays) or 'nccl'", choices=ALL_REDUCES, exposed=True)
    placement_strategy: str = option("STRICT_PACK", "the ranks' placement group strategy",
                                     choices=PLACEMENT_STRATEGIES)
    num_cpus_per_rank: float = option(0.9, "CPUs per rank actor (CPU engines; 0.9 lets a TP=2 "
                                      "engine and its driver fit 2 cores)", gt=0, exposed=True)
    num_gpus_per_rank: float = option(1.0, "GPU share per rank actor: 0.5 puts two TP=1 "
                                      "engines on one GPU (give each a gpu_memory_utilization "
                                      "of its share)", gt=0, le=1, exposed=True)
    step_timeout_s: float = option(600.0, "a step taking longer means a hung rank: the engine "
                                   "fails", gt=0)
    # nvray/speculative.py
    speculative_config: dict[str, Any] | None = option(
        None, "speculative decoding, vLLM's keys, e.g. '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4}' or '{\"method\": \"draft_model\", \"model\": "
        "\"/ckpt/Qwen3-0.6B\"}' (a JSON object string on the command line)", exposed=True)
    # multi-LoRA (nvray/lora): PEFT adapters named per request, batched in one step
    enable_lora: bool = option(False, "serve LoRA adapters named per request")
    max_loras: int = option(4, "LoRA: adapters resident on the GPU at once (one step batches "
                            "them all)", ge=1, le=256, exposed=True)
    max_lora_rank: int = option(16, "LoRA: the largest adapter rank served", ge=1, le=512,
                                exposed=True)
    max_cpu_loras: int | None = option(None, "LoRA: adapters kept read in host memory; "
                                       "default: max_loras", ge=1, exposed=True)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for opt in options_of(EngineConfig):
            opt.check(getattr(self, opt.name))
        self._validate_relations()
        spec = SpeculativeConfig.of(self.speculative_config)
        if spec is not None and spec.drafts_on_ranks:
            _require(self.pipeline_parallel_size == 1, "pipeline_parallel_size",
                     self.pipeline_parallel_size,
                     f"speculative method {spec.method!r} needs pipeline_parallel_size=1")
        if self.extra:
            raise ValueError(f"unknown engine option(s): {sorted(self.extra)}")

    def _validate_relations(self) -> None:
        """What the fields' bounds and choices (checked first) cannot say alone."""
        _require(isinstance(self.model, str) and bool(self.model), "model", self.model,
                 "a checkpoint directory or 'tiny'")
        bs = self.kvcache_block_size
        _require(bs & (bs - 1) == 0, "kvcache_block_size", bs, "must be a power of two")
        _require(self.num_gpus_per_rank == 1 or self.world_size == 1, "num_gpus_per_rank",
                 self.num_gpus_per_rank,
                 "must be 1 when an engine has several ranks (a rank per GPU)")
        _require(self.hf_overrides is None or (isinstance(self.hf_overrides, dict) and all(
            isinstance(k, str) for k in self.hf_overrides)), "hf_overrides", self.hf_overrides,
            "must be a dict of config.json keys (a JSON object) or None")
        _require(self.runtime == "ray" or self.world_size == 1, "runtime", self.runtime,
                 "tensor_parallel_size > 1 or pipeline_parallel_size > 1 needs runtime='ray'")
        _require(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
                 "max_cpu_loras", self.max_cpu_loras, f"must be >= max_loras={self.max_loras}")
        if not self.enable_lora:
            return
        _require(self.quantization is None, "quantization", self.quantization,
                 "enable_lora needs an unquantized model (LoRA on FP8 layers is not supported)")
        _require(self.pipeline_parallel_size == 1, "pipeline_parallel_size",
                 self.pipeline_parallel_size, "enable_lora needs pipeline_parallel_size=1")

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


def exposed_options() -> list[Option]:
    """The engine options the app and the batch job offer as arguments of their own."""
    return [o for o in options_of(EngineConfig) if o.exposed]
