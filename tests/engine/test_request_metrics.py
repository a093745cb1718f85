"""The engine's per-request histograms (``stats()``, served as vLLM's ``vllm:*`` families by
/metrics, tested in tests/serve): each request's queue, prefill, decode and end-to-end time on
the engine's clock, its token counts and parameters, and tokens per step.

A fake clock set before each step makes every phase a known number: request A runs at once,
B (one sequence at a time) queues until A has finished."""

from __future__ import annotations

from nvray import LLM, SamplingParams
from nvray.engine.metrics import one_two_five

TICK = 10.0  # the fake clock's seconds per step


def _sum(stats: dict, name: str) -> float:
    return stats[name]["sum"]


def test_each_phase_of_a_queued_and_a_running_request_is_timed():
    engine = LLM("tiny", runtime="inprocess", max_model_len=256, max_num_seqs=1,
                 overlap_scheduling=False).engine
    now = [0.0]
    engine.clock = engine.scheduler.clock = lambda: now[0]
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3,
                                                      ignore_eos=True))
    engine.add_request("b", [8, 9, 10, 11], SamplingParams(temperature=0.0, max_tokens=2,
                                                           ignore_eos=True))
    for step in range(1, 20):
        if not engine.has_unfinished_requests():
            break
        now[0] = step * TICK
        engine.step()
    stats = engine.stats()
    # a: arrives at 0, runs steps 1-3 (tokens at 10, 20, 30); b: waits, runs steps 4-5
    assert _sum(stats, "request_queue_time_seconds") == 1 * TICK + 4 * TICK
    assert _sum(stats, "time_to_first_token_seconds") == 1 * TICK + 4 * TICK
    assert _sum(stats, "request_prefill_time_seconds") == 0  # first token in the first step
    assert _sum(stats, "request_decode_time_seconds") == 2 * TICK + 1 * TICK
    assert _sum(stats, "request_inference_time_seconds") == 2 * TICK + 1 * TICK
    assert _sum(stats, "e2e_request_latency_seconds") == 3 * TICK + 5 * TICK
    assert stats["request_time_per_output_token_seconds"]["count"] == 2
    assert _sum(stats, "request_time_per_output_token_seconds") == TICK + TICK
    assert stats["inter_token_latency_seconds"]["count"] == 3  # a: two gaps, b: one
    assert _sum(stats, "request_prompt_tokens") == 3 + 4
    assert _sum(stats, "request_generation_tokens") == 3 + 2
    assert _sum(stats, "request_params_max_tokens") == 3 + 2
    assert stats["request_params_n"]["count"] == 2
    # five steps, each one sequence: a's prompt, two decodes, b's prompt, a decode
    assert stats["iteration_tokens_total"]["count"] == 5
    assert _sum(stats, "iteration_tokens_total") == 3 + 1 + 1 + 4 + 1
    e2e = stats["e2e_request_latency_seconds"]
    assert e2e["cumulative_counts"][-1] == e2e["count"] == 2  # +Inf holds every request


def test_token_count_buckets_are_vllms_one_two_five_up_to_max_model_len():
    assert one_two_five(256) == (1, 2, 5, 10, 20, 50, 100, 200)
    assert one_two_five(1000) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


def test_n_is_counted_once_a_request_and_every_choice_is_timed():
    llm = LLM("tiny", runtime="inprocess", max_model_len=256)
    llm.generate([[5, 6, 7]], SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=1,
                                             ignore_eos=True), use_tqdm=False)
    stats = llm.engine.stats()
    assert (stats["request_params_n"]["count"], _sum(stats, "request_params_n")) == (1, 3)
    assert stats["e2e_request_latency_seconds"]["count"] == 3  # each choice
    # one token each: its time per output token is 0, as vLLM counts it
    assert stats["request_time_per_output_token_seconds"]["count"] == 3
    assert _sum(stats, "request_time_per_output_token_seconds") == 0
