"""The engine's counters and its ``stats()`` snapshot.

``EngineCounters`` counts what the engine did since start-up: prompt and generation tokens,
requests accepted and finished (by reason), the start-up's seconds by phase, and the steps and
their wall time by kind (``prefill`` when a step computes prompt tokens, with decodes or not,
else ``decode``: ``steppers.py`` says which call counts as which). ``snapshot`` is the dict
``LLMEngine.stats()`` returns (the driver's ``/metrics`` and the benches read it): the
counters, the scheduler's queues, the KV cache's use and prefix-cache hits, the request
metrics, and where they apply the speculator's acceptance, the multi-LoRA slots and expert
parallelism's load by rank.
"""

from __future__ import annotations

import logging
from typing import Any

from nvray.engine.block_manager import BlockManager
from nvray.engine.intake import ModelLimits
from nvray.engine.metrics import RequestMetrics
from nvray.engine.scheduler import Scheduler
from nvray.engine.speculation import Speculator
from nvray.lora.slots import LoRASlots
from nvray.startup_phases import describe
from nvray.step_protocol import Executor

logger = logging.getLogger(__name__)


class EngineCounters:
    def __init__(self) -> None:
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.last_step_tokens = (0, 0)  # (prefill tokens, decode tokens) of the latest step
        self.num_finished = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        self.num_accepted = 0  # requests add_request took; each finishes exactly once
        self.step_seconds = {"prefill": 0.0, "decode": 0.0}
        self.num_steps = {"prefill": 0, "decode": 0}
        self.startup: dict[str, object] = {}  # record_startup: seconds by phase

    def count_finished(self, reason: str | None) -> None:
        reason = reason or "abort"
        self.num_finished[reason] = self.num_finished.get(reason, 0) + 1

    def account_step(self, computes_prompt: bool, seconds: float) -> None:
        kind = "prefill" if computes_prompt else "decode"
        self.step_seconds[kind] += seconds
        self.num_steps[kind] += 1

    def record_startup(self, phases: dict[str, float], total: float,
                       beside: dict[str, float] | None = None) -> None:
        """The start-up's seconds by phase and in all (``bootstrap.create_engine``)."""
        phases = {name: round(seconds, 3) for name, seconds in phases.items()}
        beside = {name: round(seconds, 3) for name, seconds in (beside or {}).items()}
        self.startup = {"total_s": round(total, 3), "phases_s": phases,
                        "other_s": round(max(0.0, total - sum(phases.values())), 3),
                        "beside_s": beside}
        logger.info("engine started in %s%s", describe(phases, total),
                    f" (beside them: {describe(beside)})" if beside else "")


def snapshot(counters: EngineCounters, scheduler: Scheduler, block_manager: BlockManager,
             limits: ModelLimits, metrics: RequestMetrics, executor: Executor,
             speculator: Speculator | None, lora_slots: LoRASlots | None) -> dict[str, Any]:
    spec = {"speculative": speculator.stats()} if speculator is not None else {}
    return {**_base(counters, scheduler, block_manager, limits), **metrics.snapshot(),
            **_expert_load(limits, executor), **spec, **_lora(lora_slots)}


def _base(counters: EngineCounters, scheduler: Scheduler, bm: BlockManager,
          limits: ModelLimits) -> dict[str, Any]:
    return {"num_running": len(scheduler.running),
            "num_waiting": len(scheduler.waiting),
            "kv_cache_usage": bm.usage,
            "kv_cache_peak_usage": bm.peak_usage,
            "num_kvcache_blocks": limits.num_kvcache_blocks,
            "prefix_cache_hit_rate": bm.prefix_hit_rate,
            "prefix_cache_queried_tokens": bm.num_queried_tokens,
            "prefix_cache_hit_tokens": bm.num_hit_tokens,
            "kv_blocks_copied": bm.num_copied_blocks,
            "prompt_tokens": counters.num_prompt_tokens,
            "generation_tokens": counters.num_generation_tokens,
            "num_preemptions": scheduler.num_preemptions,
            "num_accepted": counters.num_accepted,
            "num_finished": dict(counters.num_finished),
            "step_seconds": dict(counters.step_seconds),
            "steps": dict(counters.num_steps),
            "startup": counters.startup,
            "dtypes": limits.dtypes,
            "parallelism": limits.parallelism}


def _lora(slots: LoRASlots | None) -> dict[str, Any]:
    """Multi-LoRA: the adapters in the GPU slots and the loads into them (swaps)."""
    if slots is None:
        return {}
    return {"lora": {"resident": slots.resident(), "num_slots": slots.num_slots,
                     "num_loads": slots.num_loads}}


def _expert_load(limits: ModelLimits, executor: Executor) -> dict[str, Any]:
    """Expert parallel: the (token, expert) pairs each rank's experts computed since start-up
    (``expert_pairs_by_rank``; by expert in checkpoint order: ``expert_pairs_by_expert``) and
    the busiest rank's share over the mean (``expert_load_imbalance``, 1.0 when even)."""
    if not limits.parallelism.get("expert_parallel"):
        return {}
    per_rank = executor.expert_load()
    if not per_rank:  # a rank did not answer: the health check reports it
        return {}
    totals = [sum(load) for load in per_rank]
    mean = sum(totals) / len(totals)
    return {"expert_pairs_by_rank": {str(r): n for r, n in enumerate(totals)},
            "expert_pairs_by_expert": [n for load in per_rank for n in load],
            "expert_load_imbalance": round(max(totals) / mean, 4) if mean else 1.0}
