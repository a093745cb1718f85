"""Launching a scheduled step: its ``StepInput`` and the records of what its results will mean.

``launch`` builds the step input of a ``SchedulerOutput`` (``step_builder.py``), advances each
scheduled sequence's computed tokens (KV is accounted as written when the step is launched; a
state save point saves its state here) and sorts the sequences into records by kind, in step
order within each kind, so that applying the results (``step_results.py``) is a loop per kind:

- ``scored``: prompt log-probabilities (``(seq, first score row, rows)``);
- ``pooled``: a pooled vector (``(seq, pooled row)``);
- ``prefilled``: prompt tokens and nothing sampled (``(seq, kv_end, preemptions)``);
- ``sampled``: one sampled token (``(seq, kv_end, row, preemptions, logprob row or -1)``);
- ``verified``: drafts verified, sampled rows ``row .. row + len(drafts)`` (a sampled record
  with the drafts last);
- ``beams``: a beam of a beam search (a sampled record; row -1 while its prompt is computed).

A sequence is in at most one of the last four. ``kv_end`` is the KV written when the step is
done; ``preemptions`` the sequence's preemption count at launch (a sequence preempted since
holds none of this KV). Records are plain tuples: a NamedTuple costs ~0.1 us more per record,
+26 us on the control-plane bench's 256-sequence step (+7% of building its input).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from nvray.engine.block_manager import BlockManager
from nvray.engine.scheduler import SchedulerOutput
from nvray.engine.sequence import Sequence
from nvray.step_protocol import StepInput

SampledRecord = tuple[Sequence, int, int, int, int]
VerifiedRecord = tuple[Sequence, int, int, int, int, tuple[int, ...]]


class StepRecords(NamedTuple):
    """A launched step's sequences by kind (the module docstring)."""

    scored: list[tuple[Sequence, int, int]]
    pooled: list[tuple[Sequence, int]]
    prefilled: list[tuple[Sequence, int, int]]
    sampled: list[SampledRecord]
    verified: list[VerifiedRecord]
    beams: list[SampledRecord]


class LaunchedStep(NamedTuple):
    """A step handed to the executor, and what its results will mean."""

    step_input: StepInput
    records: StepRecords
    num_sample_logprobs: int = 0  # logprob rows of sampled tokens (score rows come after)
    computes_prompt: bool = False  # some of its tokens are prompt tokens (a prefill step)


def num_decode_tokens(out: SchedulerOutput) -> int:
    """Tokens of the step's decodes: one a sequence, or a verified run's."""
    return sum(n for seq, n in out.scheduled
               if (n == 1 or seq.drafts) and seq.num_computed_tokens >= seq.num_prompt_tokens)


def launch(out: SchedulerOutput, step_input: StepInput, num_decode: int,
           block_manager: BlockManager, is_beam: Callable[[Sequence], bool] | None
           ) -> LaunchedStep:
    """Account the scheduled step as launched and sort its sequences into records;
    ``num_decode``: its decode tokens (``num_decode_tokens``, before launch); ``is_beam``:
    whether a sequence is a beam (None: no beam search runs)."""
    records = StepRecords([], [], [], [], [], [])
    row, logprob_row, score_row, pool_row = 0, 0, 0, 0
    for (seq, num_new), seq_step in zip(out.scheduled, step_input.seqs):
        seq.num_computed_tokens += num_new
        kv_end = seq.num_computed_tokens
        if kv_end == seq.state_save_at:  # the next step keeps its state (prefix caching)
            block_manager.save_state(seq)
        if (score := seq_step.score) is not None and score.targets:
            records.scored.append((seq, score_row, len(score.targets)))
            score_row += len(score.targets)
        if seq_step.pool is not None:
            records.pooled.append((seq, pool_row))
            pool_row += 1
        beam = is_beam is not None and is_beam(seq)
        sample = seq_step.sample
        if sample is None:
            if beam:
                records.beams.append((seq, kv_end, -1, seq.num_preemptions, -1))
            else:
                records.prefilled.append((seq, kv_end, seq.num_preemptions))
        else:
            seq.num_pending += 1
            seq.pending_row = row
            n = seq_step.num_drafts
            lp_row = -1
            if sample.logprobs >= 0:  # a row at each verified position
                lp_row, logprob_row = logprob_row, logprob_row + 1 + n
            if n:
                records.verified.append((seq, kv_end, row, seq.num_preemptions, lp_row,
                                         tuple(seq_step.token_ids[-n:])))
            else:
                (records.beams if beam else records.sampled).append(
                    (seq, kv_end, row, seq.num_preemptions, lp_row))
            row += 1 + n
        if seq.drafts:  # sent: the next schedule proposes afresh (no list a step otherwise)
            seq.drafts = []
    return LaunchedStep(step_input, records, logprob_row, num_decode < out.num_batched_tokens)
