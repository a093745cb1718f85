"""LLMEngine: the step loop — admit requests, schedule, run the ranks, apply stop rules.

Pure Python: the model runs behind an ``Executor`` (in-process or Ray actors), the tokenizer
is passed in. ``add_request`` validates and raises ``ValueError`` for a request that can never
run (empty, out-of-vocabulary ids, longer than ``max_model_len``, bigger than the KV cache), so
nothing that is accepted can stall the queue. ``step`` returns one ``RequestOutput`` per request
that produced tokens or finished in that step.

Overlapped steps (``overlap=True``): each ``step`` schedules and launches step N+1 before it
post-processes step N, so the control plane works while the device computes. A sequence that
sampled at step N is scheduled at N+1 with a placeholder for that token (the ranks fill it in
on the device, ``step_input.py``); its blocks for it are allocated then. When step N's ids
arrive, a sequence that finished at N (EOS, stop string, max_tokens, abort) drops the token
step N+1 computes for it, and its blocks were freed once, when it finished. ``overlap=False``
runs each step to completion before scheduling the next; both give the same tokens.

Text: a request that streams or has stop strings is detokenized token by token; any other is
detokenized once, when it finishes (the per-token cost only where someone reads it).

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

import dataclasses
import time
from array import array
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Protocol

from nvray.engine.beam_search import BeamSearcher
from nvray.engine.block_manager import BlockManager
from nvray.engine.detokenizer import IncrementalDetokenizer
from nvray.engine.metrics import RequestMetrics
from nvray.engine.scheduler import Scheduler, SchedulerOutput
from nvray.engine.sequence import Sequence
from nvray.engine.step_input import SeqPlan, StepInput, StepOutput, build_step_input
from nvray.outputs import RequestOutput, TokenLogprobs
from nvray.sampling_params import BeamSearchParams, SamplingParams


class Executor(Protocol):
    def execute(self, step: StepInput) -> StepOutput: ...

    def execute_overlapped(self, step: StepInput | None) -> StepOutput | None:
        """Launch ``step`` (None: nothing new); return the ids of the step launched before."""

    def discard_in_flight(self) -> None:
        """Forget launched steps whose ids were not read (the engine failed its requests)."""

    def shutdown(self) -> None: ...


@dataclass
class ModelLimits:
    """Facts about the loaded model and cache that the control plane needs."""

    max_model_len: int
    vocab_size: int
    num_kvcache_blocks: int
    block_size: int
    eos_token_ids: tuple[int, ...]


@dataclass
class RequestState:
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    plan: SeqPlan
    prompt: str | None
    prompt_token_ids: list[int]
    stream: bool = False  # emit an output every step, not only the final one
    text: str = ""
    num_text_tokens: int = 0  # output tokens given to the detokenizer
    num_emitted_chars: int = 0
    num_emitted_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    timestamps: list[float] = field(default_factory=list)  # one per generated token
    logprobs: list[TokenLogprobs] | None = None  # one per output token, if asked for
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # one per prompt token (first: None)


class LaunchedStep(NamedTuple):
    """A step handed to the executor, and what its results will mean."""

    step_input: StepInput
    # per scheduled sequence, a plain tuple (cheapest to build, 256 per step):
    # (seq, KV written up to here when the step is done, its row among the sampled ids or -1,
    #  its preemption count at launch, its sampled token's row among the step's logprobs or -1,
    #  its prompt scores' first row among the score rows, their number)
    records: list[tuple[Sequence, int, int, int, int, int, int]]
    num_sample_logprobs: int = 0  # logprob rows of sampled tokens (score rows come after)
    computes_prompt: bool = False  # some of its tokens are prompt tokens (a prefill step)


class LLMEngine:
    def __init__(self, tokenizer: Any, executor: Executor, limits: ModelLimits,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 scheduling_policy: str = "fcfs", enable_prefix_caching: bool = True,
                 enable_chunked_prefill: bool = True, sjf_aging_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, overlap: bool = True) -> None:
        self.tokenizer = tokenizer
        self.executor = executor
        self.overlap = overlap
        self.in_flight: LaunchedStep | None = None  # overlap: launched, ids not yet read
        self.limits = limits
        self.clock = clock
        self.block_manager = BlockManager(limits.num_kvcache_blocks, limits.block_size,
                                          enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens,
                                   scheduling_policy, enable_chunked_prefill, sjf_aging_s, clock)
        self.requests: dict[str, list[RequestState]] = {}  # request_id -> its choices
        self.plans: dict[int, SeqPlan] = {}  # seq_id -> its plan
        self.beams = BeamSearcher(self.scheduler, tokenizer, self.plans)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.last_step_tokens = (0, 0)  # (prefill tokens, decode tokens) of the latest step
        self.metrics = RequestMetrics()
        self.num_finished = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        self.num_accepted = 0  # requests add_request took; each finishes exactly once
        # wall time of step() calls and their number, by the kind of step each launched
        # (or, draining, finished): "prefill" computes prompt tokens, "decode" only decodes
        self.step_seconds = {"prefill": 0.0, "decode": 0.0}
        self.num_steps = {"prefill": 0, "decode": 0}

    # --------------------------------------------------------------- requests
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        if not isinstance(prompt, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("prompt must be a string or a list of token ids")
        return list(prompt)

    def validate(self, token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Check that the request can run; returns params with max_tokens resolved."""
        lim = self.limits
        if not token_ids:
            raise ValueError("prompt is empty")
        bad = [t for t in token_ids if not 0 <= t < lim.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {lim.vocab_size})")
        self._check_token_ids(params)
        if params.max_tokens is None:
            if len(token_ids) >= lim.max_model_len:
                raise ValueError(f"prompt ({len(token_ids)} tokens) leaves no room to generate "
                                 f"within max_model_len={lim.max_model_len}")
            params = dataclasses.replace(params, max_tokens=lim.max_model_len - len(token_ids))
        total = len(token_ids) + params.max_tokens
        if total > lim.max_model_len:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = "
                             f"{total} exceeds max_model_len={lim.max_model_len}")
        sched = self.scheduler
        if not sched.enable_chunked_prefill and total > sched.max_num_batched_tokens:
            raise ValueError(f"prompt + max_tokens = {total} exceeds max_num_batched_tokens="
                             f"{sched.max_num_batched_tokens} and chunked prefill is disabled")
        blocks = self.block_manager.num_blocks_for(total)
        if blocks > lim.num_kvcache_blocks:
            raise ValueError(f"request needs {blocks} KV cache blocks but the cache has only "
                             f"{lim.num_kvcache_blocks}")
        return params

    def _check_token_ids(self, params: SamplingParams) -> None:
        vocab = self.limits.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ()),
                          ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab})")

    def _bad_word_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Each bad word's token ids, as written and with a leading space (how a word usually
        appears mid-text)."""
        variants = []
        for word in words:
            for text in dict.fromkeys((word, word if word.startswith(" ") else " " + word)):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids:
                    variants.append(ids)
        return tuple(dict.fromkeys(variants))

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | BeamSearchParams | None = None, priority: int = 0,
                    stream: bool = False) -> list[int]:
        """Queue a request; returns its prompt token ids. Raises ValueError if it can't run.

        A ``stream`` request gets an output every step it makes progress; others get only their
        final output. With ``n > 1`` each choice is a sequence of its own and its outputs carry
        its ``index``; the prompt is prefilled once (see ``Scheduler``: forks).
        """
        params = params or SamplingParams()
        if request_id in self.requests or request_id in self.beams.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        token_ids = self.tokenize(prompt)
        if isinstance(params, BeamSearchParams):
            return self._add_beam_search(request_id, token_ids, params, priority)
        params = self.validate(token_ids, params)
        eos = () if params.ignore_eos else self.limits.eos_token_ids
        stop_ids = tuple(dict.fromkeys(eos + params.stop_token_ids))
        bad_words = self._bad_word_ids(params.bad_words)
        states = [self._new_choice(request_id, i, token_ids, params, stop_ids, bad_words, prompt,
                                   priority, stream)
                  for i in range(params.n)]
        if len(token_ids) > 1 and params.prompt_logprobs is None:  # the others share the
            # first choice's prompt KV (a scored prompt is computed by each)
            for state in states[1:]:
                state.seq.fork_of = states[0].seq
        self.requests[request_id] = states
        for state in states:
            self.plans[state.seq.seq_id] = state.plan
            self.scheduler.add(state.seq)
        self.num_prompt_tokens += len(token_ids)
        self.num_accepted += len(states)
        return token_ids

    def _add_beam_search(self, request_id: str, token_ids: list[int], params: BeamSearchParams,
                         priority: int) -> list[int]:
        """A beam search (``beam_search.py``): its ``beam_width`` results come at the end."""
        self.validate(token_ids, BeamSearcher.beam_params(params))
        eos = () if params.ignore_eos else self.limits.eos_token_ids
        self.beams.add(request_id, token_ids, params, eos, self.clock(), priority)
        self.num_prompt_tokens += len(token_ids)
        self.num_accepted += params.beam_width
        return token_ids

    def _new_choice(self, request_id: str, index: int, token_ids: list[int],
                    params: SamplingParams, stop_ids: tuple[int, ...],
                    bad_words: tuple[tuple[int, ...], ...], prompt: str | list[int],
                    priority: int, stream: bool) -> RequestState:
        if index and params.seed is not None:  # choice i of a seeded request: seed + i
            params = dataclasses.replace(params, seed=(params.seed + index) % (2**63))
        plan = SeqPlan.of(params, stop_ids, bad_words)
        seq = Sequence(request_id, token_ids, params, self.clock(), priority)
        seq.index = index
        seq.waits_for_tokens = any(len(word) > 1 for word in plan.bad_words)
        if params.has_penalties:
            seq.history = array("i", token_ids)
        state = RequestState(seq, IncrementalDetokenizer(self.tokenizer, token_ids), plan,
                             prompt if isinstance(prompt, str) else None, token_ids, stream)
        if params.logprobs is not None:
            state.logprobs = []
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        return state

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
        self.executor.discard_in_flight()
        for states in list(self.requests.values()):
            for state in states:
                if state.finish_reason is None:
                    state.error = message
                    outputs.append(self._finish(state, "error"))
        for request_id in list(self.beams.groups):
            outputs += self._count(self.beams.abort(request_id, "error", message))
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
        return bool(self.requests) or bool(self.beams.groups) or self.in_flight is not None

    # ------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        launched = self._launch()
        if not self.overlap:
            if launched is None:
                return []
            outputs = self._postprocess(launched, self.executor.execute(launched.step_input))
            self._account_step(launched, start)
            return outputs
        if launched is None and self.in_flight is None:
            return []
        sampled = self.executor.execute_overlapped(launched.step_input if launched else None)
        previous, self.in_flight = self.in_flight, launched
        outputs = [] if previous is None else self._postprocess(previous, sampled or [])
        self._account_step(launched or previous, start)  # type: ignore[arg-type]
        return outputs

    def _account_step(self, step: LaunchedStep, start: float) -> None:
        kind = "prefill" if step.computes_prompt else "decode"
        self.step_seconds[kind] += time.perf_counter() - start
        self.num_steps[kind] += 1

    def _launch(self) -> LaunchedStep | None:
        """Schedule the next step and account for it as launched (KV and sampled tokens)."""
        out = self.scheduler.schedule()
        return None if out.is_empty else self._launch_scheduled(out)

    def _launch_scheduled(self, out: SchedulerOutput) -> LaunchedStep:
        num_decode = sum(1 for seq, n in out.scheduled
                         if n == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens)
        self.last_step_tokens = (out.num_batched_tokens - num_decode, num_decode)
        bm = self.block_manager
        step_input = build_step_input(out, self.plans, bm.take_copies(), bm.take_released())
        records, row, logprob_row, score_row = [], 0, 0, 0
        for (seq, num_new), seq_step in zip(out.scheduled, step_input.seqs):
            seq.num_computed_tokens += num_new
            kv_end = seq.num_computed_tokens
            sample, score = seq_step.sample, seq_step.score
            num_scores = len(score.targets) if score is not None else 0
            if sample is None:
                records.append((seq, kv_end, -1, seq.num_preemptions, -1, score_row, num_scores))
            else:
                seq.num_pending += 1
                seq.pending_row = row
                lp_row = -1
                if sample.logprobs >= 0:
                    lp_row, logprob_row = logprob_row, logprob_row + 1
                records.append((seq, kv_end, row, seq.num_preemptions, lp_row, score_row,
                                num_scores))
                row += 1
            score_row += num_scores
        computes_prompt = num_decode < out.num_batched_tokens
        return LaunchedStep(step_input, records, logprob_row, computes_prompt)

    def _postprocess(self, launched: LaunchedStep, result: StepOutput) -> list[RequestOutput]:
        sampled = result.ids
        assert len(sampled) == launched.step_input.num_samples, "ranks returned the wrong number of tokens"
        outputs, finished = [], []
        now = self.clock()
        first_score = launched.num_sample_logprobs
        for seq, kv_end, row, num_preemptions, lp_row, score_row, num_scores in launched.records:
            if seq.is_finished:  # finished or aborted since: this step's work for it is void
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
            if row < 0:
                if seq.params.max_tokens == 0 and kv_end >= seq.num_prompt_tokens:
                    state.finish_reason = "length"  # prefilled (and scored): nothing to generate
                    finished.append(state)
                    outputs.append(self._make_output(state))
                continue
            seq.num_pending -= 1
            if lp_row >= 0:
                state.logprobs.append(result.logprobs[lp_row])  # type: ignore[union-attr,index]
            self._append_token(state, sampled[row], now)
            if state.finish_reason is not None:
                finished.append(state)
                outputs.append(self._make_output(state))
            elif state.stream:
                outputs.append(self._make_output(state))
        if finished:
            self.scheduler.finish_many([s.seq for s in finished], lambda s: s.finish_reason)
            for state in finished:
                self._forget(state)
                self._record(state)
        if self.beams.groups:
            outputs += self._count(self.beams.advance())
        return outputs

    def _append_token(self, state: RequestState, token: int, now: float) -> None:
        seq, params = state.seq, state.seq.params
        seq.token_ids.append(token)
        if seq.history is not None:
            seq.history.append(token)
        state.timestamps.append(now)
        self.num_generation_tokens += 1
        num_tokens = len(seq.token_ids)
        num_output = num_tokens - seq.num_prompt_tokens
        can_stop = num_output >= params.min_tokens
        if can_stop and token in state.plan.stop_ids:
            state.finish_reason = "stop"  # the stop token stays in token_ids, not in text
            self._complete_text(state, num_output - 1, flush=True)
            return
        if state.stream or params.stop:  # someone reads the text before the end: as it comes
            prev_len = len(state.text)
            self._complete_text(state, num_output, flush=False)
            if can_stop and params.stop and self._apply_stop_strings(state, prev_len):
                state.finish_reason = "stop"
                return  # text is cut at the stop string: nothing held back matters
        if num_output >= params.max_tokens or num_tokens >= self.limits.max_model_len:
            state.finish_reason = "length"
            self._complete_text(state, num_output, flush=True)

    @staticmethod
    def _complete_text(state: RequestState, num_tokens: int, flush: bool) -> None:
        """Detokenize the first ``num_tokens`` output tokens (those not yet done); ``flush``:
        also what the detokenizer holds back (the request is finishing)."""
        seq = state.seq
        if num_tokens > state.num_text_tokens:
            start = seq.num_prompt_tokens
            state.text += state.detokenizer.add_tokens(
                seq.token_ids[start + state.num_text_tokens:start + num_tokens])
            state.num_text_tokens = num_tokens
        if flush:
            state.text += state.detokenizer.flush()

    @staticmethod
    def _apply_stop_strings(state: RequestState, prev_len: int) -> bool:
        """Cut ``state.text`` at the first stop string that the new text completed."""
        params = state.seq.params
        start = max(0, prev_len - params.max_stop_len + 1)
        hits = [(at, stop) for stop in params.stop if (at := state.text.find(stop, start)) >= 0]
        if not hits:
            return False
        at, stop = min(hits)
        state.text = state.text[:at + len(stop) if params.include_stop_str_in_output else at]
        return True

    # ---------------------------------------------------------------- outputs
    def _make_output(self, state: RequestState) -> RequestOutput:
        seq = state.seq
        finished = state.finish_reason is not None
        hold = 0 if finished else max(0, seq.params.max_stop_len - 1)
        visible = max(state.num_emitted_chars, len(state.text) - hold)
        num_tokens = seq.num_output_tokens
        delta_text = state.text[state.num_emitted_chars:visible]
        delta_token_ids = seq.token_ids[seq.num_prompt_tokens + state.num_emitted_tokens:]
        if finished:
            out = RequestOutput(
                request_id=seq.request_id, index=seq.index, prompt_token_ids=state.prompt_token_ids,
                text=state.text, token_ids=seq.output_token_ids, delta_text=delta_text,
                delta_token_ids=delta_token_ids, finished=True, finish_reason=state.finish_reason,
                error=state.error, num_cached_tokens=seq.num_cached_tokens, prompt=state.prompt,
                logprobs=state.logprobs, prompt_logprobs=state.prompt_logprobs)
        else:  # a streaming step: the deltas only
            out = RequestOutput(seq.request_id, [], delta_text=delta_text,
                                delta_token_ids=delta_token_ids, index=seq.index)
            if state.num_emitted_tokens == 0 and state.prompt_logprobs is not None:
                out.prompt_logprobs = state.prompt_logprobs  # the first output: the prompt's
                out.prompt_token_ids = state.prompt_token_ids
        if state.logprobs is not None:
            out.delta_logprobs = state.logprobs[state.num_emitted_tokens:num_tokens]
        state.num_emitted_chars = visible
        state.num_emitted_tokens = num_tokens
        return out

    def _finish(self, state: RequestState, reason: str) -> RequestOutput:
        state.finish_reason = reason
        self._complete_text(state, state.seq.num_output_tokens, flush=False)
        if not state.seq.is_finished:
            self.scheduler.finish(state.seq, reason)
        self._forget(state)
        self._record(state)
        return self._make_output(state)

    def _record(self, state: RequestState) -> None:
        self.metrics.observe_request(state.seq.arrival_time, state.timestamps)
        self._count_finished(state.finish_reason)

    def _forget(self, state: RequestState) -> None:
        """A choice finished: drop its plan, and the request once all its choices finished."""
        self.plans.pop(state.seq.seq_id, None)
        rid = state.seq.request_id
        if all(s.finish_reason is not None for s in self.requests.get(rid, ())):
            self.requests.pop(rid, None)

    def stats(self) -> dict[str, float]:
        bm = self.block_manager
        return {"num_running": len(self.scheduler.running),
                "num_waiting": len(self.scheduler.waiting),
                "kv_cache_usage": bm.usage,
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
                **self.metrics.snapshot()}
