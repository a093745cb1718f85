"""``python -m nvray.bench throughput``: nano-vllm's bench workload through ``LLM``, output tok/s.

The workload (``bench_workload``): 256 sequences, seed 0, prompt ids uniform in [0, 10000),
prompt length and max_tokens uniform in [100, 1024], ignore_eos, temperature 0.6, drawn with
the same calls to ``random`` as nano-vllm's bench.py. ``bench_throughput`` runs it in-process
and on Ray (``resolve_placements``: every runtime at TP=1, only Ray beyond), for each
combination of CUDA graphs on/off, ``FEATURES``, overlapped steps and token budgets asked for,
one engine at a time (each waits for the previous one's GPU memory to be released). Each run
gives output and total tok/s (prefill included), its steps and their wall time by kind, and, on
a GPU whose bandwidth and matmul peak were measured, its share of the workload's floors
(``nvray/bench/floor.py``; TP=n: n times them) and, at TP>1, its ``speedup_vs_tp1``.

Multi-LoRA (``--loras N``, ``LoRAWorkload``): each configuration runs twice, on the base model,
then with ``enable_lora`` and N random rank-``--lora-rank`` adapters over ``--max-loras`` GPU
slots (``nvray/bench/lora_adapters.py``; written after start-up for the projections the engine
reports), each request picking one at random and a tenth of them none; the LoRA run gives its
``lora_vs_base`` output tok/s ratio, its adapter loads (swaps) and swaps per second, and an
adapter's first use: a one-token request's latency through an adapter never used (read from
disk, loaded into a slot) beside one through a resident adapter.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from nvray.bench.checkpoints import SHAPES, default_checkpoint, is_config_only
from nvray.bench.floor import (floor_output_tok_per_s, measured_bandwidth, measured_matmul_peak,
                               read_config, roofline_output_tok_per_s)
from nvray.models.tiny import resolve_model
from nvray.sampling_params import SamplingParams
from nvray.bench.cli_args import budgets, names, sizes, word_list
from nvray.config import ALL_REDUCES, KV_CACHE_DTYPES


# what ``--features`` adds to every request of the throughput workload
FEATURES: dict[str, dict[str, Any]] = {
    "plain": {},
    "logprobs": {"logprobs": 5},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
    "filters": {"top_p": 0.95, "top_k": 20},  # Qwen3's recommended sampling
    "top_p": {"top_p": 0.95},  # what many OpenAI clients send: no top-k to bound the candidates
}


@dataclass(frozen=True)
class LoRAWorkload:
    count: int  # adapters the requests pick from
    rank: int = 16
    max_loras: int = 8  # GPU slots
    base_share: float = 0.1  # requests on the base model


def bench_workload(num_seqs: int = 256, seed: int = 0, vocab_size: int | None = None,
                   **extra: Any) -> tuple[list[list[int]], list[SamplingParams]]:
    """nano-vllm's bench.py workload, drawn with the same calls to ``random`` (``extra``:
    more SamplingParams fields for every request); ids wrapped into a ``vocab_size`` of 10000
    or fewer (the tiny model's), the same draws otherwise."""
    rng = random.Random(seed)
    wrap = vocab_size if vocab_size is not None and vocab_size <= 10000 else None
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))]
               for _ in range(num_seqs)]
    if wrap is not None:
        prompts = [[t % wrap for t in p] for p in prompts]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(100, 1024),
                             **extra)
              for _ in range(num_seqs)]
    return prompts, params


def _gpu_memory_used() -> list[int]:
    """Bytes in use on each visible GPU (TP ranks hold the others)."""
    import torch  # noqa: PLC0415

    return [total - free for free, total in
            (torch.cuda.mem_get_info(i) for i in range(torch.cuda.device_count()))]


def _wait_gpu_memory_released(baseline_used: list[int], timeout_s: float = 60.0,
                              settle_s: float = 3.0) -> None:
    """A Ray rank's memory goes back when its process exits, a moment after shutdown. Returns
    once every GPU is back at its baseline, or once use has stopped falling for ``settle_s``:
    an in-process run's CUDA context and allocator cache stay in this process and never come
    back (waiting the whole ``timeout_s`` for them cost a minute of every in-process run)."""
    deadline = time.monotonic() + timeout_s
    lowest, since = None, time.monotonic()
    while time.monotonic() < deadline:
        used = _gpu_memory_used()
        if all(now <= base + (512 << 20) for now, base in zip(used, baseline_used)):
            return
        if lowest is None or sum(used) < lowest - (16 << 20):
            lowest, since = sum(used), time.monotonic()
        elif time.monotonic() - since >= settle_s:
            return
        time.sleep(0.25)
    print(f"GPU memory in use after {timeout_s:.0f} s: {[round(u / 2**30, 1) for u in used]} GiB "
          f"against {[round(b / 2**30, 1) for b in baseline_used]} GiB before the first run",
          file=sys.stderr, flush=True)


def _fit_to_model(model: str, max_model_len: int) -> tuple[int, int]:
    """``max_model_len`` within what the model's positions reach (the tiny model's 2048 under
    the default 4096: said, not refused), and its vocabulary size."""
    from nvray.layers.rotary import rope_max_positions  # noqa: PLC0415
    from nvray.model_config import load_model_config  # noqa: PLC0415
    from nvray.models.tiny import resolve_model  # noqa: PLC0415

    config = load_model_config(resolve_model(model))
    reach = rope_max_positions(config, getattr(config, "layer_types", None))
    if max_model_len > reach:
        print(f"max_model_len {max_model_len} is past the model's reach of {reach} positions: "
              f"running with {reach}", file=sys.stderr, flush=True)
        max_model_len = reach
    return max_model_len, config.vocab_size


def _lora_options(lora: LoRAWorkload | None) -> dict[str, Any]:
    if lora is None:
        return {}
    return {"enable_lora": True, "max_loras": min(lora.max_loras, lora.count),
            "max_lora_rank": lora.rank, "max_cpu_loras": max(lora.count + 1, lora.max_loras)}


def _lora_requests(llm: Any, lora: LoRAWorkload, num_requests: int, folder: str
                   ) -> tuple[list[Any], dict[str, Any]]:
    """Write the adapters (for the projections the engine reports), measure a first use, and
    draw each request's adapter (None: the base)."""
    from nvray import LoRARequest  # noqa: PLC0415
    from nvray.bench.lora_adapters import clone_adapter, write_random_adapter  # noqa: PLC0415

    first = write_random_adapter(os.path.join(folder, "a0"), llm.engine.limits.lora_targets,
                                 lora.rank, seed=0)
    paths = [first] + [clone_adapter(first, os.path.join(folder, f"a{i}"))
                       for i in range(1, lora.count + 1)]
    adapters = [LoRARequest(f"bench-{i}", i + 1, p) for i, p in enumerate(paths)]
    fresh, used = adapters.pop(), adapters[0]
    one = SamplingParams(max_tokens=1)
    prompt = list(range(100, 228))
    llm.generate([prompt], one, use_tqdm=False, lora_request=used)  # resident from now on
    latency = {}
    for name, adapter in (("resident_adapter_ms", used), ("first_use_adapter_ms", fresh)):
        t0 = time.perf_counter()
        llm.generate([prompt], one, use_tqdm=False, lora_request=adapter)
        latency[name] = round(1000 * (time.perf_counter() - t0), 1)
    rng = random.Random(1)
    picks = [None if rng.random() < lora.base_share else adapters[rng.randrange(lora.count)]
             for _ in range(num_requests)]
    return picks, latency


def _throughput_run(model: str, runtime: str, enforce_eager: bool, prompts: list[list[int]],
                    params: list[SamplingParams], engine_kwargs: dict[str, Any],
                    lora: LoRAWorkload | None = None) -> dict[str, Any]:
    overlap = engine_kwargs.get("overlap_scheduling", True)
    from nvray import LLM  # noqa: PLC0415

    t0 = time.perf_counter()
    llm = LLM(model, runtime=runtime, enforce_eager=enforce_eager, **engine_kwargs,
              **_lora_options(lora))
    startup_s = time.perf_counter() - t0
    lora_figures: dict[str, Any] = {}
    try:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=16), use_tqdm=False)  # warm-up
        with tempfile.TemporaryDirectory(prefix="nvray-bench-loras-") as folder:
            picks = None
            if lora is not None:
                picks, lora_figures = _lora_requests(llm, lora, len(prompts), folder)
            before = llm.stats()
            t0 = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=picks)
            elapsed = time.perf_counter() - t0
            stats = llm.stats()
    finally:
        llm.shutdown()
    if lora is not None:
        loads = stats["lora"]["num_loads"] - before["lora"]["num_loads"]
        lora_figures.update(loras=lora.count, lora_rank=lora.rank,
                            max_loras=min(lora.max_loras, lora.count), lora_loads=loads,
                            lora_swaps_per_s=round(loads / elapsed, 2))
    output_tokens = sum(len(o.token_ids) for o in outputs)
    assert output_tokens == sum(p.max_tokens for p in params), "ignore_eos: every request runs to max_tokens"
    return {"runtime": runtime, "cuda_graphs": not enforce_eager, "overlap_scheduling": overlap,
            "startup_s": round(startup_s, 1),
            "elapsed_s": round(elapsed, 2), "output_tokens": output_tokens,
            "prompt_tokens": sum(len(p) for p in prompts),
            "output_tok_per_s": round(output_tokens / elapsed, 1),
            "total_tok_per_s": round((output_tokens + sum(len(p) for p in prompts)) / elapsed, 1),
            "num_kvcache_blocks": stats.get("num_kvcache_blocks"),
            "num_preemptions": stats.get("num_preemptions"),
            **({"expert_load_imbalance": stats["expert_load_imbalance"]}
               if "expert_load_imbalance" in stats else {}),
            **lora_figures,
            **_latencies(before, stats), **_steps_by_kind(before, stats)}


def _latencies(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The run's mean time to first token (every request arrives at once: the queue's wait
    included) and mean inter-token latency, from the engine's histograms."""
    figures = {}
    for key, name, scale in (("time_to_first_token_seconds", "mean_ttft_s", 1),
                             ("inter_token_latency_seconds", "mean_itl_ms", 1000)):
        count = after[key]["count"] - before[key]["count"]
        total = after[key]["sum"] - before[key]["sum"]
        figures[name] = round(scale * total / count, 3) if count else None
    return figures


def _steps_by_kind(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The run's steps and their wall time by kind (prefill, decode), from the engine's stats."""
    figures: dict[str, Any] = {}
    for kind in ("prefill", "decode"):
        figures[f"{kind}_steps"] = after["steps"][kind] - before["steps"][kind]
        seconds = after["step_seconds"][kind] - before["step_seconds"][kind]
        figures[f"{kind}_steps_s"] = round(seconds, 3)
    return figures


def bench_throughput(model: str | None = None, runtimes: tuple[str, ...] = ("inprocess", "ray"),
                     eager: bool = False, num_seqs: int = 256, max_model_len: int = 4096,
                     floor_tok_per_s: float | None = None,
                     overlaps: tuple[bool, ...] = (True,),
                     features: tuple[str, ...] = ("plain",),
                     token_budgets: tuple[int | None, ...] = (None,),
                     tensor_parallel_sizes: tuple[int, ...] = (1,),
                     shape: str = "0.6b",
                     quantizations: tuple[str | None, ...] = (None,),
                     kv_cache_dtypes: tuple[str, ...] = ("auto",),
                     all_reduces: tuple[str, ...] = ("auto",),
                     expert_parallels: tuple[bool, ...] = (False,),
                     pipeline_parallel_sizes: tuple[int, ...] = (1,),
                     lora: LoRAWorkload | None = None) -> dict[str, Any]:
    import torch  # noqa: PLC0415

    placements = resolve_placements(runtimes, tensor_parallel_sizes, pipeline_parallel_sizes)
    dummy = model is None and is_config_only(shape)  # random weights made on the GPU
    model = model or default_checkpoint(shape)
    max_model_len, vocab_size = _fit_to_model(model, max_model_len)
    if "ray" in runtimes:
        from nvray.runtime.cluster import ensure_ray  # noqa: PLC0415
        ensure_ray()
    cuda = torch.cuda.is_available()
    if cuda:  # e.g. TP=2 x PP=2 on a two-GPU machine: said, not tried
        placements = _placements_that_fit(placements, torch.cuda.device_count())
    baseline, runs = (_gpu_memory_used() if cuda else []), []
    split = [(a, ep) for a in all_reduces for ep in expert_parallels]  # how TP>1 splits
    for enforce_eager, feature in itertools.product((False, True) if eager else (False,), features):
        prompts, params = bench_workload(num_seqs, vocab_size=vocab_size, **FEATURES[feature])
        for (runtime, tp, pp), overlap, budget, quant, kv, (reduce, ep) in (
                (p, o, b, q, kv, s) for s in split for kv in kv_cache_dtypes
                for q in quantizations for b in token_budgets for o in overlaps
                for p in placements if p[1] > 1 or s == split[0]):  # TP=1: one way
            options = {"max_model_len": max_model_len, "overlap_scheduling": overlap,
                       "tensor_parallel_size": tp, "pipeline_parallel_size": pp,
                       "quantization": quant, "kv_cache_dtype": kv,
                       "all_reduce": reduce, "enable_expert_parallel": ep,
                       **({"load_format": "dummy"} if dummy else {}),
                       **({"max_num_batched_tokens": budget} if budget is not None else {})}
            with_loras = (None, lora) if lora is not None and runtime == "inprocess" else (None,)
            for workload in with_loras:
                runs.append({"features": feature, "max_num_batched_tokens": budget or "default",
                             "tensor_parallel_size": tp, "pipeline_parallel_size": pp,
                             "quantization": quant, "kv_cache_dtype": kv,
                             "all_reduce": reduce, "expert_parallel": ep,
                             **_throughput_run(model, runtime, enforce_eager, prompts, params,
                                               options, workload)})
                if workload is not None:
                    runs[-1]["lora_vs_base"] = round(
                        runs[-1]["output_tok_per_s"] / runs[-2]["output_tok_per_s"], 3)
                print(json.dumps(runs[-1]), flush=True)
                if cuda:
                    _wait_gpu_memory_released(baseline)
    device = torch.cuda.get_device_name() if cuda else "cpu"
    for run in runs:
        _add_floors(run, _floors(model, device, num_seqs, floor_tok_per_s, run["quantization"],
                                 run["kv_cache_dtype"]))
        _add_speedup_vs_tp1(run, runs)
    return _report(model, device, num_seqs, max_model_len, floor_tok_per_s, runs)


def _report(model: str, device: str, num_seqs: int, max_model_len: int,
            floor_tok_per_s: float | None, runs: list[dict[str, Any]]) -> dict[str, Any]:
    floors = _floors(model, device, num_seqs, floor_tok_per_s, None, "auto")
    return {"benchmark": "throughput", "workload": "nano-vllm bench: 256 seqs, seed 0",
            "model": model, "device": device, "num_seqs": num_seqs,
            "max_model_len": max_model_len, "bandwidth_tb_per_s": measured_bandwidth(device),
            "matmul_tflop_per_s": measured_matmul_peak(device),
            **{name: round(floor) for name, floor in floors.items()}, "runs": runs}


def _placements_that_fit(placements: list[tuple[str, int, int]], num_gpus: int
                         ) -> list[tuple[str, int, int]]:
    """The (runtime, TP, PP) placements this machine's GPUs hold; the others said on stderr."""
    fits = [p for p in placements if p[1] * p[2] <= num_gpus]
    for runtime, tp, pp in sorted(set(placements) - set(fits)):
        print(f"skipped: {runtime} TP={tp} x PP={pp} needs {tp * pp} GPUs, {num_gpus} visible",
              file=sys.stderr, flush=True)
    return fits


def _add_floors(run: dict[str, Any], floors: dict[str, float]) -> None:
    """A run's floors (times its GPUs) and its share of each."""
    for name, floor in floors.items():
        floor *= run["tensor_parallel_size"] * run["pipeline_parallel_size"]  # GPUs
        run[name] = round(floor)
        run["pct_of_" + name.removesuffix("_output_tok_per_s")] = round(
            100 * run["output_tok_per_s"] / floor, 1)


def _floors(model: str, device: str, num_seqs: int, floor: float | None,
            quantization: str | None, kv_cache_dtype: str) -> dict[str, float]:
    """The workload's TP=1 floors (nvray/bench/floor.py) on this device: ``floor`` when given
    (else design.md's bandwidth floor), and the roofline floor, where the device is known."""
    bandwidth, peak = measured_bandwidth(device), measured_matmul_peak(device)
    floors = {} if floor is None else {"floor_output_tok_per_s": floor}
    if bandwidth is None or peak is None:
        return floors
    cfg = read_config(resolve_model(model))
    prompts, params = bench_workload(num_seqs)
    lens = [len(p) for p in prompts], [p.max_tokens for p in params]
    floors.setdefault("floor_output_tok_per_s", floor_output_tok_per_s(
        cfg, *lens, bandwidth, quantization=quantization, kv_cache_dtype=kv_cache_dtype))
    floors["roofline_output_tok_per_s"] = roofline_output_tok_per_s(
        cfg, *lens, bandwidth, peak, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    return floors


def _add_speedup_vs_tp1(run: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    """A run on several GPUs: its throughput over the Ray TP=1 run of the same settings, when
    there is one."""
    if run["tensor_parallel_size"] * run["pipeline_parallel_size"] == 1:
        return
    same = ("features", "max_num_batched_tokens", "cuda_graphs", "overlap_scheduling",
            "quantization", "kv_cache_dtype")  # (not all_reduce, expert_parallel: TP>1's)
    for other in runs:
        if (other["runtime"] == "ray" and other["tensor_parallel_size"] == 1
                and other["pipeline_parallel_size"] == 1 and all(other[k] == run[k] for k in same)):
            run["speedup_vs_tp1"] = round(run["output_tok_per_s"] / other["output_tok_per_s"], 3)


def resolve_placements(runtimes: tuple[str, ...], tensor_parallel_sizes: tuple[int, ...],
                       pipeline_parallel_sizes: tuple[int, ...] = (1,)
                       ) -> list[tuple[str, int, int]]:
    """(runtime, TP size, PP size) to run: every runtime on one GPU, only Ray beyond
    (in-process holds one rank); a size no runtime can run is an error."""
    unknown = [r for r in runtimes if r not in ("inprocess", "ray")]
    if unknown:
        raise ValueError(f"runtimes {unknown}: choose from inprocess, ray")
    if any(tp < 1 for tp in tensor_parallel_sizes):
        raise ValueError(f"tensor-parallel sizes {list(tensor_parallel_sizes)}: each must be >= 1")
    if any(tp > 1 for tp in tensor_parallel_sizes) and "ray" not in runtimes:
        raise ValueError("a tensor-parallel size above 1 needs the ray runtime (--runtimes ray)")
    if any(pp < 1 for pp in pipeline_parallel_sizes):
        raise ValueError(f"pipeline-parallel sizes {list(pipeline_parallel_sizes)}: each must be >= 1")
    if any(pp > 1 for pp in pipeline_parallel_sizes) and "ray" not in runtimes:
        raise ValueError("a pipeline-parallel size above 1 needs the ray runtime (--runtimes ray)")
    return [(r, tp, pp) for pp in pipeline_parallel_sizes for tp in tensor_parallel_sizes
            for r in runtimes if r == "ray" or tp * pp == 1]


def add_arguments(p: Any) -> None:
    p.add_argument("--model", default=None,
                   help="checkpoint directory (default: a random Qwen3-0.6B-shaped bf16 one)")
    p.add_argument("--runtimes", default="inprocess,ray")
    p.add_argument("--eager", action="store_true", help="also run with enforce_eager=True")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--shape", default="0.6b", choices=SHAPES,
                   help="shape of the random checkpoint built without --model: Qwen3 0.6b/8b, "
                        "or a family's (llama3-8b, qwen3-30b-a3b, gemma3-12b: config only, "
                        "random weights made on the GPU)")
    p.add_argument("--tensor-parallel-size", default="1",
                   help="TP sizes to compare, comma-separated, e.g. 1,2 (above 1: Ray only)")
    p.add_argument("--pipeline-parallel-size", default="1",
                   help="PP sizes to compare, comma-separated, e.g. 1,2 (above 1: Ray only; "
                        "each with every TP size)")
    p.add_argument("--floor", type=float, default=None,
                   help="TP=1 physical floor in output tok/s for the %% column (default: from "
                        "the model's shape, the workload and the GPU's measured bandwidth, "
                        "nvray/bench/floor.py; TP=n: n times it)")
    p.add_argument("--overlap", default="on", help="overlapped steps: on, off or on,off")
    p.add_argument("--max-num-batched-tokens", default=None,
                   help="token budgets per step to compare, comma-separated (default: the "
                        "engine's)")
    p.add_argument("--quantization", default="none",
                   help="weights to compare, comma-separated: none (the checkpoint's), fp8 "
                        "(quantized at load)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="KV caches to compare, comma-separated: auto (the compute dtype), fp8")
    p.add_argument("--features", default="plain",
                   help=f"per-request features to add, comma-separated: {', '.join(FEATURES)}")
    p.add_argument("--all-reduce", default="auto",
                   help="TP all-reduces to compare, comma-separated: auto (P2P for decode "
                        "sizes on one host), nccl")
    p.add_argument("--expert-parallel", default="off",
                   help="MoE experts at TP>1 to compare, comma-separated: off (each expert's "
                        "width split over the ranks), on (whole experts per rank)")
    p.add_argument("--loras", type=int, default=0,
                   help="also run with this many random LoRA adapters (a tenth of the requests "
                        "on the base), in-process: lora_vs_base, swaps/s, first-use latency")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=8, help="GPU adapter slots (--loras)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="write each rank's kernel times over 20 decode steps under DIR "
                        "(nvray/worker/step_profiler.py)")


def run(args: Any) -> dict[str, Any]:
    runtimes, tp_sizes = tuple(args.runtimes.split(",")), sizes(args.tensor_parallel_size)
    stages = sizes(args.pipeline_parallel_size, "--pipeline-parallel-size")
    try:
        resolve_placements(runtimes, tp_sizes, stages)  # refused before a checkpoint is built
    except ValueError as e:
        raise SystemExit(f"throughput: {e}") from None
    overlaps = word_list("--overlap", args.overlap, {"on": True, "off": False})
    quantizations = word_list("--quantization", args.quantization, {"none": None, "fp8": "fp8"})
    kv_dtypes = word_list("--kv-cache-dtype", args.kv_cache_dtype, {d: d for d in KV_CACHE_DTYPES})
    all_reduces = word_list("--all-reduce", args.all_reduce, {a: a for a in ALL_REDUCES})
    expert_parallels = word_list("--expert-parallel", args.expert_parallel,
                                 {"off": False, "on": True})
    if args.profile:  # read by the ranks (Ray's local workers inherit this environment)
        os.environ["NVRAY_PROFILE_DIR"] = args.profile
    if args.loras < 0 or args.lora_rank < 1 or args.max_loras < 1:
        raise SystemExit("throughput: --loras must be >= 0, --lora-rank and --max-loras >= 1")
    lora = LoRAWorkload(args.loras, args.lora_rank, args.max_loras) if args.loras else None
    return bench_throughput(args.model, runtimes, args.eager, args.num_seqs, args.max_model_len,
                            args.floor, overlaps, names("--features", args.features,
                                                        list(FEATURES)),
                            budgets(args.max_num_batched_tokens), tp_sizes, args.shape,
                            quantizations, kv_dtypes, all_reduces, expert_parallels, stages, lora)
