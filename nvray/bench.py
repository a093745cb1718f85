"""``python -m nvray.bench``: benchmarks that print and save figures (tests never time things).

Subcommands:
- ``control-plane``: scheduler + block manager time per step, and the whole control plane
  (schedule, step input, stop checks, detokenization) with 256 running sequences; the model is
  replaced by an executor that answers instantly, so only the control plane is timed.
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m nvray.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    cp = sub.add_parser("control-plane", help="scheduler + block manager time per step")
    cp.add_argument("--num-seqs", type=int, default=256)
    cp.add_argument("--steps", type=int, default=200)
    cp.add_argument("--block-size", type=int, default=16)
    p.add_argument("--out", help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    result = bench_control_plane(args.num_seqs, args.steps, args.block_size)
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
