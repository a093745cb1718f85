"""StepLauncher: a rank's steps run one at a time, or launched ahead of their answers.

``execute(step)`` runs one scheduled batch to its answer: on the rank that samples, the sampled
ids and log-probabilities (and the drafter's proposals), ``[]`` elsewhere.
``execute_overlapped(step)`` launches ``step`` and returns the answer of the step launched
before it, so the caller works while the device computes: a step's placeholders are filled from
the previous step's sampled ids on the device (tensor-parallel ranks all get rank 0's). A step
with constrained rows has its forward pass queued now and its sampling at the next call, so
that its grammar masks are filled meanwhile (``grammar_masks.py``). A step to ``answer_now``
(speculation; nothing may be in flight) runs to completion and its own ids come back.
``discard_in_flight()`` drops launched steps whose answers will never be read.

The forward pass itself is the runner's (``ModelRunner.forward``); what follows it is the
sampler's (``step_sampler.py``).
"""

from __future__ import annotations

import collections
from typing import Callable

import torch

from nvray.step_protocol import StepInput, StepOutput
from nvray.worker.draft_ids import DraftIds
from nvray.worker.grammar_masks import GrammarMasks
from nvray.worker.sampled_ids import SampledIds
from nvray.worker.step_profiler import StepProfiler
from nvray.worker.step_sampler import Forwarded, StepSampler

ForwardPass = Callable[[StepInput], "tuple[torch.Tensor | None, torch.Tensor | None]"]


class StepLauncher:
    def __init__(self, forward: ForwardPass, sampler: StepSampler, grammar_masks: GrammarMasks,
                 step_drafts: DraftIds, samples: bool, profiler: StepProfiler) -> None:
        self.forward = forward
        self.sampler = sampler
        self.grammar_masks = grammar_masks
        self.step_drafts = step_drafts  # the drafter's ids for the step running
        self.samples = samples  # this rank samples and answers
        self.profiler = profiler
        self.in_flight: collections.deque[SampledIds] = collections.deque()
        self.deferred: Forwarded | None = None  # a constrained step's forward, sampled next call

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        """Run ``step`` and return its sampled ids and log-probabilities (the answering rank;
        empty elsewhere)."""
        self.profiler.step()
        out = self._sample(self._forward_step(step), share_ids=False).result()
        drafts = self.step_drafts.host()
        self.step_drafts.clear()
        if drafts is not None and self.samples:  # what the drafter proposed, for the engine
            out = out._replace(drafts=drafts)
        return out

    @torch.inference_mode()
    def execute_overlapped(self, step: StepInput | None) -> StepOutput | None:
        """Launch ``step`` (None: nothing new), then return the answer of the step launched
        before it (None if there is none)."""
        if step is not None and step.answer_now:
            assert not self.in_flight and self.deferred is None, (
                "a step to answer at once was handed over while others are in flight")
            self.sampler.last_sampled = None  # the next step holds no placeholders
            return self.execute(step)
        self.profiler.step()
        if self.deferred is not None:
            self.in_flight.append(self._sample(self.deferred, share_ids=True))
            self.deferred = None
        if step is not None:
            forwarded = self._forward_step(step)
            if step.constrained:  # (drafts come in steps to answer now: never deferred)
                assert not any(s.num_drafts for s in step.seqs), "a deferred step with drafts"
                self.deferred = forwarded
            else:
                self.in_flight.append(self._sample(forwarded, share_ids=True))
        launched = len(self.in_flight) + (self.deferred is not None)
        if launched < (2 if step is not None else 1):
            return None
        return self.in_flight.popleft().result()

    def discard_in_flight(self) -> None:
        """Drop launched steps whose ids will never be read (their requests were failed)."""
        self.in_flight.clear()
        self.deferred = None
        self.sampler.last_sampled = None
        self.grammar_masks.clear()

    def _forward_step(self, step: StepInput) -> Forwarded:
        """Queue ``step``'s forward pass (and the LM head of its rows to sample)."""
        logits, read_hidden = self.forward(step)
        if (step.grammars or step.grammars_done) and self.samples:
            self.grammar_masks.update(step)
        return Forwarded(step, logits, read_hidden)

    def _sample(self, forwarded: Forwarded, share_ids: bool) -> SampledIds:
        """Queue the sampling of a forwarded step on the device (``step_sampler.py``)."""
        return self.sampler.sample(forwarded, share_ids, self.step_drafts.host)
