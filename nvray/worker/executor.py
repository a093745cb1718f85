"""InProcessExecutor: the step protocol's ``Executor`` (``nvray/step_protocol.py``) over one
``ModelRunner`` (TP=1) in the calling process.

It is the yardstick the Ray executor (``nvray/runtime/ray_executor.py``) is measured against.
"""

from __future__ import annotations

import collections

from nvray.config import EngineConfig
from nvray.step_protocol import StepInput, StepOutput
from nvray.gc_freeze import release_frozen_objects
from nvray.layers.moe import expert_load
from nvray.worker.model_runner import ModelRunner
from nvray.worker.rank_facts import rank_facts
from nvray.worker.startup import num_kvcache_blocks, prepare_kv_cache


class InProcessExecutor:
    def __init__(self, config: EngineConfig, model_path: str) -> None:
        if config.tensor_parallel_size != 1:
            raise ValueError("the in-process executor runs tensor_parallel_size=1 only; "
                             "use the Ray runtime for tensor parallelism")
        self.runner = ModelRunner(config, model_path)
        self.num_blocks = num_kvcache_blocks(self.runner)
        prepare_kv_cache(self.runner, self.num_blocks)
        self.facts = rank_facts(self.runner)
        self.startup_phases = dict(self.runner.startup.seconds)
        self.submitted: collections.deque[StepOutput] = collections.deque()  # submit, collect

    def execute(self, step: StepInput) -> StepOutput:
        return self.runner.steps.execute(step)

    def execute_overlapped(self, step: StepInput | None) -> StepOutput | None:
        return self.runner.steps.execute_overlapped(step)

    def submit(self, step: StepInput) -> None:
        """Pipeline stages' half of the protocol: one stage here, so the step runs now and
        ``collect`` gives its result."""
        self.submitted.append(self.runner.steps.execute(step))

    def collect(self) -> StepOutput:
        return self.submitted.popleft()

    def discard_in_flight(self) -> None:
        self.submitted.clear()
        self.runner.steps.discard_in_flight()

    def expert_load(self) -> list[list[int]]:
        return [expert_load(self.runner.model)]

    def check_health(self) -> None:
        """The runner lives in this process: it cannot die on its own."""

    def idle(self) -> None:
        """Nothing polls for steps here: nothing to do."""

    def shutdown(self) -> None:
        if self.runner is not None:
            release_frozen_objects()  # first: start-up froze the model's reference cycles
            self.runner.close()  # graphs, KV cache and weights: the memory goes back now
        self.runner = None  # type: ignore[assignment]
