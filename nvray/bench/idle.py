"""``python -m nvray.bench idle``: what an idle engine costs, and what waking it costs.

One engine on Ray (``LLM``, the Ray runtime, the compiled graph). After a warm-up request it
stays ``idle_s`` seconds without requests; the figure is the cores each driver and rank process
used over the last ``window_s`` of them (CPU time from ``/proc``). Then time to the first
token of a request that wakes the idle engine (its first steps go through actor calls while a
new graph compiles), against the same request sent right after another: median of ``runs``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from nvray.bench.proc_cpu import cores_in_use
from nvray.sampling_params import SamplingParams


def _first_token_s(llm: Any, prompt: list[int]) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    t0 = time.perf_counter()
    for _ in llm.client.stream(prompt, params):
        return time.perf_counter() - t0
    raise RuntimeError("the request gave no output")


def bench_idle(model: str | None = None, idle_s: float = 5.0, window_s: float = 3.0,
               runs: int = 5, **engine_kwargs: Any) -> dict[str, Any]:
    """``model`` None: the random Qwen3-0.6B-shaped checkpoint on a GPU, else the tiny one."""
    import torch  # noqa: PLC0415

    from nvray import LLM  # noqa: PLC0415
    from nvray.bench.checkpoints import default_checkpoint  # noqa: PLC0415

    model = model or (default_checkpoint() if torch.cuda.is_available() else "tiny")
    llm = LLM(model, **engine_kwargs)
    prompt = list(range(100, 164))
    try:
        _first_token_s(llm, prompt)  # warm-up
        time.sleep(idle_s - window_s)
        cores = cores_in_use(window_s)
        woken, warm = [], []
        for _ in range(runs):
            time.sleep(2.0)  # idle again: past the engine loop's idle second
            woken.append(_first_token_s(llm, prompt))
            warm.append(_first_token_s(llm, prompt))
        return {"model": model, "idle_cores_per_process": sorted(cores.values(), reverse=True),
                "idle_max_cores": max(cores.values(), default=0.0),
                "ttft_waking_ms": round(1e3 * statistics.median(woken), 2),
                "ttft_after_a_request_ms": round(1e3 * statistics.median(warm), 2)}
    finally:
        llm.shutdown()


def add_arguments(p: Any) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--idle-s", type=float, default=5.0)
    p.add_argument("--window-s", type=float, default=3.0)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--max-model-len", type=int, default=4096)


def run(args: Any) -> dict[str, Any]:
    return bench_idle(args.model, args.idle_s, args.window_s, args.runs,
                      max_model_len=args.max_model_len)
