"""Step modes: how one ``LLMEngine.step`` hands steps to the executor and reads their results.
The engine picks one stepper at start (``make_stepper``); each reaches the engine through the
``StepSource`` it is given (launch the next step, apply a step's results, count its time).

- ``PlainStepper`` (``overlap=False``): each step runs to completion before the next is
  scheduled.
- ``OverlappedStepper`` (``overlap=True``): each call schedules and launches step N+1 before
  it applies step N's results, so the control plane works while the device computes. A
  sequence that sampled at N is scheduled at N+1 with a placeholder for that token (the ranks
  fill it in on the device, ``nvray/step_protocol.py``); one that finished at N (EOS, stop
  string, max_tokens, abort) drops the token N+1 computes for it. With speculation, a step
  whose tokens the next schedule drafts from runs with nothing in flight and is answered at
  once (``answer_now``); the step in flight, if any, is read first. Both give the same tokens.
- ``PipelinedStepper`` (``pipeline_parallel_size`` P > 1): hands the executor steps while
  fewer than P are in flight and one can be scheduled (the scheduler splits the sequences
  between the steps in flight), then applies the oldest step's ids and hands over the steps
  they make possible before it returns their outputs, so every stage has a step to run.

A call counts its wall time as the kind of the step it launched (``prefill`` when that step
computes prompt tokens, else ``decode``), or, only collecting, of the step it collected.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Protocol

from nvray.engine.launch import LaunchedStep
from nvray.outputs import RequestOutput
from nvray.step_protocol import Executor, StepOutput


class StepSource(Protocol):
    """What a stepper asks of the engine."""

    def launch(self, draft: bool = True) -> LaunchedStep | None:
        """Schedule and launch the next step (None: nothing to run); ``draft`` False: no
        drafts in it."""

    def update_from_output(self, launched: LaunchedStep, result: StepOutput
                           ) -> list[RequestOutput]:
        """Apply a step's results."""

    def account_step(self, step: LaunchedStep, seconds: float) -> None:
        """Count a call's wall time as the kind of ``step``."""


class PlainStepper:
    def __init__(self, source: StepSource, executor: Executor) -> None:
        self.source, self.executor = source, executor
        self.in_flight: list[LaunchedStep] = []  # never any between calls

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        launched = self.source.launch()
        if launched is None:
            return []
        outputs = self.source.update_from_output(launched,
                                                 self.executor.execute(launched.step_input))
        self.source.account_step(launched, time.perf_counter() - start)
        return outputs

    def discard(self) -> None:
        """Forget the steps in flight (a step failed)."""
        self.in_flight.clear()


class OverlappedStepper(PlainStepper):
    def __init__(self, source: StepSource, executor: Executor,
                 drafts_next: Callable[[], bool]) -> None:
        """``drafts_next``: whether the next schedule drafts from the latest tokens."""
        super().__init__(source, executor)
        self.drafts_next = drafts_next

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        if self.drafts_next():
            return self._step_to_draft_from(start)
        launched = self.source.launch(draft=False)
        if launched is None and not self.in_flight:
            return []
        ids = self.executor.execute_overlapped(launched.step_input if launched else None)
        previous = self.in_flight.pop() if self.in_flight else None
        if launched is not None:
            self.in_flight.append(launched)
        outputs = [] if previous is None else self.source.update_from_output(previous, ids)
        self.source.account_step(launched or previous, time.perf_counter() - start)
        return outputs

    def _step_to_draft_from(self, start: float) -> list[RequestOutput]:
        if self.in_flight:  # its tokens are what the drafts follow
            ids = self.executor.execute_overlapped(None)
            previous = self.in_flight.pop()
            self.source.account_step(previous, time.perf_counter() - start)
            return self.source.update_from_output(previous, ids)  # type: ignore[arg-type]
        launched = self.source.launch()
        if launched is None:
            return []
        launched = launched._replace(step_input=dataclasses.replace(launched.step_input,
                                                                    answer_now=True))
        ids = self.executor.execute_overlapped(launched.step_input)
        outputs = self.source.update_from_output(launched, ids)  # type: ignore[arg-type]
        self.source.account_step(launched, time.perf_counter() - start)
        return outputs


class PipelinedStepper(PlainStepper):
    def __init__(self, source: StepSource, executor: Executor, depth: int) -> None:
        super().__init__(source, executor)
        self.depth = depth
        self.in_flight: collections.deque[LaunchedStep] = collections.deque()  # type: ignore[assignment]

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        self._fill()
        if not self.in_flight:
            return []
        oldest = self.in_flight.popleft()
        outputs = self.source.update_from_output(oldest, self.executor.collect())
        self._fill()  # the first stage is waiting for it
        self.source.account_step(oldest, time.perf_counter() - start)
        return outputs

    def _fill(self) -> None:
        """Hand the executor steps while a stage lacks one and one can be scheduled."""
        while len(self.in_flight) < self.depth:
            launched = self.source.launch()
            if launched is None:
                return
            self.executor.submit(launched.step_input)
            self.in_flight.append(launched)


def make_stepper(source: StepSource, executor: Executor, overlap: bool, pipeline_depth: int,
                 drafts_next: Callable[[], bool]) -> PlainStepper:
    """The stepper of the engine's step mode."""
    if pipeline_depth > 1:
        return PipelinedStepper(source, executor, pipeline_depth)
    if overlap:
        return OverlappedStepper(source, executor, drafts_next)
    return PlainStepper(source, executor)
