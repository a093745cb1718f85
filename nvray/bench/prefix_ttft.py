"""``python -m nvray.bench prefix-ttft``: time to first token with and without a prefix hit.

One in-process engine (CUDA graphs on, prefix caching on, random weights) per ``--shape``.
Each request is a system prompt of ``system_len`` random tokens and a question of
``question_len`` random tokens, sent alone with ``max_tokens=1``; its TTFT is the wall time of
that call. Misses: ``requests`` prompts each with a system prompt of its own. Hits: one system
prompt shared by ``requests + 2`` prompts with different questions; the first two prime the
cache (the first caches the system prompt's KV; for a model with linear-attention layers the
second keeps the recurrent state where it leaves the cached KV, ``BlockManager``), the rest are
timed, with the tokens each was served from the cache. Figures: median TTFT of each kind and
``speedup`` = miss / hit.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from nvray.bench.checkpoints import SHAPES, default_checkpoint, is_config_only
from nvray.sampling_params import SamplingParams
from nvray.bench.cli_args import names


def _ttft(llm: Any, prompt: list[int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)[0]
    return time.perf_counter() - t0, out.num_cached_tokens


def _run_shape(shape: str, system_len: int, question_len: int, requests: int) -> dict[str, Any]:
    from nvray import LLM  # noqa: PLC0415

    llm = LLM(default_checkpoint(shape), runtime="inprocess",
              max_model_len=system_len + question_len + 16, max_num_seqs=16,
              load_format="dummy" if is_config_only(shape) else "auto")
    rng = random.Random(0)
    vocab = min(10000, llm.engine.limits.vocab_size)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    try:
        _ttft(llm, tokens(system_len + question_len))  # warm-up: the prefill path compiled
        misses = [_ttft(llm, tokens(system_len + question_len))[0] for _ in range(requests)]
        system = tokens(system_len)
        hits = [_ttft(llm, system + tokens(question_len)) for _ in range(requests + 2)][2:]
        hit_rate = llm.stats()["prefix_cache_hit_rate"]
    finally:
        llm.shutdown()
    miss_ms = statistics.median(misses) * 1e3
    hit_ms = statistics.median(t for t, _ in hits) * 1e3
    return {"shape": shape, "ttft_miss_ms_median": round(miss_ms, 1),
            "ttft_hit_ms_median": round(hit_ms, 1), "speedup": round(miss_ms / hit_ms, 2),
            "hit_cached_tokens": sorted({n for _, n in hits}),
            "prefix_cache_hit_rate": round(hit_rate, 3)}


def bench_prefix_ttft(shapes: tuple[str, ...] = ("qwen3.5-9b",), system_len: int = 4096,
                      question_len: int = 64, requests: int = 8) -> dict[str, Any]:
    import torch  # noqa: PLC0415

    runs = []
    for shape in shapes:
        runs.append(_run_shape(shape, system_len, question_len, requests))
        print(runs[-1], flush=True)
    return {"benchmark": "prefix-ttft",
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "system_len": system_len, "question_len": question_len, "requests": requests,
            "runs": runs}


def add_arguments(p: Any) -> None:
    p.add_argument("--shape", default="qwen3.5-9b", help="comma-separated shapes")
    p.add_argument("--system-len", type=int, default=4096)
    p.add_argument("--question-len", type=int, default=64)
    p.add_argument("--requests", type=int, default=8, help="timed requests of each kind")


def run(args: Any) -> dict[str, Any]:
    return bench_prefix_ttft(names("--shape", args.shape, SHAPES), args.system_len,
                             args.question_len, args.requests)
