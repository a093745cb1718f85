"""``python -m nvray.bench structured``: what structured outputs cost, in one engine.

One in-process ``LLM`` (default: the random Qwen3-0.6B-shaped bf16 checkpoint with a tokenizer
of Qwen3's size, 151,669 tokens, so masks cost what they cost with the real vocabulary):

- **throughput**: ``num_seqs`` requests (prompts of 100-400 random ids, seed 0, temperature
  0.6) under ``RECORDS_SCHEMA`` (a list of records: a few hundred tokens of JSON). The same
  prompts then run unconstrained, each with ``max_tokens`` set to the length its constrained
  run produced and ``ignore_eos``, so both runs make the same tokens; then with one request in
  ten constrained against the same lengths unconstrained. Output tok/s of each, the ratios, and
  each run's seconds in prefill and decode steps (the prefix cache is off, so every run
  prefills). The mask threads' host seconds (``GrammarMasks.host_seconds``) come with them.
- **compile**: a 20-field schema compiled cold (``cold_runs`` distinct schemas) and cached:
  p50 of each.
- **ttft**: time to the first token of a lone request whose schema is cached, against an
  unconstrained one (median of ``ttft_runs`` each, alternating).
"""

from __future__ import annotations

import json
import random
import statistics
import time
from typing import Any

from nvray.bench.checkpoints import default_checkpoint
from nvray.sampling_params import SamplingParams

RECORDS_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["records"],
    "properties": {"records": {"type": "array", "minItems": 8, "maxItems": 8, "items": {
        "type": "object", "required": ["id", "name", "ok", "score"],
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                       "name": {"type": "string", "pattern": "^[a-z]{4,12}$"},
                       "ok": {"type": "boolean"},
                       "score": {"type": "integer", "minimum": -100, "maximum": 100}}}}}}


def twenty_field_schema(tag: int) -> dict[str, Any]:
    kinds = [{"type": "string", "maxLength": 16}, {"type": "integer", "minimum": 0},
             {"type": "boolean"}, {"enum": ["a", "b", "c"]}]
    props = {f"field_{tag}_{i}": kinds[i % 4] for i in range(20)}
    return {"type": "object", "properties": props, "required": list(props)}


def _prompts(num_seqs: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng, top = random.Random(seed), min(10000, vocab_size - 1)
    return [[rng.randint(0, top) for _ in range(rng.randint(100, 400))] for _ in range(num_seqs)]


def _timed(llm: Any, prompts: list[list[int]], params: list[SamplingParams]
           ) -> tuple[list[Any], float, dict[str, float]]:
    """The outputs, the seconds they took, and where those went: seconds in prefill and in
    decode steps, the rest (adding the requests, the loop), and the mean decode step (ms)."""
    engine = llm.engine
    before = dict(engine.counters.step_seconds), dict(engine.counters.num_steps)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    spent = {k: engine.counters.step_seconds[k] - before[0][k] for k in ("prefill", "decode")}
    steps = {k: engine.counters.num_steps[k] - before[1][k] for k in ("prefill", "decode")}
    split = {"prefill_s": round(spent["prefill"], 3), "decode_s": round(spent["decode"], 3),
             "other_s": round(elapsed - spent["prefill"] - spent["decode"], 3),
             "decode_steps": steps["decode"],
             "decode_step_ms": round(1e3 * spent["decode"] / max(1, steps["decode"]), 2)}
    return outs, elapsed, split


def _rate(outs: list[Any], seconds: float) -> float:
    return round(sum(len(o.token_ids) for o in outs) / seconds, 1)


def _constrained(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.6, max_tokens=max_tokens,
                          structured_outputs={"json": RECORDS_SCHEMA})


def _same_lengths(lengths: list[int]) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for n in lengths]


def bench_throughput_under_schema(llm: Any, num_seqs: int) -> dict[str, Any]:
    limits = llm.engine.limits
    prompts = _prompts(num_seqs, limits.vocab_size)
    cap = min(1024, limits.max_model_len - 400)
    all_constrained, t_all, all_split = _timed(llm, prompts, [_constrained(cap)] * num_seqs)
    valid = sum(_is_valid(o.text) for o in all_constrained)
    lengths = [len(o.token_ids) for o in all_constrained]
    free, t_free, free_split = _timed(llm, prompts, _same_lengths(lengths))
    tenth = [_constrained(cap) if i % 10 == 0 else p
             for i, p in enumerate(_same_lengths(lengths))]
    mixed, t_mixed, tenth_split = _timed(llm, prompts, tenth)
    masks = getattr(llm.engine.executor.runner, "grammar_masks", None)
    host = {f"mask_host_{k}_s": round(v, 2) for k, v in getattr(masks, "host_seconds", {}).items()}
    return {**host, "num_seqs": num_seqs, "output_tokens": sum(lengths),
            "mean_output_tokens": round(statistics.mean(lengths), 1),
            "valid_json": f"{valid}/{num_seqs}",
            "all_constrained_tok_per_s": _rate(all_constrained, t_all),
            "unconstrained_tok_per_s": _rate(free, t_free),
            "tenth_constrained_tok_per_s": _rate(mixed, t_mixed),
            "all_vs_unconstrained": round(_rate(all_constrained, t_all) / _rate(free, t_free), 3),
            "tenth_vs_unconstrained": round(_rate(mixed, t_mixed) / _rate(free, t_free), 3),
            "time_split": {"all_constrained": all_split, "unconstrained": free_split,
                           "tenth_constrained": tenth_split}}


def _is_valid(text: str) -> bool:
    try:
        import jsonschema  # noqa: PLC0415

        jsonschema.validate(json.loads(text), RECORDS_SCHEMA)
        return True
    except Exception:  # noqa: BLE001 - counted, not raised
        return False


def bench_compile(llm: Any, cold_runs: int) -> dict[str, Any]:
    compiler = llm.engine.intake.grammars
    cold, cached = [], []
    for tag in range(cold_runs):
        spec = ("json", json.dumps(twenty_field_schema(tag)))
        t0 = time.perf_counter()
        compiler.compile(spec)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        compiler.compile(spec)
        cached.append(time.perf_counter() - t0)
    return {"compile_20_fields_cold_p50_ms": round(1e3 * statistics.median(cold), 2),
            "compile_20_fields_cached_p50_ms": round(1e3 * statistics.median(cached), 4)}


def _ttft(llm: Any, params: SamplingParams, request_id: str) -> float:
    engine = llm.engine
    t0 = time.perf_counter()
    engine.add_request(request_id, list(range(100, 356)), params)
    first = None
    for _ in range(1000):
        outs = engine.step()
        if first is None and any(o.request_id == request_id and (o.token_ids or o.delta_token_ids)
                                 for o in outs):
            first = time.perf_counter() - t0
        if not engine.has_unfinished_requests():
            break
    assert first is not None, "no token came"
    return first


def bench_ttft(llm: Any, runs: int) -> dict[str, Any]:
    schema = {"json": twenty_field_schema(999)}
    constrained = SamplingParams(max_tokens=1, structured_outputs=schema)
    llm.engine.intake.grammars.compile(constrained.structured_outputs.spec())  # cached
    free = SamplingParams(max_tokens=1)
    times: dict[str, list[float]] = {"free": [], "cached_schema": []}
    for i in range(runs):
        times["free"].append(_ttft(llm, free, f"free-{i}"))
        times["cached_schema"].append(_ttft(llm, constrained, f"schema-{i}"))
    free_ms = 1e3 * statistics.median(times["free"])
    schema_ms = 1e3 * statistics.median(times["cached_schema"])
    return {"ttft_unconstrained_ms": round(free_ms, 2), "ttft_cached_schema_ms": round(schema_ms, 2),
            "ttft_ratio": round(schema_ms / free_ms, 3)}


def bench_structured(model: str | None = None, num_seqs: int = 256, max_model_len: int = 4096,
                     cold_runs: int = 5, ttft_runs: int = 9) -> dict[str, Any]:
    from nvray import LLM  # noqa: PLC0415

    # no prefix cache: each run prefills its prompts, not only the first
    llm = LLM(model or default_checkpoint(), runtime="inprocess", max_model_len=max_model_len,
              enable_prefix_caching=False)
    try:
        llm.generate([[1, 2, 3]], _constrained(16), use_tqdm=False)  # warm-up, grammar included
        figures = {"model": model or "random Qwen3-0.6B shape (bf16)"}
        figures |= bench_compile(llm, cold_runs)
        figures |= bench_ttft(llm, ttft_runs)
        figures |= bench_throughput_under_schema(llm, num_seqs)
        return figures
    finally:
        llm.shutdown()


def add_arguments(p: Any) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=4096)


def run(args: Any) -> dict[str, Any]:
    return bench_structured(args.model, args.num_seqs, args.max_model_len)
