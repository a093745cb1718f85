"""StepInput: what the control plane sends the model ranks for one step (plain, picklable).

For each scheduled sequence: the tokens whose KV is computed this step, where they start,
the block table, and — when the step reaches the end of the sequence — how to sample its next
token. The ranks answer with one sampled token id per sequence that has a ``SampleSpec``, in
order.

With overlapped steps a sequence's newest token may still be sampled by the step before this
one when this one is built: its id is then a placeholder ``-1 - row``, where ``row`` is the
sequence's row among that step's sampled ids; the ranks fill it in on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from nvray.engine.scheduler import SchedulerOutput
from nvray.engine.sequence import Sequence


class SampleSpec(NamedTuple):
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    step_index: int  # number of output tokens before this one: seeds the per-token noise
    banned_token_ids: tuple[int, ...] = ()  # EOS/stop ids while min_tokens is not reached


class SeqStep(NamedTuple):
    seq_id: int
    token_ids: list[int]  # tokens computed this step (a negative id: see the module docstring)
    start_pos: int  # position of token_ids[0] (= tokens already in the KV cache)
    block_table: list[int]
    sample: SampleSpec | None


@dataclass(frozen=True)
class StepInput:
    seqs: list[SeqStep] = field(default_factory=list)

    @property
    def num_samples(self) -> int:
        return sum(1 for s in self.seqs if s.sample is not None)


def placeholder_id(row: int) -> int:
    """The id standing for the token sampled at ``row`` of the previous step."""
    return -1 - row


def placeholder_row(token_id: int) -> int:
    return -1 - token_id


def sample_spec_for(seq: Sequence, stop_ids: tuple[int, ...]) -> SampleSpec:
    p = seq.params
    index = seq.num_planned_output_tokens
    banned = stop_ids if index < p.min_tokens else ()
    return SampleSpec(p.temperature, p.top_p, p.top_k, p.min_p, p.seed, index, banned)


def build_step_input(out: SchedulerOutput, stop_ids_of: dict[int, tuple[int, ...]]) -> StepInput:
    """Turn a scheduler decision into rank input; ``stop_ids_of`` maps seq_id to EOS+stop ids."""
    steps = []
    for seq, num_new in out.scheduled:
        start = seq.num_computed_tokens
        end = start + num_new
        token_ids = seq.token_ids[start:end]
        if len(token_ids) < num_new:  # the newest token is being sampled on the device
            assert num_new - len(token_ids) == 1 == seq.num_pending, "one pending token at most"
            token_ids.append(placeholder_id(seq.pending_row))
        sample = sample_spec_for(seq, stop_ids_of[seq.seq_id]) if end == seq.num_tokens else None
        steps.append(SeqStep(seq.seq_id, token_ids, start, seq.block_table, sample))
    return StepInput(steps)
