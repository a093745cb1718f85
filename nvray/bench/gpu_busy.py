"""``python -m nvray.bench gpu-busy``: how much of a decode step's wall time the GPU computes.

An in-process engine (CUDA graphs on) is filled with ``num_seqs`` running sequences (random
prompts of ``prompt_len`` tokens, temperature 0.6, ignore_eos), for each batch size asked for;
once every prompt is prefilled,
``steps`` decode steps run under the torch profiler (CUDA activity only, so the host is not
slowed by tracing). GPU busy = the union of kernel intervals / the wall time of those steps.
The same steps also run without the profiler for the step time and decode tok/s. Each mode
(overlapped steps on, off) gets its own engine, one after the other, in one run.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from nvray.bench.checkpoints import default_checkpoint
from nvray.sampling_params import SamplingParams
from nvray.bench.cli_args import sizes


def fill_running(engine: Any, num_seqs: int, prompt_len: int, vocab: int) -> None:
    """Add ``num_seqs`` random prompts of ``prompt_len`` tokens (running to the context's end),
    step until every one is prefilled, then ten decode steps more."""
    rng = random.Random(0)
    params = SamplingParams(temperature=0.6, max_tokens=engine.limits.max_model_len - prompt_len,
                            ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(f"busy{i}", [rng.randrange(3, vocab) for _ in range(prompt_len)], params)
    for _ in range(1000):  # prefill everyone (chunked by the token budget), then warm up
        engine.step()
        sched = engine.scheduler
        if not sched.waiting and all(s.num_computed_tokens >= s.num_prompt_tokens
                                     for s in sched.running):
            break
    for _ in range(10):
        engine.step()


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


def _sync() -> None:
    import torch  # noqa: PLC0415

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _profiled_busy(engine: Any, steps: int) -> dict[str, float]:
    import torch  # noqa: PLC0415
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    _sync()
    activity = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync()
        wall_us = (time.perf_counter() - t0) * 1e6
    kernels = [(e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = _union_us(kernels)
    return {"profiled_wall_ms_per_step": wall_us / steps / 1e3,
            "gpu_kernel_ms_per_step": busy / steps / 1e3,
            "gpu_busy_pct": round(100 * busy / wall_us, 1)}


def step_times(engine: Any, steps: int) -> list[float]:
    times = []
    _sync()
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times


def drain(engine: Any) -> None:
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    for _ in range(10):
        if not engine.has_unfinished_requests():
            return
        engine.step()


def _measure(engine: Any, num_seqs: int, prompt_len: int, steps: int) -> dict[str, Any]:
    fill_running(engine, num_seqs, prompt_len, min(10000, engine.limits.vocab_size))
    times = step_times(engine, steps)
    busy = _profiled_busy(engine, steps)
    assert len(engine.scheduler.running) == num_seqs, "every sequence must still decode"
    drain(engine)
    step_ms = statistics.median(times) * 1e3
    return {"num_seqs": num_seqs, "step_ms_median": round(step_ms, 2),
            "decode_tok_per_s": round(num_seqs / step_ms * 1e3, 1),
            **{k: round(v, 2) for k, v in busy.items()}}


def bench_gpu_busy(model: str | None = None, batch_sizes: tuple[int, ...] = (256, 32),
                   prompt_len: int = 256, steps: int = 30,
                   modes: tuple[bool, ...] = (True, False), max_model_len: int = 4096) -> dict[str, Any]:
    import torch  # noqa: PLC0415

    from nvray import LLM  # noqa: PLC0415

    model = model or default_checkpoint()
    runs = []
    for overlap in modes:
        llm = LLM(model, runtime="inprocess", overlap_scheduling=overlap, max_model_len=max_model_len,
                  max_num_seqs=max(batch_sizes))
        try:
            for num_seqs in batch_sizes:
                runs.append({"overlap_scheduling": overlap,
                             **_measure(llm.engine, num_seqs, prompt_len, steps)})
                print(runs[-1], flush=True)
        finally:
            llm.shutdown()
    return {"benchmark": "gpu-busy", "model": model, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "prompt_len": prompt_len, "steps": steps, "runs": runs}


def add_arguments(p: Any) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--batch-sizes", default="256,32", help="running sequences, comma-separated")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--max-model-len", type=int, default=4096)


def run(args: Any) -> dict[str, Any]:
    return bench_gpu_busy(args.model, sizes(args.batch_sizes, "--batch-sizes"), args.prompt_len,
                          args.steps, max_model_len=args.max_model_len)
