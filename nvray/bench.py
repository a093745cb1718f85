"""``python -m nvray.bench``: benchmarks that print and save figures (tests never time things).

Subcommands:
- ``control-plane``: scheduler + block manager time per step, and the whole control plane
  (schedule, step input, stop checks, detokenization) with 256 running sequences; the model is
  replaced by an executor that answers instantly, so only the control plane is timed.
- ``ray-overhead``: the same LLMEngine stepping the model in-process and through Ray rank
  actors (compiled graph, plain actor calls) at TP=1, interleaved in one run; per decode step.
- ``throughput``: nano-vllm's "bench" workload (256 sequences, seed 0, prompt ids uniform in
  [0, 10000), prompt length and max_tokens uniform in [100, 1024], ignore_eos, temperature 0.6)
  through ``LLM``, in-process and on Ray, CUDA graphs on and (``--eager``) off; output
  tokens per second, prefill included. Without ``--model`` it builds a Qwen3-0.6B-shaped
  (``--shape 8b``: Qwen3-8B-shaped) checkpoint with random bf16 weights (throughput does not
  depend on weight values here). ``--tensor-parallel-size 1,2`` runs Ray at each TP size
  (in-process at TP=1 only) and gives each TP>1 run its ``speedup_vs_tp1``. On a GPU whose
  bandwidth and matmul peak were measured (H100, H200), each run is also given as a share of
  the workload's bandwidth floor (design.md) and roofline floor (``nvray/bench_floor.py``).
  ``--overlap on,off`` runs each runtime with overlapped steps and without; ``--features
  plain,logprobs,penalties,filters,top_p`` adds top-5 log-probabilities, penalties, top-p 0.95
  with top-k 20 (Qwen3's recommended sampling) or top-p 0.95 alone to every request;
  ``--max-num-batched-tokens 8192,16384`` compares token budgets per step. Each run also gives
  its steps and their wall time by kind (``prefill_steps_s``: steps that launch prompt tokens;
  ``decode_steps_s``: the others), from the engine's stats.
- ``sampler``: the sampler's GPU and host time per step for each filter mix, sorting the
  vocabulary and with the sort-free kernel (``nvray/bench_sampler.py``).
- ``gpu-busy``: GPU busy share of decode wall time (torch profiler), overlapped steps on and off
  (``nvray/bench_gpu_busy.py``).
- ``soak``: minutes of streaming load with random disconnects against the app: unexpected
  errors, driver memory and KV usage over time (``nvray/bench_soak.py``).
- ``serve``: a load generator for the HTTP app (``nvray/bench_serve.py``): concurrency sweep,
  streaming and not, TTFT / inter-token / end-to-end latency percentiles, output tok/s.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any

from nvray.bench_floor import (floor_output_tok_per_s, measured_bandwidth, measured_matmul_peak,
                               read_config, roofline_output_tok_per_s)
from nvray.engine.engine import LLMEngine, ModelLimits
from nvray.engine.step_input import StepInput, StepOutput
from nvray.models.tiny import resolve_model
from nvray.sampling_params import SamplingParams


class InstantExecutor:
    """Answers every step at once with pseudo-random tokens: isolates the control plane."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab

        self.previous: StepOutput | None = None

    def execute(self, step: StepInput) -> StepOutput:
        return StepOutput([self.rng.randrange(3, self.vocab) for _ in range(step.num_samples)])

    def execute_overlapped(self, step: StepInput | None) -> StepOutput | None:
        previous, self.previous = self.previous, (None if step is None else self.execute(step))
        return previous

    def discard_in_flight(self) -> None:
        self.previous = None

    def shutdown(self) -> None:
        pass


def _engine(num_seqs: int, block_size: int, tokenizer: Any, vocab: int) -> LLMEngine:
    limits = ModelLimits(max_model_len=4096, vocab_size=vocab, num_kvcache_blocks=200_000,
                         block_size=block_size, eos_token_ids=())
    return LLMEngine(tokenizer, InstantExecutor(vocab), limits, max_num_seqs=num_seqs,
                     max_num_batched_tokens=1 << 20)


def _fill(engine: LLMEngine, num_seqs: int, vocab: int) -> None:
    rng = random.Random(0)
    for i in range(num_seqs):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(100, 1024))]
        engine.add_request(f"b{i}", prompt, SamplingParams(temperature=0.6, max_tokens=2000,
                                                           ignore_eos=True))
    engine.step()  # one prefill step admits everyone; what follows are pure decode steps


def bench_control_plane(num_seqs: int = 256, steps: int = 200, block_size: int = 16) -> dict[str, Any]:
    from nvray.bootstrap import load_tokenizer  # noqa: PLC0415
    from nvray.models.tiny import tiny_model_path  # noqa: PLC0415

    tokenizer = load_tokenizer(tiny_model_path())
    vocab = len(tokenizer)
    engine = _engine(num_seqs, block_size, tokenizer, vocab)
    _fill(engine, num_seqs, vocab)
    sched_us, input_us, step_us = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = engine.scheduler.schedule()
        t1 = time.perf_counter()
        launched = engine._launch_scheduled(out)  # noqa: SLF001 - step input + accounting
        t2 = time.perf_counter()
        sampled = engine.executor.execute(launched.step_input)
        engine._postprocess(launched, sampled)  # noqa: SLF001
        sched_us.append((t1 - t0) * 1e6)
        input_us.append((t2 - t1) * 1e6)
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        step_us.append((time.perf_counter() - t0) * 1e6)
    assert len(engine.scheduler.running) == num_seqs
    return {"benchmark": "control-plane", "num_running_seqs": num_seqs, "block_size": block_size,
            "steps": steps, "schedule_us_median": statistics.median(sched_us),
            "step_input_us_median": statistics.median(input_us),
            "full_control_plane_step_us_median": statistics.median(step_us),
            "full_control_plane_step_us_p90": sorted(step_us)[int(0.9 * steps)]}


def _decode_step_times(engine: LLMEngine, num_seqs: int, prompt_len: int, max_tokens: int) -> list[float]:
    rng = random.Random(1)
    for i in range(num_seqs):
        prompt = [rng.randrange(3, 400) for _ in range(prompt_len)]
        engine.add_request(f"o{i}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                           ignore_eos=True))
    engine.step()  # prefill
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1e6)
    return times


def bench_ray_overhead(model: str = "tiny", num_seqs: int = 32, prompt_len: int = 64,
                       max_tokens: int = 64, rounds: int = 3) -> dict[str, Any]:
    from nvray.bootstrap import create_engine  # noqa: PLC0415
    from nvray.config import EngineConfig  # noqa: PLC0415
    from nvray.runtime.client import resolve_device  # noqa: PLC0415
    from nvray.runtime.cluster import ensure_ray  # noqa: PLC0415
    from nvray.runtime.placement import create_engine_placement_group  # noqa: PLC0415
    from nvray.runtime.ray_executor import RayExecutor  # noqa: PLC0415
    from nvray.worker.executor import InProcessExecutor  # noqa: PLC0415

    ensure_ray()
    config = resolve_device(EngineConfig(model=model, max_model_len=1024, num_cpus_per_rank=0.5))
    engines = {"inprocess": create_engine(config, InProcessExecutor)}
    pgs = []
    for dispatch in ("compiled", "actor_calls"):
        cfg = config.replace(ray_dispatch=dispatch)
        pgs.append(create_engine_placement_group(cfg, cfg.device == "cuda"))
        engines[f"ray_{dispatch}"] = create_engine(
            cfg, lambda c, path, pg=pgs[-1]: RayExecutor(c, path, pg))
    per_mode: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):  # interleaved, so drift hits every mode alike
        for name, engine in engines.items():
            per_mode[name].append(statistics.median(
                _decode_step_times(engine, num_seqs, prompt_len, max_tokens)))
    for engine in engines.values():
        engine.executor.shutdown()
    from ray.util.placement_group import remove_placement_group  # noqa: PLC0415

    for pg in pgs:
        remove_placement_group(pg)
    medians = {name: statistics.median(v) for name, v in per_mode.items()}
    base = medians["inprocess"]
    return {"benchmark": "ray-overhead", "model": model, "device": config.device,
            "num_seqs": num_seqs, "rounds": rounds, "decode_step_us_median": medians,
            "overhead_us_vs_inprocess": {k: v - base for k, v in medians.items() if k != "inprocess"},
            "ratio_vs_inprocess": {k: v / base for k, v in medians.items() if k != "inprocess"}}


# Qwen3-0.6B's and Qwen3-8B's shapes (config.json of Qwen/Qwen3-0.6B and Qwen/Qwen3-8B). As in the
# real checkpoints, the model's 151936 vocabulary rows are a little more than the tokenizer's
# 151669 tokens, so the LM head, the sampler and the detokenizer cost what they cost with the
# real model.
QWEN3_0_6B_SHAPE: dict[str, Any] = {
    "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True}
QWEN3_8B_SHAPE: dict[str, Any] = {
    **QWEN3_0_6B_SHAPE, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
    "num_attention_heads": 32, "tie_word_embeddings": False}
QWEN3_SHAPES: dict[str, dict[str, Any]] = {"0.6b": QWEN3_0_6B_SHAPE, "8b": QWEN3_8B_SHAPE}
QWEN3_VOCAB, QWEN3_TOKENIZER_VOCAB = 151936, 151669


def random_qwen3_checkpoint(path: str, shape: str = "0.6b", std: float = 0.2) -> str:
    """A Qwen3 checkpoint of the named shape (``QWEN3_SHAPES``) with random bf16 weights at
    ``path`` (built once)."""
    import os  # noqa: PLC0415

    from nvray.models.tiny import build_checkpoint  # noqa: PLC0415

    if shape not in QWEN3_SHAPES:
        raise ValueError(f"unknown Qwen3 shape {shape!r}; choose from {sorted(QWEN3_SHAPES)}")
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    return build_checkpoint(path, QWEN3_SHAPES[shape], seed=0, vocab_size=QWEN3_VOCAB,
                            tokenizer_vocab_size=QWEN3_TOKENIZER_VOCAB, dtype="bfloat16",
                            std=std)


def default_checkpoint(shape: str = "0.6b") -> str:
    """The benchmarks' default model: a Qwen3-shaped random checkpoint in the temp dir."""
    import os  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    path = os.path.join(tempfile.gettempdir(), f"nvray-qwen3-{shape}-random")
    return random_qwen3_checkpoint(path, shape)


# what ``--features`` adds to every request of the throughput workload
FEATURES: dict[str, dict[str, Any]] = {
    "plain": {},
    "logprobs": {"logprobs": 5},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
    "filters": {"top_p": 0.95, "top_k": 20},  # Qwen3's recommended sampling
    "top_p": {"top_p": 0.95},  # what many OpenAI clients send: no top-k to bound the candidates
}


def bench_workload(num_seqs: int = 256, seed: int = 0, **extra: Any
                   ) -> tuple[list[list[int]], list[SamplingParams]]:
    """nano-vllm's bench.py workload, drawn with the same calls to ``random`` (``extra``:
    more SamplingParams fields for every request)."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))]
               for _ in range(num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(100, 1024),
                             **extra)
              for _ in range(num_seqs)]
    return prompts, params


def _gpu_memory_used() -> list[int]:
    """Bytes in use on each visible GPU (TP ranks hold the others)."""
    import torch  # noqa: PLC0415

    return [total - free for free, total in
            (torch.cuda.mem_get_info(i) for i in range(torch.cuda.device_count()))]


def _wait_gpu_memory_released(baseline_used: list[int], timeout_s: float = 60.0) -> None:
    """A Ray rank's memory goes back when its process exits, a moment after shutdown."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        used = _gpu_memory_used()
        if all(now <= base + (512 << 20) for now, base in zip(used, baseline_used)):
            return
        time.sleep(0.5)
    print(f"GPU memory in use after {timeout_s:.0f} s: {[round(u / 2**30, 1) for u in used]} GiB "
          f"against {[round(b / 2**30, 1) for b in baseline_used]} GiB before the first run",
          file=sys.stderr, flush=True)


def _throughput_run(model: str, runtime: str, enforce_eager: bool, prompts: list[list[int]],
                    params: list[SamplingParams], engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    overlap = engine_kwargs.get("overlap_scheduling", True)
    from nvray import LLM  # noqa: PLC0415

    t0 = time.perf_counter()
    llm = LLM(model, runtime=runtime, enforce_eager=enforce_eager, **engine_kwargs)
    startup_s = time.perf_counter() - t0
    try:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=16), use_tqdm=False)  # warm-up
        before = llm.stats()
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        stats = llm.stats()
    finally:
        llm.shutdown()
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
            **_steps_by_kind(before, stats)}


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
                     shape: str = "0.6b") -> dict[str, Any]:
    import torch  # noqa: PLC0415

    placements = _placements(runtimes, tensor_parallel_sizes)
    model = model or default_checkpoint(shape)
    if "ray" in runtimes:
        from nvray.runtime.cluster import ensure_ray  # noqa: PLC0415

        ensure_ray()
    cuda = torch.cuda.is_available()
    baseline = _gpu_memory_used() if cuda else []
    runs = []
    for enforce_eager, feature in ((e, f) for e in ((False, True) if eager else (False,))
                                   for f in features):
        prompts, params = bench_workload(num_seqs, **FEATURES[feature])
        for (runtime, tp), overlap, budget in ((p, o, b) for b in token_budgets for o in overlaps
                                               for p in placements):
            options = {"max_model_len": max_model_len, "overlap_scheduling": overlap,
                       "tensor_parallel_size": tp}
            if budget is not None:
                options["max_num_batched_tokens"] = budget
            runs.append({"features": feature, "max_num_batched_tokens": budget or "default",
                         "tensor_parallel_size": tp,
                         **_throughput_run(model, runtime, enforce_eager, prompts, params, options)})
            print(json.dumps(runs[-1]), flush=True)
            if cuda:
                _wait_gpu_memory_released(baseline)
    device = torch.cuda.get_device_name() if cuda else "cpu"
    floors = _floors(model, device, num_seqs, floor_tok_per_s)
    for run in runs:
        for name, floor in floors.items():
            floor *= run["tensor_parallel_size"]
            run[name] = round(floor)
            run["pct_of_" + name.removesuffix("_output_tok_per_s")] = round(
                100 * run["output_tok_per_s"] / floor, 1)
        _add_speedup_vs_tp1(run, runs)
    return {"benchmark": "throughput", "workload": "nano-vllm bench: 256 seqs, seed 0",
            "model": model, "device": device, "num_seqs": num_seqs,
            "max_model_len": max_model_len, "bandwidth_tb_per_s": measured_bandwidth(device),
            "matmul_tflop_per_s": measured_matmul_peak(device),
            **{name: round(floor) for name, floor in floors.items()}, "runs": runs}


def _floors(model: str, device: str, num_seqs: int, floor: float | None) -> dict[str, float]:
    """The workload's TP=1 floors (nvray/bench_floor.py) on this device: ``floor`` when given
    (else design.md's bandwidth floor), and the roofline floor, where the device is known."""
    bandwidth, peak = measured_bandwidth(device), measured_matmul_peak(device)
    floors = {} if floor is None else {"floor_output_tok_per_s": floor}
    if bandwidth is None or peak is None:
        return floors
    cfg = read_config(resolve_model(model))
    prompts, params = bench_workload(num_seqs)
    lens = [len(p) for p in prompts], [p.max_tokens for p in params]
    floors.setdefault("floor_output_tok_per_s", floor_output_tok_per_s(cfg, *lens, bandwidth))
    floors["roofline_output_tok_per_s"] = roofline_output_tok_per_s(cfg, *lens, bandwidth, peak)
    return floors


def _add_speedup_vs_tp1(run: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    """A TP>1 run's throughput over the Ray TP=1 run of the same settings, when there is one."""
    if run["tensor_parallel_size"] == 1:
        return
    same = ("features", "max_num_batched_tokens", "cuda_graphs", "overlap_scheduling")
    for other in runs:
        if (other["runtime"] == "ray" and other["tensor_parallel_size"] == 1
                and all(other[k] == run[k] for k in same)):
            run["speedup_vs_tp1"] = round(run["output_tok_per_s"] / other["output_tok_per_s"], 3)


def _placements(runtimes: tuple[str, ...], tensor_parallel_sizes: tuple[int, ...]
                ) -> list[tuple[str, int]]:
    """(runtime, TP size) pairs to run: every runtime at TP=1, only Ray beyond (in-process
    holds one rank); a TP size no runtime can run is an error."""
    unknown = [r for r in runtimes if r not in ("inprocess", "ray")]
    if unknown:
        raise ValueError(f"runtimes {unknown}: choose from inprocess, ray")
    if any(tp < 1 for tp in tensor_parallel_sizes):
        raise ValueError(f"tensor-parallel sizes {list(tensor_parallel_sizes)}: each must be >= 1")
    if any(tp > 1 for tp in tensor_parallel_sizes) and "ray" not in runtimes:
        raise ValueError("a tensor-parallel size above 1 needs the ray runtime (--runtimes ray)")
    return [(r, tp) for tp in tensor_parallel_sizes for r in runtimes if r == "ray" or tp == 1]


def _on_off(text: str) -> tuple[bool, ...]:
    values = {"on": True, "off": False}
    words = text.split(",")
    if not words or any(w not in values for w in words):
        raise SystemExit(f"--overlap {text!r}: give on, off or on,off")
    return tuple(values[w] for w in words)


def _budgets(text: str | None) -> tuple[int | None, ...]:
    if text is None:
        return (None,)
    try:
        return tuple(int(b) for b in text.split(","))
    except ValueError:
        raise SystemExit(f"--max-num-batched-tokens {text!r}: give token counts, e.g. 8192,16384") from None


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(n) for n in text.split(","))
    except ValueError:
        raise SystemExit(f"--tensor-parallel-size {text!r}: give sizes, e.g. 1,2") from None


def _features(text: str) -> tuple[str, ...]:
    names = tuple(text.split(","))
    unknown = [n for n in names if n not in FEATURES]
    if unknown:
        raise SystemExit(f"--features: unknown {unknown}; choose from {list(FEATURES)}")
    return names


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m nvray.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", help="also write the figures to this JSON file")
    cp = sub.add_parser("control-plane", parents=[common], help="scheduler + block manager time per step")
    cp.add_argument("--num-seqs", type=int, default=256)
    cp.add_argument("--steps", type=int, default=200)
    cp.add_argument("--block-size", type=int, default=16)
    ro = sub.add_parser("ray-overhead", parents=[common],
                        help="Ray rank actors vs in-process, per decode step")
    ro.add_argument("--model", default="tiny")
    ro.add_argument("--num-seqs", type=int, default=32)
    ro.add_argument("--rounds", type=int, default=3)
    tp = sub.add_parser("throughput", parents=[common],
                        help="nano-vllm's bench workload: output tok/s, in-process and on Ray")
    tp.add_argument("--model", default=None,
                    help="checkpoint directory (default: a random Qwen3-0.6B-shaped bf16 one)")
    tp.add_argument("--runtimes", default="inprocess,ray")
    tp.add_argument("--eager", action="store_true", help="also run with enforce_eager=True")
    tp.add_argument("--num-seqs", type=int, default=256)
    tp.add_argument("--max-model-len", type=int, default=4096)
    tp.add_argument("--shape", default="0.6b", choices=sorted(QWEN3_SHAPES),
                    help="Qwen3 shape of the random checkpoint built without --model")
    tp.add_argument("--tensor-parallel-size", default="1",
                    help="TP sizes to compare, comma-separated, e.g. 1,2 (above 1: Ray only)")
    tp.add_argument("--floor", type=float, default=None,
                    help="TP=1 physical floor in output tok/s for the %% column (default: from "
                         "the model's shape, the workload and the GPU's measured bandwidth, "
                         "nvray/bench_floor.py; TP=n: n times it)")
    tp.add_argument("--overlap", default="on", help="overlapped steps: on, off or on,off")
    tp.add_argument("--max-num-batched-tokens", default=None,
                    help="token budgets per step to compare, comma-separated (default: the engine's)")
    tp.add_argument("--features", default="plain",
                    help=f"per-request features to add, comma-separated: {', '.join(FEATURES)}")
    gb = sub.add_parser("gpu-busy", parents=[common],
                        help="GPU busy share of decode steps (torch profiler), overlap on and off")
    gb.add_argument("--model", default=None)
    gb.add_argument("--batch-sizes", default="256,32", help="running sequences, comma-separated")
    gb.add_argument("--prompt-len", type=int, default=256)
    gb.add_argument("--steps", type=int, default=30)
    gb.add_argument("--max-model-len", type=int, default=4096)
    sm = sub.add_parser("sampler", parents=[common],
                        help="the sampler's GPU and host time per step by filter mix")
    sm.add_argument("--rows", type=int, default=256)
    sm.add_argument("--iters", type=int, default=20)
    sv = sub.add_parser("serve", parents=[common],
                        help="load generator for a running app (or one it starts): latency and tok/s")
    from nvray.bench_serve import add_arguments, run  # noqa: PLC0415

    add_arguments(sv)
    sk = sub.add_parser("soak", parents=[common],
                        help="streaming load with random disconnects for minutes: errors, memory")
    from nvray import bench_soak  # noqa: PLC0415

    bench_soak.add_arguments(sk)
    args = p.parse_args(argv)
    if args.cmd == "serve":
        result = run(args)
    elif args.cmd == "soak":
        result = bench_soak.run(args)
    elif args.cmd == "control-plane":
        result = bench_control_plane(args.num_seqs, args.steps, args.block_size)
    elif args.cmd == "throughput":
        runtimes, sizes = tuple(args.runtimes.split(",")), _sizes(args.tensor_parallel_size)
        try:
            _placements(runtimes, sizes)  # refused before a checkpoint is built
        except ValueError as e:
            raise SystemExit(f"throughput: {e}") from None
        result = bench_throughput(args.model, runtimes, args.eager, args.num_seqs,
                                  args.max_model_len, args.floor, _on_off(args.overlap),
                                  _features(args.features), _budgets(args.max_num_batched_tokens),
                                  sizes, args.shape)
    elif args.cmd == "sampler":
        from nvray.bench_sampler import bench_sampler  # noqa: PLC0415

        result = bench_sampler(args.rows, iters=args.iters)
    elif args.cmd == "gpu-busy":
        from nvray.bench_gpu_busy import bench_gpu_busy  # noqa: PLC0415

        result = bench_gpu_busy(args.model, tuple(int(b) for b in args.batch_sizes.split(",")),
                                args.prompt_len, args.steps, max_model_len=args.max_model_len)
    else:
        result = bench_ray_overhead(args.model, args.num_seqs, rounds=args.rounds)
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
