"""Histograms kept by the engine, with vLLM's names and buckets: per-request latencies (time to
first token, queue, prefill, decode, end to end), per-token gaps, per-request token counts and
parameters, and tokens per step.

Cumulative Prometheus-style buckets, plain Python, picklable: ``snapshot()`` travels in
``LLMEngine.stats()`` (one entry per histogram, keyed by its name without ``vllm:``; nvray's
own finer-bucketed two keyed ``nvray_...``) and the
HTTP layer prints it in Prometheus text format (deployments/ingress/metrics.py).

A request's phases, from the engine's clock: it *queues* from arrival until first scheduled,
is in *prefill* until its first token, in *decode* until its last; *inference* is prefill and
decode; *end to end* runs from arrival to its finish (an abort or error included).
"""

from __future__ import annotations

import bisect
from typing import Any

TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_GAP_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                       5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                             40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
# nvray's own two histograms keep their finer buckets (a GPU's decode gaps are under 10 ms)
NVRAY_TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
NVRAY_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def one_two_five(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value``: the buckets of per-request token counts."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def snapshot(self) -> dict[str, object]:
        cumulative, running = [], 0
        for c in self.counts:
            running += c
            cumulative.append(running)
        return {"buckets": list(self.buckets), "cumulative_counts": cumulative,
                "sum": self.sum, "count": self.count}


def _histograms(max_model_len: int) -> dict[str, Histogram]:
    tokens = one_two_five(max_model_len)
    latency = {name: Histogram(REQUEST_LATENCY_BUCKETS_S) for name in (
        "e2e_request_latency_seconds", "request_queue_time_seconds",
        "request_inference_time_seconds", "request_prefill_time_seconds",
        "request_decode_time_seconds")}
    return {"nvray_time_to_first_token_seconds": Histogram(NVRAY_TTFT_BUCKETS_S),
            "nvray_inter_token_latency_seconds": Histogram(NVRAY_ITL_BUCKETS_S),
            "time_to_first_token_seconds": Histogram(TTFT_BUCKETS_S),
            "inter_token_latency_seconds": Histogram(TOKEN_GAP_BUCKETS_S),
            "request_time_per_output_token_seconds": Histogram(TOKEN_GAP_BUCKETS_S),
            **latency,
            "request_prompt_tokens": Histogram(tokens),
            "request_generation_tokens": Histogram(tokens),
            "request_params_max_tokens": Histogram(tokens),
            "request_params_n": Histogram(N_BUCKETS),
            "iteration_tokens_total": Histogram(STEP_TOKEN_BUCKETS)}


class RequestMetrics:
    def __init__(self, max_model_len: int) -> None:
        self.histograms = _histograms(max_model_len)

    def _observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(value)

    def observe_request(self, arrival: float, scheduled: float | None, token_times: list[float],
                        finished: float, num_prompt_tokens: int, params: Any) -> None:
        """One finished choice: ``scheduled`` is when it first ran (None: it never did, and
        its whole life counts as queued), ``token_times`` when each output token came,
        ``params`` its SamplingParams. ``n`` is observed once per request (``observe_n``)."""
        self._observe("e2e_request_latency_seconds", finished - arrival)
        self._observe("request_queue_time_seconds",
                      (scheduled if scheduled is not None else finished) - arrival)
        self._observe("request_prompt_tokens", num_prompt_tokens)
        self._observe("request_generation_tokens", len(token_times))
        if params.max_tokens is not None:
            self._observe("request_params_max_tokens", params.max_tokens)
        if not token_times:
            return
        first, last = token_times[0], token_times[-1]
        for prefix in ("", "nvray_"):
            self._observe(f"{prefix}time_to_first_token_seconds", first - arrival)
        if scheduled is not None:
            self._observe("request_prefill_time_seconds", first - scheduled)
            self._observe("request_inference_time_seconds", last - scheduled)
        self._observe("request_decode_time_seconds", last - first)
        self._observe("request_time_per_output_token_seconds",  # 0 for one token, as vLLM
                      (last - first) / (len(token_times) - 1) if len(token_times) > 1 else 0.0)
        for earlier, later in zip(token_times, token_times[1:]):
            if later > earlier:  # a verified run's tokens arrive together: one gap a step
                for prefix in ("", "nvray_"):
                    self._observe(f"{prefix}inter_token_latency_seconds", later - earlier)

    def observe_n(self, n: int) -> None:
        """A request whose every choice finished: its ``n`` (vLLM counts it once a request)."""
        self._observe("request_params_n", n)

    def observe_step(self, num_tokens: int) -> None:
        """A launched step's tokens (prompt and decode, as scheduled)."""
        self._observe("iteration_tokens_total", num_tokens)

    def snapshot(self) -> dict[str, object]:
        return {name: h.snapshot() for name, h in self.histograms.items()}
