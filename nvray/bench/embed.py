"""``python -m nvray.bench embed``: ``LLM.embed`` throughput (prompt tok/s, rows/s) as a share
of the prefill floor.

Workload: batches of ``batch`` prompts of ``input_len`` random token ids (uniform in [0, 10000),
or the whole vocabulary if smaller; seed 0), every pass drawn afresh so the prefix cache never
hits. Each engine (in-process and, asked for, on Ray; at each ``max_num_batched_tokens`` asked
for) embeds one warm-up batch, then ``repeats`` batches, each timed from ``llm.embed(batch)`` to
its last embedding. Figures are medians over the timed passes: prompt tok/s, rows/s, and the
pass's wall time inside engine steps against outside them (requests added, results pooled and
normalised in Python).

The prefill floor (``nvray/bench/floor.py``: ``prefill_flops``) is the forward pass's arithmetic
at the GPU's measured dense bf16 matmul peak (``measured_matmul_peak``, TFLOP/s):

    FLOPs per prompt = 2 * P * L  +  2 * 2 * layers * q_heads * head_dim * L(L+1)/2
    floor rows/s     = peak / FLOPs per prompt;  floor tok/s = L * floor rows/s

``P``: the decoder layers' linear parameters a token computes with (no LM head: a pooled row
skips it; the embedding only gathers rows); ``L``: the prompt length; the second term is causal
attention (QK^T and PV), token ``i`` attending to ``i`` keys. Norms, RoPE and activations are
left out, so no engine can beat it.
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import time
from typing import Any

from nvray.bench.checkpoints import SHAPES, default_checkpoint, is_config_only
from nvray.bench.floor import measured_matmul_peak, prefill_flops, read_config
from nvray.bench.throughput import _gpu_memory_used, _wait_gpu_memory_released
from nvray.models.tiny import resolve_model
from nvray.bench.cli_args import budgets, names

FLOOR_FORMULA = ("2*P*L + 2*2*layers*q_heads*head_dim*L(L+1)/2 FLOPs per prompt "
                 "(P: decoder linear params, no LM head) at the bf16 matmul peak")


def random_batches(num: int, batch: int, input_len: int, vocab_size: int,
                   seed: int = 0) -> list[list[list[int]]]:
    """``num`` batches of ``batch`` random token-id prompts of ``input_len`` ids, all distinct."""
    rng, ids = random.Random(seed), range(min(10000, vocab_size))
    return [[rng.choices(ids, k=input_len) for _ in range(batch)] for _ in range(num)]


def _timed_pass(llm: Any, prompts: list[list[int]]) -> dict[str, float]:
    before = llm.stats()
    t0 = time.perf_counter()
    outputs = llm.embed(prompts)
    elapsed = time.perf_counter() - t0
    after = llm.stats()
    assert len(outputs) == len(prompts) and all(o.embedding for o in outputs), "an embedding a row"
    return {"elapsed_s": elapsed,
            "steps": after["steps"]["prefill"] - before["steps"]["prefill"],
            "steps_s": after["step_seconds"]["prefill"] - before["step_seconds"]["prefill"],
            "hit_tokens": after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]}


def _embed_run(model: str, runtime: str, batches: list[list[list[int]]],
               options: dict[str, Any]) -> dict[str, Any]:
    from nvray import LLM  # noqa: PLC0415

    t0 = time.perf_counter()
    llm = LLM(model, runtime=runtime, **options)
    startup_s = time.perf_counter() - t0
    try:
        llm.embed(batches[0])  # warm-up
        passes = [_timed_pass(llm, b) for b in batches[1:]]
    finally:
        llm.shutdown()
    median = {k: statistics.median(p[k] for p in passes) for k in passes[0]}
    rows, tokens = len(batches[1]), sum(len(p) for p in batches[1])
    return {"runtime": runtime, "startup_s": round(startup_s, 1),
            "pass_s_median": round(median["elapsed_s"], 4),
            "pass_s_all": [round(p["elapsed_s"], 4) for p in passes],
            "prompt_tok_per_s": round(tokens / median["elapsed_s"], 1),
            "rows_per_s": round(rows / median["elapsed_s"], 1),
            "prefill_steps_per_pass": median["steps"],
            "in_steps_s_median": round(median["steps_s"], 4),
            "outside_steps_s_median": round(median["elapsed_s"] - median["steps_s"], 4),
            "prefix_cache_hit_tokens": sum(p["hit_tokens"] for p in passes)}


def _floor(cfg: dict[str, Any], device: str, input_len: int) -> dict[str, Any]:
    """The prefill floor of one prompt on ``device`` (module docstring), where its peak is known."""
    flops = prefill_flops(cfg, input_len)
    peak = measured_matmul_peak(device)
    figures: dict[str, Any] = {"floor_formula": FLOOR_FORMULA, "flops_per_prompt": flops,
                               "matmul_tflop_per_s": peak}
    if peak is not None:
        figures["floor_rows_per_s"] = round(peak * 1e12 / flops, 1)
        figures["floor_prompt_tok_per_s"] = round(peak * 1e12 / flops * input_len, 1)
    return figures


def _floor_line(floor: dict[str, Any]) -> str:
    line = f"prefill floor: {floor['flops_per_prompt'] / 1e9:.4g} GFLOP a prompt = {FLOOR_FORMULA}"
    if "floor_rows_per_s" not in floor:
        return line + " (unknown on this device)"
    return (line + f" {floor['matmul_tflop_per_s']:.0f} TFLOP/s: "
            f"{floor['floor_prompt_tok_per_s']:,.0f} prompt tokens/s, "
            f"{floor['floor_rows_per_s']:,.1f} rows/s")


def _summary_line(run: dict[str, Any]) -> str:
    pct = (f", {run['pct_of_floor']}% of the prefill floor" if "pct_of_floor" in run
           else ", prefill floor unknown on this device")
    return (f"embed {run['runtime']}, max_num_batched_tokens {run['max_num_batched_tokens']}: "
            f"{run['prompt_tok_per_s']:,.0f} prompt tokens/s, {run['rows_per_s']:,.1f} rows/s "
            f"(median of {len(run['pass_s_all'])}){pct}")


def bench_embed(model: str | None = None, shape: str = "0.6b", input_len: int = 512,
                batch: int = 256, repeats: int = 5, runtimes: tuple[str, ...] = ("inprocess",),
                token_budgets: tuple[int | None, ...] = (None,)) -> dict[str, Any]:
    import torch  # noqa: PLC0415

    dummy = model is None and is_config_only(shape)  # random weights made on the GPU
    model = model or default_checkpoint(shape)
    if "ray" in runtimes:
        from nvray.runtime.cluster import ensure_ray  # noqa: PLC0415

        ensure_ray()
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else "cpu"
    cfg = read_config(resolve_model(model))
    floor = _floor(cfg, device, input_len)
    print(_floor_line(floor), flush=True)
    baseline = _gpu_memory_used() if cuda else []
    runs = []
    for runtime in runtimes:
        for budget in token_budgets:
            options: dict[str, Any] = {"max_model_len": input_len}
            if dummy:
                options["load_format"] = "dummy"
            if budget is not None:
                options["max_num_batched_tokens"] = budget
            batches = random_batches(repeats + 1, batch, input_len, cfg["vocab_size"],
                                     seed=len(runs))
            run = {"max_num_batched_tokens": budget or "default",
                   **_embed_run(model, runtime, batches, options)}
            if "floor_prompt_tok_per_s" in floor:
                run["pct_of_floor"] = round(100 * run["prompt_tok_per_s"]
                                            / floor["floor_prompt_tok_per_s"], 1)
            runs.append(run)
            print(json.dumps(run), flush=True)
            print(_summary_line(run), flush=True)
            if cuda and runtime == "ray":  # a rank's memory goes back when its process exits
                _wait_gpu_memory_released(baseline)
            elif cuda:  # in-process: this process keeps its CUDA context and allocator cache
                gc.collect()
                torch.cuda.empty_cache()
    return {"benchmark": "embed", "workload": f"{batch} random token-id prompts of {input_len}",
            "model": model, "device": device, "input_len": input_len, "batch": batch,
            "repeats": repeats, **floor, "runs": runs}


def add_arguments(p: Any) -> None:
    p.add_argument("--model", default=None,
                   help="checkpoint directory or 'tiny' (default: a random checkpoint of --shape)")
    p.add_argument("--shape", default="0.6b", choices=SHAPES)
    p.add_argument("--input-len", type=int, default=512, help="tokens per prompt")
    p.add_argument("--batch", type=int, default=256, help="prompts per llm.embed call")
    p.add_argument("--repeats", type=int, default=5, help="timed passes (after one warm-up)")
    p.add_argument("--runtimes", default="inprocess", help="inprocess, ray or inprocess,ray")
    p.add_argument("--max-num-batched-tokens", default=None,
                   help="token budgets per step to compare, comma-separated (default: the "
                        "engine's)")


def run(args: Any) -> dict[str, Any]:
    runtimes = names("--runtimes", args.runtimes, ["inprocess", "ray"])
    if min(args.input_len, args.batch, args.repeats) < 1:
        raise SystemExit("embed: --input-len, --batch and --repeats must be >= 1")
    return bench_embed(args.model, args.shape, args.input_len, args.batch, args.repeats,
                       runtimes, budgets(args.max_num_batched_tokens))
