"""StepInput: what the control plane sends the model ranks for one step (plain, picklable).

For each scheduled sequence: the tokens whose KV is computed this step, where they start,
the block table, and — when the step reaches the end of the sequence — how to sample its next
token. The ranks answer with one sampled token id per sequence that has a ``SampleSpec``, in
order.
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
    token_ids: list[int]  # tokens computed this step
    start_pos: int  # position of token_ids[0] (= tokens already in the KV cache)
    block_table: list[int]
    sample: SampleSpec | None


@dataclass(frozen=True)
class StepInput:
    seqs: list[SeqStep] = field(default_factory=list)

    @property
    def num_samples(self) -> int:
        return sum(1 for s in self.seqs if s.sample is not None)


def sample_spec_for(seq: Sequence, stop_ids: tuple[int, ...]) -> SampleSpec:
    p = seq.params
    banned = stop_ids if seq.num_output_tokens < p.min_tokens else ()
    return SampleSpec(p.temperature, p.top_p, p.top_k, p.min_p, p.seed, seq.num_output_tokens,
                      banned)


def build_step_input(out: SchedulerOutput, stop_ids_of: dict[int, tuple[int, ...]]) -> StepInput:
    """Turn a scheduler decision into rank input; ``stop_ids_of`` maps seq_id to EOS+stop ids."""
    steps = []
    for seq, num_new in out.scheduled:
        start = seq.num_computed_tokens
        end = start + num_new
        sample = sample_spec_for(seq, stop_ids_of[seq.seq_id]) if end == seq.num_tokens else None
        steps.append(SeqStep(seq.seq_id, seq.token_ids[start:end], start, seq.block_table, sample))
    return StepInput(steps)
