"""``python -m nvray.bench ray-overhead``: what Ray costs per decode step, against in-process.

The same ``LLMEngine`` steps the model in-process and through Ray rank actors (compiled graph,
plain actor calls) at TP=1; the modes run interleaved, ``rounds`` times, so that drift hits
every mode alike. Each round decodes ``num_seqs`` sequences of ``prompt_len`` prompt tokens for
``max_tokens`` tokens; the figure is the median decode step time per mode, and its overhead and
ratio against in-process.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import TYPE_CHECKING, Any

from nvray.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nvray.engine.engine import LLMEngine


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
    from nvray.runtime.cluster import resolve_device  # noqa: PLC0415
    from nvray.runtime.cluster import ensure_ray  # noqa: PLC0415
    from nvray.runtime.placement import create_engine_placement_group  # noqa: PLC0415
    from nvray.runtime.ray_executor import RayExecutor, start_rank_actors  # noqa: PLC0415
    from nvray.worker.executor import InProcessExecutor  # noqa: PLC0415

    ensure_ray()
    config = resolve_device(EngineConfig(model=model, max_model_len=1024, num_cpus_per_rank=0.5))
    engines = {"inprocess": create_engine(config, InProcessExecutor)}
    pgs = []
    for dispatch in ("compiled", "actor_calls"):
        cfg = config.replace(ray_dispatch=dispatch)
        pgs.append(create_engine_placement_group(cfg, cfg.device == "cuda"))
        engines[f"ray_{dispatch}"] = create_engine(
            cfg, lambda c, path, pg=pgs[-1]: RayExecutor(c, path, start_rank_actors(c, pg)))
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


def add_arguments(p: Any) -> None:
    p.add_argument("--model", default="tiny")
    p.add_argument("--num-seqs", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)


def run(args: Any) -> dict[str, Any]:
    return bench_ray_overhead(args.model, args.num_seqs, rounds=args.rounds)
