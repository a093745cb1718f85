"""Applying a launched step's results (``StepOutput``) to its sequences, a loop per record kind
(``launch.py``).

A sequence finished or aborted since the step was launched is skipped: the step's work for it
is void. A sequence whose preemption count is what it was at launch still holds the step's KV,
so its full blocks join the prefix cache. Sampled tokens go through the stop rules
(``output_processor.append_token``); a verified run's confirmed tokens join one by one
(``Speculator.emitted``) and the KV of its rejected drafts is dropped (the sequence computes
from the first rejected position again; its blocks stay its own). A beam reports its
log-probabilities to the ``BeamSearcher`` instead of taking a token.

``StepResults.apply`` returns the outputs (streamed choices every token, others when they end)
and the choices that finished, in the order of the loops: ``LLMEngine`` ends them.
"""

from __future__ import annotations

from typing import NamedTuple

from nvray.engine.beam_search import BeamSearcher
from nvray.engine.block_manager import BlockManager
from nvray.engine.launch import LaunchedStep, SampledRecord, VerifiedRecord
from nvray.engine.output_processor import append_token, make_output
from nvray.engine.sequence import RequestState, Sequence
from nvray.engine.speculation import Speculator
from nvray.outputs import RequestOutput, TokenLogprobs
from nvray.step_protocol import StepOutput, placeholder_row


class Applied(NamedTuple):
    """What applying one step's results gave."""

    outputs: list[RequestOutput]
    finished: list[RequestState]
    num_tokens: int  # output tokens the step's choices took


class StepResults:
    def __init__(self, requests: dict[str, list[RequestState]], block_manager: BlockManager,
                 beams: BeamSearcher, speculator: Speculator | None, max_model_len: int) -> None:
        self.requests = requests  # the engine's: request_id -> its choices
        self.block_manager = block_manager
        self.beams = beams
        self.speculator = speculator
        self.max_model_len = max_model_len

    def apply(self, launched: LaunchedStep, result: StepOutput, now: float) -> Applied:
        assert len(result.ids) == launched.step_input.num_samples, (
            "ranks returned the wrong number of tokens")
        records = launched.records
        outputs: list[RequestOutput] = []
        finished: list[RequestState] = []
        self._scores(records.scored, result, launched.num_sample_logprobs)
        self._pooled(records.pooled, result)
        self._prefilled(records.prefilled, outputs, finished)
        self._beams(records.beams, result)
        num_tokens = self._sampled(records.sampled, result, now, outputs, finished)
        num_tokens += self._verified(records.verified, result, now, outputs, finished)
        return Applied(outputs, finished, num_tokens)

    def _state(self, seq: Sequence) -> RequestState:
        return self.requests[seq.request_id][seq.index]

    def _scores(self, scored: list[tuple[Sequence, int, int]], result: StepOutput,
                first_score: int) -> None:
        for seq, score_row, num_scores in scored:
            if not seq.is_finished:
                start = first_score + score_row
                self._state(seq).prompt_logprobs.extend(  # type: ignore[union-attr]
                    result.logprobs[start:start + num_scores])  # type: ignore[index]

    def _pooled(self, pooled: list[tuple[Sequence, int]], result: StepOutput) -> None:
        for seq, pooled_at in pooled:
            if not seq.is_finished:
                self._state(seq).pooled = result.pooled[pooled_at]  # type: ignore[index]

    def _prefilled(self, prefilled: list[tuple[Sequence, int, int]],
                   outputs: list[RequestOutput], finished: list[RequestState]) -> None:
        for seq, kv_end, num_preemptions in prefilled:
            if seq.is_finished:
                continue
            if seq.num_preemptions == num_preemptions:  # its blocks still hold this KV
                self.block_manager.cache_full_blocks(seq, kv_end)
            if seq.params.max_tokens == 0 and kv_end >= seq.num_prompt_tokens:
                state = self._state(seq)
                state.finish_reason = "length"  # prefilled (and scored): nothing to generate
                finished.append(state)
                outputs.append(make_output(state))

    def _beams(self, beams: list[SampledRecord], result: StepOutput) -> None:
        for seq, kv_end, row, num_preemptions, lp_row in beams:
            if seq.is_finished:
                continue
            if seq.num_preemptions == num_preemptions:
                self.block_manager.cache_full_blocks(seq, kv_end)
            if row >= 0:
                seq.num_pending -= 1
                self.beams.report(seq, result.logprobs[lp_row])  # type: ignore[index]

    def _sampled(self, sampled: list[SampledRecord], result: StepOutput, now: float,
                 outputs: list[RequestOutput], finished: list[RequestState]) -> int:
        ids, num_tokens = result.ids, 0
        for seq, kv_end, row, num_preemptions, lp_row in sampled:
            if seq.is_finished:
                continue
            if seq.num_preemptions == num_preemptions:
                self.block_manager.cache_full_blocks(seq, kv_end)
            state = self._state(seq)
            seq.num_pending -= 1
            if lp_row >= 0:
                state.logprobs.append(result.logprobs[lp_row])  # type: ignore[union-attr,index]
            append_token(state, ids[row], now, self.max_model_len)
            num_tokens += 1
            _emit(state, outputs, finished)
        return num_tokens

    def _verified(self, verified: list[VerifiedRecord], result: StepOutput, now: float,
                  outputs: list[RequestOutput], finished: list[RequestState]) -> int:
        num_tokens = 0
        for seq, kv_end, row, num_preemptions, lp_row, drafts in verified:
            if seq.is_finished:
                continue
            if drafts[0] < 0:  # the ranks' drafter proposed them: what they were
                drafts = tuple(result.drafts[placeholder_row(d)]  # type: ignore[index]
                               for d in drafts)
            logprobs = (result.logprobs[lp_row:lp_row + len(drafts) + 1]  # type: ignore[index]
                        if lp_row >= 0 else None)
            state = self._state(seq)
            num_tokens += self._verify(state, result.ids[row:row + len(drafts) + 1], drafts,
                                       logprobs, kv_end, seq.num_preemptions == num_preemptions,
                                       now)
            _emit(state, outputs, finished)
        return num_tokens

    def _verify(self, state: RequestState, sampled: list[int], drafts: tuple[int, ...],
                logprobs: list[TokenLogprobs] | None, kv_end: int, kept: bool,
                now: float) -> int:
        """The tokens the drafts confirm join the choice; the rejected drafts' KV is dropped
        when its blocks still hold it (``kept``). Returns the tokens taken."""
        seq, speculator = state.seq, self.speculator
        assert speculator is not None, "drafts verified without a speculator"
        seq.num_pending -= 1
        tokens = speculator.emitted(seq, drafts, sampled)
        rejected = len(drafts) + 1 - len(tokens)
        seq.num_draft_tokens += len(drafts)
        seq.num_accepted_drafts += len(drafts) - rejected
        taken = 0
        for i, token in enumerate(tokens):
            if logprobs is not None:
                state.logprobs.append(logprobs[i])  # type: ignore[union-attr]
            append_token(state, token, now, self.max_model_len)
            taken += 1
            if state.finish_reason is not None:
                break
        if kept:  # its blocks still hold this KV: the computed part no longer counts rejects
            seq.num_computed_tokens -= rejected
            if speculator.on_ranks:
                # a draft model fed itself every kept token but a last draft kept; EAGLE-3
                # feeds the accepted drafts again, from the target's features
                accepted = len(drafts) - rejected
                seq.draft_len = seq.num_computed_tokens - (
                    accepted if speculator.config.refeeds_accepted else rejected == 0)
                self.block_manager.mark_drafted(seq)  # a later prefix hit skips these rows
            self.block_manager.cache_full_blocks(seq, min(kv_end - rejected, len(seq.token_ids)))
        return taken


def _emit(state: RequestState, outputs: list[RequestOutput], finished: list[RequestState]) -> None:
    """A choice that took tokens: its output if it finished or streams."""
    if state.finish_reason is not None:
        finished.append(state)
        outputs.append(make_output(state))
    elif state.stream:
        outputs.append(make_output(state))
