"""``python -m nvray.bench sampler``: the sampler's cost per step on the GPU, by filter mix.

Each mix (top-p alone, min-p alone, top-k above the candidate bound with top-p, Qwen3's top-k 20
with top-p) samples ``rows`` rows of random bf16 logits over ``vocab`` tokens at temperature 0.6,
through the eager path the CPU takes (``fused=False``: the filters sort the vocabulary) and the
GPU's (``fused=True``: sort-free thresholds, ``kernels/filter_threshold.py``). Per call:
``gpu_ms``, the stream's time from before the launches to after the last kernel (the host idle
first), and ``host_ms``, the time until the call returns when the GPU is still busy with earlier
work (a call that waits for that work shows it here). Medians over ``iters`` calls.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

MIXES: dict[str, dict[str, Any]] = {
    "top_p=0.95": {"top_p": 0.95},
    "min_p=0.05": {"min_p": 0.05},
    "top_k=1500,top_p=0.95": {"top_k": 1500, "top_p": 0.95},
    "top_k=20,top_p=0.95": {"top_k": 20, "top_p": 0.95},
}
_BUSY_CYCLES = 100_000_000  # ~50 ms of GPU work queued ahead of each host-timed call


def _gpu_ms(call: Any, iters: int) -> float:
    import torch  # noqa: PLC0415

    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _host_ms(call: Any, iters: int) -> float:
    import torch  # noqa: PLC0415

    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        torch.cuda._sleep(_BUSY_CYCLES)  # noqa: SLF001 - queued GPU work the call must not wait for
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def bench_sampler(rows: int = 256, vocab: int = 151936, iters: int = 20) -> dict[str, Any]:
    import torch  # noqa: PLC0415

    from nvray.step_protocol import SampleSpec  # noqa: PLC0415
    from nvray.worker.sampler import sample  # noqa: PLC0415

    if not torch.cuda.is_available():
        raise SystemExit("sampler: needs a CUDA GPU")
    logits = torch.randn(rows, vocab, device="cuda").mul(4).bfloat16()
    base = dict(temperature=0.6, top_p=1.0, top_k=-1, min_p=0.0, seed=None, step_index=0)
    runs = []
    for mix, fields in MIXES.items():
        specs = [SampleSpec(**{**base, **fields})] * rows
        for fused in (False, True):
            def call(specs=specs, fused=fused):
                return sample(logits, specs, fused=fused)
            for _ in range(3):
                call()  # compile and warm up
            runs.append({"mix": mix, "path": "fused" if fused else "sort",
                         "gpu_ms": round(_gpu_ms(call, iters), 3),
                         "host_ms": round(_host_ms(call, iters), 3)})
    return {"device": torch.cuda.get_device_name(), "rows": rows, "vocab": vocab,
            "iters": iters, "runs": runs}


def add_arguments(p: Any) -> None:
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--iters", type=int, default=20)


def run(args: Any) -> dict[str, Any]:
    return bench_sampler(args.rows, iters=args.iters)
