"""``python -m nvray.bench long-context``: decode at long context, hybrid against full attention.

For each ``--shape`` (by default Qwen3.5's 9B-style hybrid and the Qwen3-8B shape), an
in-process engine (CUDA graphs on, random weights) whose context is ``context`` tokens and a
little more is filled with as many of ``num_seqs`` random prompts of ``context`` tokens as its
KV cache holds to the end of the run (a full-attention model holds fewer: each sequence's KV
grows with its context, while a linear-attention layer's state does not); once every one is
prefilled, ``steps`` decode steps are timed. Figures per shape: the KV blocks the cache holds,
the sequences that fit and ran, the median decode step and decode tok/s; and the first shape's
decode tok/s over each other's (``decode_ratio_vs_first``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from nvray.bench.checkpoints import SHAPES, default_checkpoint, is_config_only
from nvray.bench.gpu_busy import drain, fill_running, step_times
from nvray.bench.cli_args import names

DECODE_ROOM = 1024  # tokens a sequence may decode past its prompt during the whole run


def _run_shape(shape: str, num_seqs: int, context: int, steps: int) -> dict[str, Any]:
    from nvray import LLM  # noqa: PLC0415

    # the first sequences decode while the others prefill: room for those tokens too
    max_model_len = context + DECODE_ROOM
    t0 = time.perf_counter()
    llm = LLM(default_checkpoint(shape), runtime="inprocess", max_model_len=max_model_len,
              max_num_seqs=num_seqs, load_format="dummy" if is_config_only(shape) else "auto")
    startup_s = time.perf_counter() - t0
    try:
        engine = llm.engine
        limits = engine.limits
        blocks_per_seq = -(-max_model_len // limits.block_size)
        fits = min(num_seqs, limits.num_kvcache_blocks // blocks_per_seq)
        if fits == 0:
            raise SystemExit(f"long-context: {shape} holds no sequence of {max_model_len} tokens "
                             f"({limits.num_kvcache_blocks} KV blocks)")
        t0 = time.perf_counter()
        fill_running(engine, fits, context, min(10000, limits.vocab_size))
        prefill_s = time.perf_counter() - t0
        times = step_times(engine, steps)
        assert len(engine.scheduler.running) == fits, "every sequence must still decode"
        drain(engine)
    finally:
        llm.shutdown()
    step_ms = statistics.median(times) * 1e3
    return {"shape": shape, "num_kvcache_blocks": limits.num_kvcache_blocks,
            "kv_blocks_per_seq": blocks_per_seq, "num_seqs_asked": num_seqs,
            "num_seqs_run": fits, "startup_s": round(startup_s, 1),
            "prefill_s": round(prefill_s, 1), "step_ms_median": round(step_ms, 2),
            "decode_tok_per_s": round(fits / step_ms * 1e3, 1)}


def bench_long_context(shapes: tuple[str, ...] = ("qwen3.5-9b", "qwen3-8b"), num_seqs: int = 64,
                       context: int = 32768, steps: int = 30) -> dict[str, Any]:
    import torch  # noqa: PLC0415

    runs = []
    for shape in shapes:
        runs.append(_run_shape(shape, num_seqs, context, steps))
        print(runs[-1], flush=True)
    for run in runs[1:]:
        run["decode_ratio_vs_first"] = round(runs[0]["decode_tok_per_s"] / run["decode_tok_per_s"], 2)
    return {"benchmark": "long-context",
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "context": context, "steps": steps, "runs": runs}


def add_arguments(p: Any) -> None:
    p.add_argument("--shape", default="qwen3.5-9b,qwen3-8b", help="comma-separated shapes")
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--context", type=int, default=32768, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=30, help="decode steps timed")


def run(args: Any) -> dict[str, Any]:
    return bench_long_context(names("--shape", args.shape, SHAPES), args.num_seqs, args.context,
                              args.steps)
