"""``python -m nvray.bench``: benchmarks that print and save figures (tests never time things).

Subcommands:
- ``control-plane``: scheduler + block manager time per step, and the whole control plane
  (schedule, step input, stop checks, detokenization) with 256 running sequences; the model is
  replaced by an executor that answers instantly, so only the control plane is timed.
- ``ray-overhead``: the same LLMEngine stepping the model in-process and through Ray rank
  actors (compiled graph, plain actor calls) at TP=1, interleaved in one run; per decode step.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

from nvray.engine.engine import LLMEngine, ModelLimits
from nvray.engine.step_input import StepInput, build_step_input
from nvray.sampling_params import SamplingParams


class InstantExecutor:
    """Answers every step at once with pseudo-random tokens: isolates the control plane."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab

    def execute(self, step: StepInput) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(step.num_samples)]

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
    sched_us, step_us = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = engine.scheduler.schedule()
        build_step_input(out, engine.stop_ids_of)
        t1 = time.perf_counter()
        sampled = engine.executor.execute(build_step_input(out, engine.stop_ids_of))
        engine._postprocess(out, build_step_input(out, engine.stop_ids_of), sampled)  # noqa: SLF001
        sched_us.append((t1 - t0) * 1e6)
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        step_us.append((time.perf_counter() - t0) * 1e6)
    assert len(engine.scheduler.running) == num_seqs
    return {"benchmark": "control-plane", "num_running_seqs": num_seqs, "block_size": block_size,
            "steps": steps, "schedule_and_step_input_us_median": statistics.median(sched_us),
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
    args = p.parse_args(argv)
    if args.cmd == "control-plane":
        result = bench_control_plane(args.num_seqs, args.steps, args.block_size)
    else:
        result = bench_ray_overhead(args.model, args.num_seqs, rounds=args.rounds)
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
