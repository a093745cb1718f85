"""Latency histograms kept by the engine: time to first token and inter-token latency.

Cumulative Prometheus-style buckets, plain Python, picklable: ``snapshot()`` travels in
``LLMEngine.stats()`` and the HTTP layer prints it in Prometheus text format.
"""

from __future__ import annotations

import bisect

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


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


class RequestMetrics:
    def __init__(self) -> None:
        self.ttft = Histogram(TTFT_BUCKETS_S)
        self.itl = Histogram(ITL_BUCKETS_S)

    def observe_request(self, arrival: float, token_times: list[float]) -> None:
        if not token_times:
            return
        self.ttft.observe(token_times[0] - arrival)
        for earlier, later in zip(token_times, token_times[1:]):
            if later > earlier:  # a verified run's tokens arrive together: one gap a step
                self.itl.observe(later - earlier)

    def snapshot(self) -> dict[str, object]:
        return {"time_to_first_token_seconds": self.ttft.snapshot(),
                "inter_token_latency_seconds": self.itl.snapshot()}
