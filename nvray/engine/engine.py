"""LLMEngine: the step loop — admit requests, schedule, run the ranks, apply stop rules.

Pure Python: the model runs behind an ``Executor`` (``nvray/step_protocol.py``: in-process or
Ray actors), the tokenizer is passed in, the settings come from one ``EngineConfig``.
``add_request`` validates through ``RequestIntake`` (``intake.py``) and raises ``ValueError``
for a request that can never run, so nothing that is accepted can stall the queue. ``step``
returns one ``RequestOutput`` per request that produced tokens or finished in that step: it is
``scheduler.schedule``, ``launch_scheduled`` (the ``StepInput``; KV and sampled tokens
accounted as launched), the executor, and ``update_from_output`` (the results applied to their
requests), which a caller timing the pieces may call itself. What a sampled token does to its
request (stop rules, text, outputs) is ``output_processor.py``.

Overlapped steps (``overlap=True``): each ``step`` schedules and launches step N+1 before it
post-processes step N, so the control plane works while the device computes. A sequence that
sampled at step N is scheduled at N+1 with a placeholder for that token (the ranks fill it in
on the device, ``nvray/step_protocol.py``); its blocks for it are allocated then. When step N's ids
arrive, a sequence that finished at N (EOS, stop string, max_tokens, abort) drops the token
step N+1 computes for it, and its blocks were freed once, when it finished. ``overlap=False``
runs each step to completion before scheduling the next; both give the same tokens.

Pipeline stages (``pipeline_parallel_size`` P > 1): each ``step`` hands the executor steps
while fewer than P are in flight and one can be scheduled (the scheduler splits the sequences
between the steps in flight and never schedules one whose token is being sampled), then reads
the oldest step's ids, applies them and hands over the step they make possible before it
returns their outputs; so every stage has a step to run. Overlapped steps are
off then (P steps in flight overlap the control plane already).

A request with ``n > 1`` is ``n`` sequences (its choices, by ``index``) that share the prompt's
KV blocks (``Scheduler``: forks); a beam search (``BeamSearchParams``) is run by the
``BeamSearcher``, which gets each beam's reported log-probabilities instead of a token. Outputs
carry the log-probabilities a request asked for (``TokenLogprobs``), from the ranks'
``StepOutput``.

``stats()`` counts the steps and their wall time by kind: ``prefill`` when a step launches
prompt tokens (with decodes or not), else ``decode``; with overlapped steps, the call that only
collects the last step in flight counts as that step's kind.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Any, Callable, NamedTuple

from nvray.config import EngineConfig
from nvray.engine.beam_search import BeamSearcher
from nvray.engine.block_manager import BlockManager
from nvray.engine.intake import ModelLimits, RequestIntake
from nvray.engine.metrics import RequestMetrics
from nvray.engine.output_processor import append_token, complete_text, make_output
from nvray.engine.scheduler import Scheduler, SchedulerOutput
from nvray.engine.sequence import RequestState, SeqPlan, Sequence
from nvray.engine.speculation import Speculator
from nvray.engine.step_builder import build_step_input
from nvray.lora.registry import LoRARegistry
from nvray.lora.request import LoRARequest
from nvray.lora.slots import LoRASlots
from nvray.outputs import RequestOutput, TokenLogprobs
from nvray.sampling_params import BeamSearchParams, SamplingParams
from nvray.startup_phases import describe
from nvray.step_protocol import Executor, StepInput, StepOutput, placeholder_row
from nvray.structured_outputs import GrammarSpec

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "ModelLimits"]


# What a launched step's results mean for one of its sequences, as a plain tuple: (seq, KV
# written up to here when the step is done, its row among the sampled ids or -1, its preemption
# count at launch, its sampled token's row among the step's logprobs or -1, its prompt scores'
# first row among the score rows, their number, its row among the pooled rows or -1, the drafts
# it verifies: its sampled ids are rows row .. row + len(drafts)). A NamedTuple costs ~0.1 us
# more per record even built in C: +26 us on the control-plane bench's 256-sequence step (+7%
# of building its input).
SeqRecord = tuple[Sequence, int, int, int, int, int, int, int, tuple[int, ...]]


class LaunchedStep(NamedTuple):
    """A step handed to the executor, and what its results will mean."""

    step_input: StepInput
    records: list[SeqRecord]  # one per scheduled sequence, in step order
    num_sample_logprobs: int = 0  # logprob rows of sampled tokens (score rows come after)
    computes_prompt: bool = False  # some of its tokens are prompt tokens (a prefill step)


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Any, executor: Executor,
                 limits: ModelLimits, clock: Callable[[], float] = time.monotonic,
                 grammar_compiler: Callable[[], Any] | None = None) -> None:
        """``limits`` are the facts start-up found (``config.max_model_len`` resolved, the KV
        block count); ``clock`` times requests (tests pass a fake one); ``grammar_compiler``
        gives the ``GrammarCompiler`` of structured outputs (made on first use)."""
        self.tokenizer = tokenizer
        self.executor = executor
        self.overlap = config.overlaps_steps
        self.in_flight: LaunchedStep | None = None  # overlap: launched, ids not yet read
        self.pipeline_depth = config.pipeline_parallel_size
        self.pipeline: collections.deque[LaunchedStep] = collections.deque()  # stages' steps
        self.startup: dict[str, object] = {}  # record_startup: seconds by phase
        self.limits = limits
        self.clock = clock
        spec = config.speculative
        self.block_manager = BlockManager(limits.num_kvcache_blocks, limits.block_size,
                                          config.enable_prefix_caching, limits.kv_group_windows,
                                          limits.num_state_slots, config.max_num_seqs,
                                          spec is not None and spec.drafter_rows_lag)
        self.loras = LoRARegistry(config.enable_lora, limits.lora_targets, config.max_lora_rank)
        self.lora_slots = LoRASlots(config.max_loras) if config.enable_lora else None
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.scheduling_policy,
                                   config.enable_chunked_prefill, config.sjf_aging_s, clock,
                                   config.pipeline_parallel_size, self.lora_slots)
        self.intake = RequestIntake(tokenizer, limits, self.block_manager,
                                    config.max_num_batched_tokens, config.enable_chunked_prefill,
                                    grammar_compiler)
        spec = config.speculative
        self.speculator = (Speculator(spec, limits.max_model_len, config.max_num_batched_tokens)
                           if spec is not None else None)
        self.new_grammars: list[GrammarSpec] = []  # for the ranks to compile ahead
        self.grammars_done: list[int] = []  # constrained sequences that finished
        self.requests: dict[str, list[RequestState]] = {}  # request_id -> its choices
        self.failed_choices: list[RequestOutput] = []  # ended while scheduling, for step()
        self.plans: dict[int, SeqPlan] = {}  # seq_id -> its plan
        self.beams = BeamSearcher(self.scheduler, tokenizer, self.plans)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.last_step_tokens = (0, 0)  # (prefill tokens, decode tokens) of the latest step
        self.metrics = RequestMetrics(limits.max_model_len)
        self.num_finished = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        self.num_accepted = 0  # requests add_request took; each finishes exactly once
        # wall time of step() calls and their number, by the kind of step each launched
        # (or, draining, finished): "prefill" computes prompt tokens, "decode" only decodes
        self.step_seconds = {"prefill": 0.0, "decode": 0.0}
        self.num_steps = {"prefill": 0, "decode": 0}

    # --------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | BeamSearchParams | None = None, priority: int = 0,
                    stream: bool = False, lora_request: LoRARequest | None = None) -> list[int]:
        """Queue a request; returns its prompt token ids. Raises ValueError if it can't run.

        A ``stream`` request gets an output every step it makes progress; others get only their
        final output. With ``n > 1`` each choice is a sequence of its own and its outputs carry
        its ``index``; the prompt is prefilled once (see ``Scheduler``: forks). A
        ``lora_request`` runs it through that adapter (checked here: ``LoRARegistry``).
        """
        params = params or SamplingParams()
        if request_id in self.requests or request_id in self.beams.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        # a pooling prompt is tokenized as its checkpoint's own pipeline does (an embedding
        # model's tokenizer may end it with EOS, which last-token pooling reads)
        adapter = self.loras.resolve(lora_request)
        token_ids = self.intake.tokenize(prompt, getattr(params, "pool", None) is not None,
                                         within_max_model_len=True)
        if isinstance(params, BeamSearchParams):
            if adapter is not None:
                raise ValueError("beam search with a LoRA adapter is not supported")
            return self._add_beam_search(request_id, token_ids, params, priority)
        params = self.intake.validate(token_ids, params)
        grammar = self.intake.compile_grammar(params)
        if grammar is not None:
            self.new_grammars.append(grammar)
        states = self.intake.new_choices(request_id, prompt, token_ids, params, priority, stream,
                                         self.clock)
        self.requests[request_id] = states
        for state in states:
            state.plan.grammar = grammar  # each choice gets its own matcher on rank 0
            state.seq.lora = adapter
            self.plans[state.seq.seq_id] = state.plan
            self.scheduler.add(state.seq)
        self.num_prompt_tokens += len(token_ids)
        self.num_accepted += len(states)
        return token_ids

    def prefetch_grammar(self, spec: GrammarSpec) -> None:
        """A request with this grammar is on its way: the ranks start compiling it with the
        next step (the caller compiles it for the engine meanwhile, ``intake.grammars``)."""
        self.new_grammars.append(spec)

    def _add_beam_search(self, request_id: str, token_ids: list[int], params: BeamSearchParams,
                         priority: int) -> list[int]:
        """A beam search (``beam_search.py``): its ``beam_width`` results come at the end."""
        self.intake.validate(token_ids, BeamSearcher.beam_params(params))
        self.beams.add(request_id, token_ids, params, self.intake.eos_ids(params), self.clock(),
                       priority)
        self.num_prompt_tokens += len(token_ids)
        self.num_accepted += params.beam_width
        return token_ids

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Abort every unfinished choice of the request; their final outputs ([] if unknown)."""
        if request_id in self.beams.groups:
            return self._count(self.beams.abort(request_id, "abort"))
        states = self.requests.get(request_id, [])
        return [self._finish(state, "abort") for state in list(states)
                if state.finish_reason is None]

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every request with an error (a step failed); the engine holds nothing after, and
        the executor forgets the steps in flight, so the engine can run again if it still can."""
        outputs = []
        self.in_flight = None
        self.pipeline.clear()
        self.executor.discard_in_flight()  # and rank 0's grammar matchers
        self.grammars_done.clear()
        for states in list(self.requests.values()):
            for state in states:
                if state.finish_reason is None:
                    state.error = message
                    outputs.append(self._finish(state, "error"))
        for request_id in list(self.beams.groups):
            outputs += self._count(self.beams.abort(request_id, "error", message))
        if self.lora_slots is not None:  # a failed step may have left a load half done
            self.lora_slots.reset()
        return outputs

    def _count(self, finals: list[RequestOutput]) -> list[RequestOutput]:
        """Count the final outputs of a beam search as finished requests."""
        for out in finals:
            self._count_finished(out.finish_reason)
        return finals

    def _count_finished(self, reason: str | None) -> None:
        reason = reason or "abort"
        self.num_finished[reason] = self.num_finished.get(reason, 0) + 1

    def has_unfinished_requests(self) -> bool:
        return (bool(self.requests) or bool(self.beams.groups) or self.in_flight is not None
                or bool(self.pipeline))

    # ------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        outputs = self._step()
        if self.failed_choices:  # failed while scheduling (an adapter changed on disk)
            outputs, self.failed_choices = self.failed_choices + outputs, []
        return outputs

    def _step(self) -> list[RequestOutput]:
        if self.pipeline_depth > 1:
            return self._pipelined_step()
        start = time.perf_counter()
        if self.overlap and self.speculator is not None and self.speculator.may_draft(
                self.scheduler.running, self.plans):
            return self._step_to_draft_from(start)
        launched = self._launch(draft=not self.overlap)
        if not self.overlap:
            if launched is None:
                return []
            outputs = self.update_from_output(launched, self.executor.execute(launched.step_input))
            self._account_step(launched, start)
            return outputs
        if launched is None and self.in_flight is None:
            return []
        sampled = self.executor.execute_overlapped(launched.step_input if launched else None)
        previous, self.in_flight = self.in_flight, launched
        outputs = [] if previous is None else self.update_from_output(previous, sampled or [])
        self._account_step(launched or previous, start)  # type: ignore[arg-type]
        return outputs

    def _step_to_draft_from(self, start: float) -> list[RequestOutput]:
        """With overlapped steps and speculation: a step whose tokens the next schedule drafts
        from runs with nothing in flight and is answered at once (``answer_now``); the step in
        flight, if any, is read first (its tokens are what drafts follow)."""
        if self.in_flight is not None:
            sampled = self.executor.execute_overlapped(None)
            previous, self.in_flight = self.in_flight, None
            self._account_step(previous, start)
            return self.update_from_output(previous, sampled or [])  # type: ignore[arg-type]
        launched = self._launch()
        if launched is None:
            return []
        launched = launched._replace(step_input=dataclasses.replace(launched.step_input,
                                                                    answer_now=True))
        outputs = self.update_from_output(
            launched, self.executor.execute_overlapped(launched.step_input))  # type: ignore[arg-type]
        self._account_step(launched, start)
        return outputs

    def _pipelined_step(self) -> list[RequestOutput]:
        """Apply the oldest step's ids once every stage has a step (or nothing more can be
        scheduled); the steps they free go out before the caller delivers the outputs."""
        start = time.perf_counter()
        self._fill_pipeline()
        if not self.pipeline:
            return []
        oldest = self.pipeline.popleft()
        outputs = self.update_from_output(oldest, self.executor.collect())
        self._fill_pipeline()  # the first stage is waiting for it
        self._account_step(oldest, start)
        return outputs

    def _fill_pipeline(self) -> None:
        """Hand the executor steps while a stage lacks one and one can be scheduled."""
        while len(self.pipeline) < self.pipeline_depth:
            launched = self._launch()
            if launched is None:
                return
            self.executor.submit(launched.step_input)
            self.pipeline.append(launched)

    def _account_step(self, step: LaunchedStep, start: float) -> None:
        kind = "prefill" if step.computes_prompt else "decode"
        self.step_seconds[kind] += time.perf_counter() - start
        self.num_steps[kind] += 1

    def _launch(self, draft: bool = True) -> LaunchedStep | None:
        """Schedule the next step and account for it as launched (KV and sampled tokens);
        ``draft`` False: no drafts in it (an overlapped step)."""
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.plans, draft)
        out = self.scheduler.schedule()
        for seq in self.scheduler.take_stale_adapters():
            self._fail_choice(seq, f"LoRA adapter {seq.lora.name!r}: its files in "
                                   f"{seq.lora.path} changed or went after it was checked")
        return None if out.is_empty else self.launch_scheduled(out)

    def _fail_choice(self, seq: Sequence, message: str) -> None:
        """End one waiting choice with an error; its output goes out with the step's."""
        for state in self.requests.get(seq.request_id, ()):
            if state.seq is seq and state.finish_reason is None:
                state.error = message
                self.failed_choices.append(self._finish(state, "error"))

    def launch_scheduled(self, out: SchedulerOutput) -> LaunchedStep:
        """Build the step input of a scheduled step and account for it as launched (KV and
        sampled tokens); the caller hands its ``step_input`` to the executor, then passes the
        result to ``update_from_output``. ``step`` does this; the control-plane bench times it."""
        num_decode = sum(n for seq, n in out.scheduled  # a token, or a verified run's
                         if (n == 1 or seq.drafts) and seq.num_computed_tokens >= seq.num_prompt_tokens)
        self.last_step_tokens = (out.num_batched_tokens - num_decode, num_decode)
        self.metrics.observe_step(out.num_batched_tokens)
        bm = self.block_manager
        step_input = build_step_input(out, self.plans, bm.take_copies(), bm.take_released(),
                                      self.new_grammars, self.grammars_done,
                                      bm.take_state_copies(),
                                      self.lora_slots.take_loads() if self.lora_slots else None)
        if self.new_grammars or self.grammars_done:
            self.new_grammars, self.grammars_done = [], []
        records: list[SeqRecord] = []
        row, logprob_row, score_row, pool_row = 0, 0, 0, 0
        for (seq, num_new), seq_step in zip(out.scheduled, step_input.seqs):
            seq.num_computed_tokens += num_new
            kv_end = seq.num_computed_tokens
            if kv_end == seq.state_save_at:  # the next step keeps its state (prefix caching)
                bm.save_state(seq)
            sample, score = seq_step.sample, seq_step.score
            num_scores = len(score.targets) if score is not None else 0
            pooled_at = -1
            if seq_step.pool is not None:
                pooled_at, pool_row = pool_row, pool_row + 1
            if sample is None:
                records.append((seq, kv_end, -1, seq.num_preemptions, -1, score_row, num_scores,
                                pooled_at, ()))
            else:
                seq.num_pending += 1
                seq.pending_row = row
                drafts = tuple(seq_step.token_ids[-seq_step.num_drafts:]) if seq_step.num_drafts else ()
                lp_row = -1
                if sample.logprobs >= 0:  # a row at each verified position
                    lp_row, logprob_row = logprob_row, logprob_row + 1 + len(drafts)
                records.append((seq, kv_end, row, seq.num_preemptions, lp_row, score_row,
                                num_scores, pooled_at, drafts))
                row += 1 + len(drafts)
            if seq.drafts:  # sent: the next schedule proposes afresh (no list a step otherwise)
                seq.drafts = []
            score_row += num_scores
        computes_prompt = num_decode < out.num_batched_tokens
        return LaunchedStep(step_input, records, logprob_row, computes_prompt)

    def update_from_output(self, launched: LaunchedStep, result: StepOutput
                           ) -> list[RequestOutput]:
        """Apply a launched step's results: tokens to their requests, stop rules, outputs."""
        sampled = result.ids
        assert len(sampled) == launched.step_input.num_samples, "ranks returned the wrong number of tokens"
        outputs, finished = [], []
        now = self.clock()
        first_score = launched.num_sample_logprobs
        for (seq, kv_end, row, num_preemptions, lp_row, score_row, num_scores,
             pooled_at, drafts) in launched.records:
            if seq.is_finished:  # finished or aborted since: this step's work for it is void
                continue
            if drafts and drafts[0] < 0:  # the ranks' drafter proposed them: what they were
                drafts = tuple(result.drafts[placeholder_row(d)] for d in drafts)  # type: ignore[index]
            if drafts:  # its tokens first: how much of this KV holds is the verification's
                logprobs = (result.logprobs[lp_row:lp_row + len(drafts) + 1]  # type: ignore[index]
                            if lp_row >= 0 else None)
                self._apply_verified(self.requests[seq.request_id][seq.index],
                                     sampled[row:row + len(drafts) + 1], drafts, logprobs, kv_end,
                                     seq.num_preemptions == num_preemptions, now, finished,
                                     outputs)
                continue
            if seq.num_preemptions == num_preemptions:  # its blocks still hold this KV
                self.block_manager.cache_full_blocks(seq, kv_end)
            if self.beams.groups and self.beams.owns(seq):
                if row >= 0:
                    seq.num_pending -= 1
                    self.beams.report(seq, result.logprobs[lp_row])  # type: ignore[index]
                continue
            state = self.requests[seq.request_id][seq.index]
            if num_scores:
                start = first_score + score_row
                state.prompt_logprobs.extend(  # type: ignore[union-attr]
                    result.logprobs[start:start + num_scores])  # type: ignore[index]
            if pooled_at >= 0:
                state.pooled = result.pooled[pooled_at]  # type: ignore[index]
            if row < 0:
                if seq.params.max_tokens == 0 and kv_end >= seq.num_prompt_tokens:
                    state.finish_reason = "length"  # prefilled (and scored): nothing to generate
                    finished.append(state)
                    outputs.append(make_output(state))
                continue
            seq.num_pending -= 1
            if lp_row >= 0:
                state.logprobs.append(result.logprobs[lp_row])  # type: ignore[union-attr,index]
            append_token(state, sampled[row], now, self.limits.max_model_len)
            self.num_generation_tokens += 1
            if state.finish_reason is not None:
                finished.append(state)
                outputs.append(make_output(state))
            elif state.stream:
                outputs.append(make_output(state))
        if finished:
            self.scheduler.finish_many([s.seq for s in finished], lambda s: s.finish_reason)
            for state in finished:
                self._forget(state)
                self._record(state)
        if self.beams.groups:
            outputs += self._count(self.beams.advance())
        return outputs

    def _apply_verified(self, state: RequestState, sampled: list[int],
                        drafts: tuple[int, ...], logprobs: list[TokenLogprobs] | None,
                        kv_end: int, kept: bool, now: float, finished: list[RequestState],
                        outputs: list[RequestOutput]) -> None:
        """A speculating sequence's step: the tokens its drafts confirm (``nvray/speculative.py``)
        join it one by one under the stop rules, each with its position's log-probabilities
        where asked; the KV of rejected drafts is dropped (the sequence computes from the first
        rejected position again; its blocks stay its own)."""
        seq = state.seq
        seq.num_pending -= 1
        tokens = self.speculator.emitted(seq, drafts, sampled)  # type: ignore[union-attr]
        rejected = len(drafts) + 1 - len(tokens)
        seq.num_draft_tokens += len(drafts)
        seq.num_accepted_drafts += len(drafts) - rejected
        for i, token in enumerate(tokens):
            if logprobs is not None:
                state.logprobs.append(logprobs[i])  # type: ignore[union-attr]
            append_token(state, token, now, self.limits.max_model_len)
            self.num_generation_tokens += 1
            if state.finish_reason is not None:
                break
        if kept:  # its blocks still hold this KV: the computed part no longer counts rejects
            seq.num_computed_tokens -= rejected
            speculator = self.speculator
            if speculator.on_ranks:  # type: ignore[union-attr]
                # a draft model fed itself every kept token but a last draft kept; EAGLE-3
                # feeds the accepted drafts again, from the target's features
                accepted = len(drafts) - rejected
                seq.draft_len = seq.num_computed_tokens - (
                    accepted if speculator.config.refeeds_accepted  # type: ignore[union-attr]
                    else rejected == 0)
                self.block_manager.mark_drafted(seq)  # a later prefix hit skips these rows
            self.block_manager.cache_full_blocks(seq, min(kv_end - rejected, len(seq.token_ids)))
        if state.finish_reason is not None:
            finished.append(state)
            outputs.append(make_output(state))
        elif state.stream:
            outputs.append(make_output(state))

    def _finish(self, state: RequestState, reason: str) -> RequestOutput:
        state.finish_reason = reason
        complete_text(state, state.seq.num_output_tokens, flush=False)
        if not state.seq.is_finished:
            self.scheduler.finish(state.seq, reason)
        self._forget(state)
        self._record(state)
        return make_output(state)

    def _record(self, state: RequestState) -> None:
        seq = state.seq
        self.metrics.observe_request(seq.arrival_time, seq.first_scheduled, state.timestamps,
                                     self.clock(), seq.num_prompt_tokens, seq.params)
        self._count_finished(state.finish_reason)

    def _forget(self, state: RequestState) -> None:
        """A choice finished: drop its plan (and rank 0's matcher), and the request once all
        its choices finished."""
        if self.plans.pop(state.seq.seq_id, state.plan).grammar is not None:
            self.grammars_done.append(state.seq.seq_id)
        rid = state.seq.request_id
        if all(s.finish_reason is not None for s in self.requests.get(rid, ())):
            if self.requests.pop(rid, None) is not None:
                self.metrics.observe_n(state.seq.params.n)

    def record_startup(self, phases: dict[str, float], total: float,
                       beside: dict[str, float] | None = None) -> None:
        """The start-up's seconds by phase and in all (``bootstrap.create_engine``)."""
        phases = {name: round(seconds, 3) for name, seconds in phases.items()}
        beside = {name: round(seconds, 3) for name, seconds in (beside or {}).items()}
        self.startup = {"total_s": round(total, 3), "phases_s": phases,
                        "other_s": round(max(0.0, total - sum(phases.values())), 3),
                        "beside_s": beside}
        logger.info("engine started in %s%s", describe(phases, total),
                    f" (beside them: {describe(beside)})" if beside else "")

    def stats(self) -> dict[str, Any]:
        spec = {"speculative": self.speculator.stats()} if self.speculator is not None else {}
        return {**self._base_stats(), **self._expert_load(), **spec, **self._lora_stats()}

    def _lora_stats(self) -> dict[str, Any]:
        """Multi-LoRA: the adapters in the GPU slots and the loads into them (swaps)."""
        slots = self.lora_slots
        if slots is None:
            return {}
        return {"lora": {"resident": slots.resident(), "num_slots": slots.num_slots,
                         "num_loads": slots.num_loads}}

    def _expert_load(self) -> dict[str, Any]:
        """Expert parallel: the (token, expert) pairs each rank's experts computed since
        start-up (``expert_pairs_by_rank``; by expert in checkpoint order:
        ``expert_pairs_by_expert``) and the busiest rank's share over the mean
        (``expert_load_imbalance``, 1.0 when even)."""
        if not self.limits.parallelism.get("expert_parallel"):
            return {}
        per_rank = self.executor.expert_load()
        if not per_rank:  # a rank did not answer: the health check reports it
            return {}
        totals = [sum(load) for load in per_rank]
        mean = sum(totals) / len(totals)
        return {"expert_pairs_by_rank": {str(r): n for r, n in enumerate(totals)},
                "expert_pairs_by_expert": [n for load in per_rank for n in load],
                "expert_load_imbalance": round(max(totals) / mean, 4) if mean else 1.0}

    def _base_stats(self) -> dict[str, Any]:
        bm = self.block_manager
        return {"num_running": len(self.scheduler.running),
                "num_waiting": len(self.scheduler.waiting),
                "kv_cache_usage": bm.usage,
                "kv_cache_peak_usage": bm.peak_usage,
                "num_kvcache_blocks": self.limits.num_kvcache_blocks,
                "prefix_cache_hit_rate": bm.prefix_hit_rate,
                "prefix_cache_queried_tokens": bm.num_queried_tokens,
                "prefix_cache_hit_tokens": bm.num_hit_tokens,
                "kv_blocks_copied": bm.num_copied_blocks,
                "prompt_tokens": self.num_prompt_tokens,
                "generation_tokens": self.num_generation_tokens,
                "num_preemptions": self.scheduler.num_preemptions,
                "num_accepted": self.num_accepted,
                "num_finished": dict(self.num_finished),
                "step_seconds": dict(self.step_seconds),
                "steps": dict(self.num_steps),
                "startup": self.startup,
                "dtypes": self.limits.dtypes,
                "parallelism": self.limits.parallelism,
                **self.metrics.snapshot()}
