"""``python -m nvray.bench step-gap``: where a drafting step's time goes, beside a plain one's.

The in-process engine (TP=1) on an echo checkpoint (``speculative.echo_weights``) runs each
concurrency c twice: plain decoding (overlapped steps, the default), then speculation with the
oracle drafter of ``bench speculative`` (the plain run's continuation, kept with the
probability that gives ``mean_acceptance_length``; k fixed). During each timed pass the host's
pieces of a step are timed by wrapping them — the engine's ``step``, the speculator's
``propose``, ``schedule``, ``launch_scheduled`` (the step input), ``update_from_output``
(applying the answer), the step launcher's ``forward`` and ``_sample`` (queueing its kernels)
and the wait for its ids (``SampledIds.result``) — and, on CUDA, each step's span on the device
by events recorded before its forward is queued and after its sampling is. Medians, in
microseconds (the span in milliseconds).

A plain step overlaps the host's work with the step before; a drafting step runs with nothing
in flight (``docs/speculative.md``), so its host work between steps leaves the device idle:
``step`` minus the device span (which starts when the forward's inputs start to be built) is
what overlapping drafting steps could hide. The medians are over every step of the pass: its
prefill step (mostly prefix hits: the warm-up ran the same prompts) and, in the speculative
pass, the steps near ``max_tokens`` that draft less.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Iterator
from typing import Any

from nvray.bench.checkpoints import default_checkpoint, is_config_only
from nvray.bench.engine_here import engine_here
from nvray.bench.speculative import (OracleProposer, echo_weights, greedy_params,
                                     keep_probability, random_prompts)
from nvray.bench.cli_args import add_drafting_workload, sizes


def bench_step_gap(model: str | None = None, shape: str = "0.6b",
                   concurrencies: tuple[int, ...] = (1, 32), k: int = 4,
                   mean_length: float = 3.0, input_len: int = 256,
                   output_len: int = 128) -> dict[str, Any]:
    options: dict[str, Any] = {"max_model_len": input_len + output_len + 8}
    if model is None and is_config_only(shape):
        options["load_format"] = "dummy"
    model = model or default_checkpoint(shape)
    keep = keep_probability(mean_length, k)
    runs: list[dict[str, Any]] = []
    answers: dict[int, list[list[int]]] = {}
    for mode in ("plain", "speculative"):
        spec = None if mode == "plain" else {"method": "ngram", "num_speculative_tokens": k,
                                             "adaptive": False,
                                             "disable_by_batch_size": max(concurrencies)}
        llm = engine_here(model, speculative_config=spec, **options)
        try:
            echo_weights(llm)
            vocab = llm.engine.limits.vocab_size
            for c in concurrencies:
                prompts, params = random_prompts(c, input_len, vocab), greedy_params(c, output_len)
                if mode == "plain":
                    outs = llm.generate(prompts, params, use_tqdm=False)  # (also a warm-up)
                    answers[c] = [list(o.token_ids) for o in outs]
                else:
                    recorded = [p + a for p, a in zip(prompts, answers[c])]
                    llm.engine.speculator.proposer = OracleProposer(recorded, input_len, keep,
                                                                    vocab)
                    llm.generate(prompts, params, use_tqdm=False)  # warm-up
                runs.append({"mode": mode, "concurrency": c, **_timed_pass(llm, prompts, params)})
                print(f"c={c} {mode}: {runs[-1]['tok_per_s']:,.0f} tok/s, step "
                      f"{runs[-1]['step_us']:,.0f} us, device span {runs[-1]['device_span_ms']} ms",
                      flush=True)
        finally:
            llm.shutdown()
    return {"benchmark": "step-gap", "model": model, "k": k,
            "target_mean_acceptance_length": mean_length, "input_len": input_len,
            "output_len": output_len, "runs": runs}


def _timed_pass(llm: Any, prompts: list[list[int]], params: list[Any]) -> dict[str, Any]:
    """One pass with the step's pieces timed: output tok/s, steps, the medians."""
    from nvray.worker.sampled_ids import SampledIds  # noqa: PLC0415

    engine, times, events = llm.engine, {}, []
    runner = engine.executor.runner
    pieces = [(engine, "step", "step"), (engine.scheduler, "schedule", "schedule"),
              (engine, "launch_scheduled", "step_input"),
              (engine, "update_from_output", "apply_answer"),
              (runner.steps, "forward", "rank_forward"),
              (runner.steps, "_sample", "rank_sample"),
              (SampledIds, "result", "wait_for_ids")]
    if engine.speculator is not None:
        pieces.append((engine.speculator, "propose", "propose"))
    with contextlib.ExitStack() as stack:
        for obj, name, key in pieces:
            stack.enter_context(_timing(obj, name, times.setdefault(key, [])))
        stack.enter_context(_device_spans(runner, events))
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    row: dict[str, Any] = {"tok_per_s": round(sum(len(o.token_ids) for o in outs) / elapsed, 1),
                           "steps": len(times["step"])}
    for key, seconds in times.items():
        row[f"{key}_us"] = round(statistics.median(seconds) * 1e6, 1) if seconds else None
    spans = [begin.elapsed_time(end) for begin, end in events if end is not None]
    row["device_span_ms"] = round(statistics.median(spans), 3) if spans else None
    return row


@contextlib.contextmanager
def _timing(obj: Any, name: str, seconds: list[float]) -> Iterator[None]:
    """``obj.name`` timed into ``seconds`` while inside (a class's method: every instance's)."""
    original, own = getattr(obj, name), vars(obj).get(name)  # own: set on obj itself, if so

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    setattr(obj, name, timed)
    try:
        yield
    finally:
        if own is not None:
            setattr(obj, name, own)
        else:
            delattr(obj, name)  # what obj inherits shows again


@contextlib.contextmanager
def _device_spans(runner: Any, spans: list[tuple[Any, Any]]) -> Iterator[None]:
    """On CUDA: an event before each step's forward is queued and one after its sampling is,
    as (begin, end) pairs in ``spans`` (read once the pass is done)."""
    if runner.device.type != "cuda":
        yield
        return
    import torch  # noqa: PLC0415

    steps = runner.steps  # what its launcher calls (worker/step_launcher.py)
    forward, sample = steps.forward, steps._sample

    def marked_forward(*args: Any, **kwargs: Any) -> Any:
        begin = torch.cuda.Event(enable_timing=True)
        begin.record()
        spans.append((begin, None))
        return forward(*args, **kwargs)

    def marked_sample(*args: Any, **kwargs: Any) -> Any:
        out = sample(*args, **kwargs)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        spans[-1] = (spans[-1][0], end)
        return out

    steps.forward, steps._sample = marked_forward, marked_sample
    try:
        yield
    finally:
        steps.forward, steps._sample = forward, sample  # (``_timing``'s, undone after this)
        torch.cuda.synchronize()


def add_arguments(p: Any) -> None:
    add_drafting_workload(p, concurrency="1,32", output_len=128)


def run(args: Any) -> dict[str, Any]:
    concurrencies = sizes(args.concurrency, "--concurrency")
    if min(*concurrencies, args.input_len, args.output_len) < 1:
        raise SystemExit("step-gap: concurrencies and lengths must be >= 1")
    return bench_step_gap(args.model, args.shape, concurrencies, args.num_speculative_tokens,
                          args.mean_acceptance_length, args.input_len, args.output_len)
