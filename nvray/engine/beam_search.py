"""BeamGroup: one beam-search request — its live beams, its finished hypotheses, one round at a
time.

Each live beam is a sequence that computes one token per round and reports the top
``2 * beam_width`` log-probabilities of the raw logits at its end (the engine never appends what
it sampled). When every live beam of the round has reported, ``select`` looks at all
(beam, candidate token) pairs, as vLLM's beam search does: a candidate that is EOS (unless
``ignore_eos``) becomes a finished hypothesis; of the others the ``beam_width`` best by score
become the next round's beams, each a fork of its parent (the engine shares the parent's KV
blocks with it). After ``max_tokens`` rounds the beams join the finished hypotheses, and the
``beam_width`` best of those are the result.

A beam that has reported holds its blocks while its siblings compute; when a sibling waits for
blocks (preempted), the reported ones give theirs back (their children then prefill from the
prefix cache), so a search never waits on itself.

Score (vLLM's): cumulative log-probability / length ** length_penalty, where length counts the
prompt and the generated tokens, less a final EOS.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from nvray.engine.scheduler import Scheduler
from nvray.engine.sequence import SeqPlan, Sequence, SequenceStatus
from nvray.outputs import RequestOutput, TokenLogprobs
from nvray.sampling_params import BeamSearchParams, SamplingParams


class Hypothesis(NamedTuple):
    token_ids: list[int]  # generated tokens
    cumulative_logprob: float
    ended_by_eos: bool


class Child(NamedTuple):
    """A beam of the next round: ``parent``'s tokens plus ``token``."""

    parent: Sequence
    token: int
    cumulative_logprob: float


def beam_score(num_prompt_tokens: int, hyp: Hypothesis, length_penalty: float) -> float:
    length = num_prompt_tokens + len(hyp.token_ids) - hyp.ended_by_eos
    return hyp.cumulative_logprob / (max(length, 1) ** length_penalty)


@dataclass
class BeamGroup:
    request_id: str
    params: BeamSearchParams
    prompt_token_ids: list[int]
    eos_token_ids: tuple[int, ...]
    live: dict[int, float] = field(default_factory=dict)  # seq_id -> cumulative log-probability
    beams: dict[int, Sequence] = field(default_factory=dict)  # seq_id -> live beam
    reports: dict[int, TokenLogprobs] = field(default_factory=dict)
    finished: list[Hypothesis] = field(default_factory=list)
    num_rounds: int = 0

    def add_beam(self, seq: Sequence, cumulative_logprob: float) -> None:
        self.beams[seq.seq_id] = seq
        self.live[seq.seq_id] = cumulative_logprob

    def report(self, seq: Sequence, logprobs: TokenLogprobs) -> None:
        if seq.seq_id in self.beams:
            self.reports[seq.seq_id] = logprobs

    @property
    def round_complete(self) -> bool:
        return bool(self.beams) and len(self.reports) == len(self.beams)

    def select(self) -> list[Child]:
        """End the round: the next round's beams (also records finished hypotheses)."""
        width, p = self.params.beam_width, self.params
        candidates = []
        for seq_id, seq in self.beams.items():
            report, base = self.reports[seq_id], self.live[seq_id]
            generated = seq.output_token_ids
            for token, logprob in zip(report.top_ids, report.top_logprobs):
                hyp = Hypothesis(generated + [token], base + logprob,
                                 token in self.eos_token_ids and not p.ignore_eos)
                if hyp.ended_by_eos:
                    self.finished.append(hyp)
                else:
                    candidates.append((self._score(hyp), hyp, seq, token))
        candidates.sort(key=lambda c: c[0], reverse=True)
        self.num_rounds += 1
        self.reports.clear()
        kept = candidates[:width]
        if self.num_rounds >= p.max_tokens:  # the length limit: the beams as they stand
            self.finished += [hyp for _, hyp, _, _ in kept]
            return []
        return [Child(seq, token, hyp.cumulative_logprob) for _, hyp, seq, token in kept]

    def _score(self, hyp: Hypothesis) -> float:
        return beam_score(len(self.prompt_token_ids), hyp, self.params.length_penalty)

    def best(self) -> list[Hypothesis]:
        """The ``beam_width`` best finished hypotheses, best first."""
        return sorted(self.finished, key=self._score, reverse=True)[:self.params.beam_width]


class BeamSearcher:
    """The engine's beam-search requests: starts their beams, ends their rounds, forks.

    The engine hands it each beam's report (``report``) and calls ``advance`` after every
    step; a beam's plan lives in the engine's ``plans`` like any sequence's.
    """

    def __init__(self, scheduler: Scheduler, tokenizer: Any, plans: dict[int, SeqPlan]) -> None:
        self.scheduler = scheduler
        self.block_manager = scheduler.block_manager
        self.tokenizer = tokenizer
        self.plans = plans
        self.groups: dict[str, BeamGroup] = {}
        self.group_of_seq: dict[int, BeamGroup] = {}

    @staticmethod
    def beam_params(params: BeamSearchParams) -> SamplingParams:
        """What each beam runs: greedy (its own pick is ignored), reporting the candidates."""
        return SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True,
                              logprobs=2 * params.beam_width, speculate=False)

    def add(self, request_id: str, token_ids: list[int], params: BeamSearchParams,
            eos_token_ids: tuple[int, ...], arrival: float, priority: int) -> None:
        group = BeamGroup(request_id, params, list(token_ids), eos_token_ids)
        self.groups[request_id] = group
        seq = Sequence(request_id, token_ids, self.beam_params(params), arrival, priority)
        self._start_beam(group, seq, 0.0)
        self.scheduler.add(seq)

    def _start_beam(self, group: BeamGroup, seq: Sequence, cumulative_logprob: float) -> None:
        seq.waits_for_tokens = True  # its next token is chosen here, between steps
        group.add_beam(seq, cumulative_logprob)
        self.group_of_seq[seq.seq_id] = group
        self.plans[seq.seq_id] = SeqPlan.of(seq.params, ())

    def owns(self, seq: Sequence) -> bool:
        return seq.seq_id in self.group_of_seq

    def report(self, seq: Sequence, logprobs: TokenLogprobs) -> None:
        self.group_of_seq[seq.seq_id].report(seq, logprobs)

    def advance(self) -> list[RequestOutput]:
        """End every round that is complete; the final outputs of the searches that ended."""
        outputs = []
        for group in list(self.groups.values()):
            if not group.round_complete:
                self._release_idle_beams(group)
                continue
            self._next_round(group, group.select())
            if not group.beams:
                outputs += self._finish(group, None)
        return outputs

    def _release_idle_beams(self, group: BeamGroup) -> None:
        """A beam waits for blocks while its reported siblings hold theirs: free those."""
        beams = group.beams.values()
        if any(b.status is SequenceStatus.WAITING and b.seq_id not in group.reports
               for b in beams):
            idle = [b for b in beams if b.seq_id in group.reports
                    and b.status is SequenceStatus.RUNNING]
            if idle:
                self.scheduler.finish_many(idle, lambda _: "stop")

    def _next_round(self, group: BeamGroup, children: list[Child]) -> None:
        old = list(group.beams.values())
        group.beams.clear()
        group.live.clear()
        for child in children:
            parent = child.parent
            seq = Sequence(group.request_id, group.prompt_token_ids, parent.params,
                           parent.arrival_time, parent.priority)
            seq.token_ids = parent.token_ids + [child.token]
            self._start_beam(group, seq, child.cumulative_logprob)
            if (parent.status is SequenceStatus.RUNNING and parent.block_table
                    and self.block_manager.has_state_slot()):
                self.block_manager.fork(seq, parent, parent.num_computed_tokens)
                self.scheduler.add_running(seq)
            else:  # the parent was preempted (or no state slot is free): the child prefills
                # (prefix cache) on its own
                self.scheduler.add(seq)
        self._drop(old)

    def _drop(self, beams: list[Sequence]) -> None:
        self.scheduler.finish_many([b for b in beams if not b.is_finished], lambda _: "stop")
        for beam in beams:
            self.group_of_seq.pop(beam.seq_id, None)
            self.plans.pop(beam.seq_id, None)

    def abort(self, request_id: str, reason: str, error: str | None = None) -> list[RequestOutput]:
        group = self.groups.get(request_id)
        return [] if group is None else self._finish(group, reason, error)

    def _finish(self, group: BeamGroup, reason: str | None,
                error: str | None = None) -> list[RequestOutput]:
        """The search's ``beam_width`` outputs, best first (``reason``: ended early, empty)."""
        self._drop(list(group.beams.values()))
        del self.groups[group.request_id]
        prompt, width = group.prompt_token_ids, group.params.beam_width
        if reason is not None:
            return [RequestOutput(group.request_id, prompt, finished=True, finish_reason=reason,
                                  error=error, index=i) for i in range(width)]
        texts = [self.tokenizer.decode(h.token_ids, skip_special_tokens=True)
                 for h in group.best()]
        return [RequestOutput(group.request_id, prompt, index=i, finished=True, text=text,
                              delta_text=text, token_ids=h.token_ids, delta_token_ids=h.token_ids,
                              finish_reason="stop" if h.ended_by_eos else "length",
                              cumulative_logprob=h.cumulative_logprob)
                for i, (h, text) in enumerate(zip(group.best(), texts))]
