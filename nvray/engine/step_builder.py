"""Build a step's ``StepInput`` (``nvray/step_protocol.py``) from the scheduler's decision.

``build_step_input`` turns a ``SchedulerOutput`` and each sequence's ``SeqPlan`` (what shapes
its steps, fixed at admission: ``sequence.py``) into the rank input: the tokens each sequence
computes (with a placeholder for a token still being sampled on the device, or for a draft the
ranks' drafter proposes), the block-table
entries the ranks lack (``Sequence.ranks_table_len``), each sequence's recurrent-state slot and adapter slot, and
each sampling row's ``SampleSpec``.
"""

from __future__ import annotations

from typing import Any

from nvray.engine.scheduler import SchedulerOutput
from nvray.engine.sequence import SeqPlan, Sequence
from nvray.engine.speculation import MODEL_DRAFT
from nvray.step_protocol import (Penalties, PromptScore, SampleSpec, SeqStep, StepInput,
                                 placeholder_id)
from nvray.structured_outputs import GrammarSpec


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
    spec = _sample_spec(seq, plan)
    if plan.grammar is None or plan.grammar_sent:
        return spec
    plan.grammar_sent = True  # the first sample brings the grammar; the rank keeps a matcher
    return spec._replace(grammar=plan.grammar)


def _sample_spec(seq: Sequence, plan: SeqPlan) -> SampleSpec:
    index = len(seq.token_ids) - seq.num_prompt_tokens + seq.num_pending  # planned outputs
    banned = plan.stop_ids if index < plan.min_tokens else ()
    if plan.bad_words:  # with multi-token words the output is complete here (scheduler)
        banned += banned_by_words(plan.bad_words, seq.output_token_ids)
    f = plan.fixed
    if not plan.adjusts_logits:
        return SampleSpec(f.temperature, f.top_p, f.top_k, f.min_p, f.seed, index, banned,
                          plan.logprobs)
    p = seq.params
    penalties = None
    if p.has_penalties:
        assert seq.history is not None, "a penalized sequence keeps its history"
        penalties = Penalties(p.presence_penalty, p.frequency_penalty, p.repetition_penalty,
                              seq.history.tobytes(), seq.num_prompt_tokens,
                              seq.pending_row if seq.num_pending else -1)
    return SampleSpec(f.temperature, f.top_p, f.top_k, f.min_p, f.seed, index, banned,
                      plan.logprobs, penalties,
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
                     released: list[int] | None = None,
                     grammars: list[GrammarSpec] | None = None,
                     grammars_done: list[int] | None = None,
                     state_copies: list[tuple[int, int]] | None = None,
                     lora_loads: list[tuple[int, Any]] | None = None) -> StepInput:
    """Turn a scheduler decision into rank input; ``plans`` maps seq_id to its SeqPlan. The
    step must be launched: the sequences count the entries sent as held by the ranks (and the
    grammars sent as held by rank 0)."""
    steps, adjusts, logprobs, constrained = [], False, False, False
    model_drafts = 0  # placeholder rows of the ranks' drafts so far
    for seq, num_new in out.scheduled:
        start = seq.num_computed_tokens
        end = start + num_new
        token_ids = seq.token_ids[start:end]
        num_tokens = len(seq.token_ids) + seq.num_pending
        num_drafts = max(end - num_tokens, 0)  # speculation: drafts follow the known tokens
        if num_drafts and seq.drafts[0] == MODEL_DRAFT:  # the ranks' drafter fills them
            token_ids += [placeholder_id(model_drafts + j) for j in range(num_drafts)]
            model_drafts += num_drafts
        elif num_drafts:
            token_ids += seq.drafts[:num_drafts]
        elif len(token_ids) < num_new:  # the newest token is being sampled on the device
            assert num_new - len(token_ids) == 1 == seq.num_pending, "one pending token at most"
            token_ids.append(placeholder_id(seq.pending_row))
        draft_start, draft_tokens = -1, ()
        if seq.draft_feed and start == len(seq.token_ids) - 1:  # it computes its newest token:
            # the draft model's cache catches up within the blocks it holds (speculation.py)
            draft_start, draft_tokens = seq.draft_len, tuple(
                seq.token_ids[seq.draft_len:seq.draft_len + seq.draft_feed])
            seq.draft_len += seq.draft_feed
        seq.draft_feed = 0
        plan, params = plans[seq.seq_id], seq.params
        sample = None
        if end == num_tokens + num_drafts and params.max_tokens:
            sample = sample_spec_for(seq, plan)
            adjusts = adjusts or plan.adjusts_logits
            logprobs = logprobs or plan.logprobs >= 0
            constrained = constrained or plan.grammar is not None
        score = None
        if params.prompt_logprobs is not None:
            score = prompt_score_for(seq, plan, start, end)
        pool = params.pool if end == seq.num_prompt_tokens else None
        table, held = seq.block_table, seq.ranks_table_len
        seq.ranks_table_len = len(table)
        steps.append(SeqStep(seq.seq_id, token_ids, start, table[held:] if held else table, sample,
                             score, held, seq.state_slot, pool, num_drafts, seq.lora_slot,
                             draft_start, draft_tokens))
    return StepInput(steps, block_copies or [], released or [], adjusts, logprobs, constrained,
                     grammars or [], grammars_done or [], state_copies or [],
                     lora_loads=lora_loads or [])
