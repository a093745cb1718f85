"""StepSampler: a forwarded step's rows to sample, score and pool, turned into its answer.

``sample(forwarded, share_ids, drafted)`` queues, on the last pipeline stage, what follows a
step's forward pass: the logits' adjustments (penalties, bans, logit bias) and grammar masks,
the sampler (the fused Triton kernel where it applies), the log-probabilities of the rows that
ask and of the prompt rows to score, the pooled rows; it keeps the sampled ids on the device
(``last_sampled``: the next step's placeholders read them) and starts their copy to the host
(``SampledIds``). ``share_ids``: every tensor-parallel rank gets rank 0's ids (overlapped steps,
whose next step reads them on the device). Ranks other than the answering one take part in
every LM head and get ``SampledIds.none()``. ``drafted``: the drafter's ids of the step as a
list (a draft row's penalties and mask follow the drafts before it), read only when the step
needs them.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from nvray.layers.pp import is_last_stage
from nvray.layers.tp import broadcast_from_first
from nvray.step_protocol import SampleSpec, StepInput, sample_specs
from nvray.worker.device_lists import to_device
from nvray.worker.grammar_masks import GrammarMasks
from nvray.worker.logits_processors import adjust_logits
from nvray.worker.logprobs import HostLogprobs, LogprobRows
from nvray.worker.sampled_ids import HostIds, SampledIds
from nvray.worker.sampler import sample


class Forwarded(NamedTuple):
    """A step whose forward pass is queued: its logits of the rows to sample (rank 0) and
    hidden states of the prompt rows to score, then of those to pool."""
    step: StepInput
    logits: torch.Tensor | None
    read_hidden: torch.Tensor | None


class StepSampler:
    def __init__(self, model: Any, grammar_masks: GrammarMasks, host_ids: HostIds,
                 device: torch.device, fused: bool, answers: bool) -> None:
        self.model, self.grammar_masks, self.host_ids = model, grammar_masks, host_ids
        self.device, self.fused, self.answers = device, fused, answers
        self.last_sampled: torch.Tensor | None = None  # the newest step's sampled ids (device)

    def sample(self, forwarded: Forwarded, share_ids: bool,
               drafted: Callable[[], list[int] | None]) -> SampledIds:
        step, logits, read_hidden = forwarded
        if not is_last_stage():
            return SampledIds.none()  # (no overlapped steps with pipeline stages)
        num_score_rows = sum(len(s.score.targets) for s in step.seqs if s.score is not None)
        score_hidden = read_hidden[:num_score_rows] if num_score_rows else None
        pooled, widths = self._pool(step, read_hidden, num_score_rows)
        drafts = drafted() if step.constrained or step.adjusts_logits else None
        specs = sample_specs(step, drafts)
        raw, ids, constrained = self._sampled_ids(step, logits, specs, drafts)
        if share_ids and specs:
            broadcast_from_first(ids)
        logprobs, ks = self._logprobs(step, specs, raw, ids, score_hidden)
        self.last_sampled = ids
        if not self.answers:
            return SampledIds.none()
        sampled = self.host_ids.copy_from(ids, logprobs, ks, pooled, widths)
        self.grammar_masks.advance(sampled, constrained)  # the next masks, filled meanwhile
        return sampled

    def _sampled_ids(self, step: StepInput, logits: torch.Tensor | None,
                     specs: list[SampleSpec], drafts: list[int] | None
                     ) -> tuple[torch.Tensor | None, torch.Tensor, list[Any]]:
        """(the raw logits when log-probabilities are asked, the sampled ids [S] int32, the
        grammar-constrained rows)."""
        if logits is None:
            return None, torch.empty(len(specs), dtype=torch.int32, device=self.device), []
        raw = logits if step.samples_logprobs else None
        if step.adjusts_logits:
            logits = adjust_logits(logits.to(torch.float32, copy=True), specs, self.last_sampled)
        constrained: list[Any] = []
        if step.constrained:
            if logits is raw:
                logits = logits.clone()  # log-probabilities come from the raw logits
            constrained = self.grammar_masks.mask(step, logits, drafts)
        ids = sample(logits, specs, fused=self.fused).to(torch.int32)  # type: ignore[arg-type]
        return raw, ids, constrained

    def _pool(self, step: StepInput, read_hidden: torch.Tensor | None, first: int
              ) -> tuple[torch.Tensor | None, list[int]]:
        """The pooled rows (``SeqStep.pool``), flattened to one float32 tensor, and each row's
        width: a last token's final hidden state, or the logits of the listed ids there (every
        rank takes part in the LM head)."""
        pools = [s.pool for s in step.seqs if s.pool is not None]
        if not pools:
            return None, []
        hidden = read_hidden[first:first + len(pools)]  # type: ignore[index]
        logits = self.model.compute_logits(hidden) if any(pools) else None
        if not self.answers:
            return None, []
        rows = [logits[i, list(ids)] if ids else hidden[i]  # type: ignore[index]
                for i, ids in enumerate(pools)]
        return torch.cat([r.float() for r in rows]), [r.numel() for r in rows]

    def _logprobs(self, step: StepInput, specs: list[SampleSpec], raw: torch.Tensor | None,
                  ids: torch.Tensor, score_hidden: torch.Tensor | None
                  ) -> tuple[HostLogprobs | None, list[int] | None]:
        """Log-probabilities of the sampled rows that ask, then of the prompt rows to score (in
        the step protocol's order); every rank takes part (the LM head of prompt rows)."""
        if not step.samples_logprobs and score_hidden is None:
            return None, None
        scores = [s.score for s in step.seqs if s.score is not None]
        asked = [i for i, spec in enumerate(specs) if spec.logprobs >= 0]
        ks = [specs[i].logprobs for i in asked] + [sc.num_logprobs for sc in scores
                                                   for _ in sc.targets]
        rows = LogprobRows(max(ks))
        if raw is not None and asked:
            where = to_device(asked, self.device)
            rows.add_sampled(raw.index_select(0, where), ids.index_select(0, where))
        if score_hidden is not None:
            targets = to_device([t for sc in scores for t in sc.targets], self.device)
            rows.add_prompt(score_hidden, targets, self.model.compute_logits)
        if not self.answers:
            return None, None
        return rows.to_host(), ks
