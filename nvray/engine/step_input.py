"""StepInput: what the control plane sends the model ranks for one step (plain, picklable: it
pickles as plain tuples and lists, which is how it crosses to the Ray ranks every step).

For each scheduled sequence: the tokens whose KV is computed this step, where they start,
its block table, and — when the step reaches the end of the sequence — how to sample its next
token.

Block tables travel as changes: the ranks keep each sequence's table from step to step, and a
``SeqStep`` carries the entries from ``table_start`` on (0: the whole table; a running sequence
sends nothing most steps, a new block every ``block_size`` tokens). ``build_step_input`` sends
what ``Sequence.ranks_table_len`` says the ranks lack; a step's ``released`` seq ids are
sequences whose blocks were freed (finished, preempted): the ranks drop their tables first.

The ranks answer with one sampled token id per sequence that has a ``SampleSpec``, in order.

With overlapped steps a sequence's newest token may still be sampled by the step before this
one when this one is built: its id is then a placeholder ``-1 - row``, where ``row`` is the
sequence's row among that step's sampled ids; the ranks fill it in on the device (and count it
among the output tokens that penalties look at: ``Penalties.pending_row``).

Log-probabilities: a ``SampleSpec`` with ``logprobs >= 0`` asks for the sampled token's
log-probability and the top ``logprobs``; a ``PromptScore`` asks for those of prompt tokens:
the first ``len(targets)`` rows of the sequence's chunk from ``offset`` on, each scored against
the prompt token that follows it. The ranks answer with a ``StepOutput``: the sampled ids, then
``logprobs`` rows — first one per sampling row that asked, in row order, then the score rows
of each sequence in step order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from nvray.engine.scheduler import SchedulerOutput
from nvray.engine.sequence import Sequence
from nvray.outputs import TokenLogprobs
from nvray.sampling_params import SamplingParams


class Penalties(NamedTuple):
    """What presence/frequency/repetition penalties need: the tokens seen so far, as the bytes
    of an int32 array (prompt, then the output tokens known on the host): one buffer per
    sequence, cheap to send and to gather on the rank."""

    presence: float
    frequency: float
    repetition: float
    tokens: bytes
    num_prompt_tokens: int
    pending_row: int  # >= 0: one more output token, that row of the previous step's ids


class SampleSpec(NamedTuple):
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    step_index: int  # number of output tokens before this one: seeds the per-token noise
    banned_token_ids: tuple[int, ...] = ()  # EOS/stop ids before min_tokens; bad words
    logprobs: int = -1  # >= 0: report the sampled token's log-probability and this many top
    penalties: Penalties | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None


class PromptScore(NamedTuple):
    """Score prompt tokens: rows ``offset .. offset + len(targets) - 1`` of the chunk."""

    num_logprobs: int
    offset: int
    targets: list[int]


class SeqStep(NamedTuple):
    seq_id: int
    token_ids: list[int]  # tokens computed this step (a negative id: see the module docstring)
    start_pos: int  # position of token_ids[0] (= tokens already in the KV cache)
    block_table: list[int]  # the table's entries from table_start on
    sample: SampleSpec | None
    score: PromptScore | None = None
    table_start: int = 0  # 0: block_table is the whole table, else the ranks hold those before


@dataclass(frozen=True)
class StepInput:
    seqs: list[SeqStep] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst): copy first
    released: list[int] = field(default_factory=list)  # seq ids whose tables the ranks drop first
    # whether some SampleSpec adjusts logits / asks for log-probabilities (build_step_input
    # sets them, so the ranks need not scan every spec each step; a hand-built step that uses
    # either must set them too)
    adjusts_logits: bool = False
    samples_logprobs: bool = False

    @property
    def num_samples(self) -> int:
        return sum(1 for s in self.seqs if s.sample is not None)

    def __reduce__(self) -> tuple:
        """Pickled as plain tuples and lists. Ray pickles with cloudpickle, whose per-object
        hook runs in Python for every NamedTuple (two per sequence: ~1 ms for 256 sequences,
        on the critical path of every step); plain tuples and lists take pickle's C fast path
        (~0.1 ms), and the rank rebuilds the NamedTuples without running their Python code."""
        seqs = [(s.seq_id, s.token_ids, s.start_pos, s.block_table,
                 None if s.sample is None else tuple(s.sample),
                 None if s.score is None else tuple(s.score), s.table_start) for s in self.seqs]
        return _step_input_from_plain, (seqs, self.block_copies, self.released,
                                        self.adjusts_logits, self.samples_logprobs)


_namedtuple_of = tuple.__new__  # _namedtuple_of(Cls, plain_tuple): a Cls, built in C


def _step_input_from_plain(seqs: list[tuple], block_copies: list[tuple[int, int]],
                           released: list[int], adjusts_logits: bool,
                           samples_logprobs: bool) -> StepInput:
    """What ``StepInput.__reduce__`` pickled, back as a StepInput of NamedTuples."""
    steps = []
    for seq_id, token_ids, start, table, sample, score, table_start in seqs:
        if sample is not None:
            sample = _namedtuple_of(SampleSpec, sample)
        if score is not None:
            score = _namedtuple_of(PromptScore, score)
        steps.append(_namedtuple_of(SeqStep, (seq_id, token_ids, start, table, sample, score,
                                              table_start)))
    return StepInput(steps, block_copies, released, adjusts_logits, samples_logprobs)


class StepOutput(NamedTuple):
    """What rank 0 answers for a step (other ranks: empty)."""

    ids: list[int]
    logprobs: list[TokenLogprobs] | None = None  # see the module docstring for the order


def placeholder_id(row: int) -> int:
    """The id standing for the token sampled at ``row`` of the previous step."""
    return -1 - row


def placeholder_row(token_id: int) -> int:
    return -1 - token_id


@dataclass
class SeqPlan:
    """What shapes a sequence's steps, fixed at admission (the parts of its SampleSpecs that
    never change are computed once), except ``num_scored``: prompt positions whose scoring was
    launched."""

    stop_ids: tuple[int, ...]  # EOS (unless ignore_eos) and stop_token_ids
    bad_words: tuple[tuple[int, ...], ...] = ()  # token ids of each bad word
    num_scored: int = 0
    fixed: tuple = ()  # temperature, top_p, top_k, min_p, seed
    min_tokens: int = 0
    logprobs: int = -1
    adjusts_logits: bool = False

    @classmethod
    def of(cls, params: SamplingParams, stop_ids: tuple[int, ...],
           bad_words: tuple[tuple[int, ...], ...] = ()) -> "SeqPlan":
        p = params
        return cls(stop_ids, bad_words, fixed=(p.temperature, p.top_p, p.top_k, p.min_p, p.seed),
                   min_tokens=p.min_tokens, logprobs=-1 if p.logprobs is None else p.logprobs,
                   adjusts_logits=p.adjusts_logits)


def banned_by_words(bad_words: tuple[tuple[int, ...], ...], output_ids: list[int]) -> tuple[int, ...]:
    """Last tokens of the bad words whose other tokens end the output."""
    banned = []
    for word in bad_words:
        prefix = word[:-1]
        if not prefix or (len(output_ids) >= len(prefix)
                          and tuple(output_ids[len(output_ids) - len(prefix):]) == prefix):
            banned.append(word[-1])
    return tuple(banned)


def sample_spec_for(seq: Sequence, plan: SeqPlan) -> SampleSpec:
    index = len(seq.token_ids) - seq.num_prompt_tokens + seq.num_pending  # planned outputs
    banned = plan.stop_ids if index < plan.min_tokens else ()
    if plan.bad_words:  # with multi-token words the output is complete here (scheduler)
        banned += banned_by_words(plan.bad_words, seq.output_token_ids)
    if not plan.adjusts_logits:
        t, p, k, m, seed = plan.fixed
        return SampleSpec(t, p, k, m, seed, index, banned, plan.logprobs)
    p = seq.params
    penalties = None
    if p.has_penalties:
        assert seq.history is not None, "a penalized sequence keeps its history"
        penalties = Penalties(p.presence_penalty, p.frequency_penalty, p.repetition_penalty,
                              seq.history.tobytes(), seq.num_prompt_tokens,
                              seq.pending_row if seq.num_pending else -1)
    return SampleSpec(*plan.fixed, index, banned, plan.logprobs, penalties,
                      tuple(p.logit_bias.items()) if p.logit_bias else (), p.allowed_token_ids)


def prompt_score_for(seq: Sequence, plan: SeqPlan, start: int, end: int) -> PromptScore | None:
    """Score the prompt positions of chunk [start, end) not scored before (a recomputed chunk
    after preemption is not scored twice); advances ``plan.num_scored``."""
    k = seq.params.prompt_logprobs
    lo, hi = max(start, plan.num_scored), min(end, seq.num_prompt_tokens - 1)
    if k is None or hi <= lo:
        return None
    plan.num_scored = hi
    return PromptScore(k, lo - start, seq.token_ids[lo + 1:hi + 1])


def build_step_input(out: SchedulerOutput, plans: dict[int, SeqPlan],
                     block_copies: list[tuple[int, int]] | None = None,
                     released: list[int] | None = None) -> StepInput:
    """Turn a scheduler decision into rank input; ``plans`` maps seq_id to its SeqPlan. The
    step must be launched: the sequences count the entries sent as held by the ranks."""
    steps, adjusts, logprobs = [], False, False
    for seq, num_new in out.scheduled:
        start = seq.num_computed_tokens
        end = start + num_new
        token_ids = seq.token_ids[start:end]
        num_tokens = len(seq.token_ids) + seq.num_pending
        if len(token_ids) < num_new:  # the newest token is being sampled on the device
            assert num_new - len(token_ids) == 1 == seq.num_pending, "one pending token at most"
            token_ids.append(placeholder_id(seq.pending_row))
        plan, params = plans[seq.seq_id], seq.params
        sample = None
        if end == num_tokens and params.max_tokens:
            sample = sample_spec_for(seq, plan)
            adjusts = adjusts or plan.adjusts_logits
            logprobs = logprobs or plan.logprobs >= 0
        score = None
        if params.prompt_logprobs is not None:
            score = prompt_score_for(seq, plan, start, end)
        table, held = seq.block_table, seq.ranks_table_len
        seq.ranks_table_len = len(table)
        steps.append(SeqStep(seq.seq_id, token_ids, start, table[held:] if held else table, sample,
                             score, held))
    return StepInput(steps, block_copies or [], released or [], adjusts, logprobs)
