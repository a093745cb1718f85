"""LLMEngine: the step loop — admit requests, schedule, run the ranks, apply stop rules.

Pure Python: the model runs behind an ``Executor`` (``nvray/step_protocol.py``: in-process or
Ray actors), the tokenizer is passed in, the settings come from one ``EngineConfig``.
``add_request`` validates through ``RequestIntake`` (``intake.py``) and raises ``ValueError``
for a request that can never run, so nothing that is accepted can stall the queue. ``step``
returns one ``RequestOutput`` per request that produced tokens or finished in that step: it is
``scheduler.schedule``, ``launch_scheduled`` (the ``StepInput`` and its records, ``launch.py``:
KV and sampled tokens accounted as launched), the executor, and ``update_from_output`` (the
results applied to their requests, ``step_results.py``), which a caller timing the pieces may
call itself. How the calls overlap with the device — each step to completion, overlapped
steps, pipeline stages — is the stepper's (``steppers.py``), picked at start. What a sampled
token does to its request (stop rules, text, outputs) is ``output_processor.py``.

A request with ``n > 1`` is ``n`` sequences (its choices, by ``index``) that share the prompt's
KV blocks (``Scheduler``: forks); a beam search (``BeamSearchParams``) is run by the
``BeamSearcher``, which gets each beam's reported log-probabilities instead of a token. Outputs
carry the log-probabilities a request asked for (``TokenLogprobs``), from the ranks'
``StepOutput``. ``stats()`` is ``stats.py``'s snapshot.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from nvray.config import EngineConfig
from nvray.engine.beam_search import BeamSearcher
from nvray.engine.block_manager import BlockManager
from nvray.engine.intake import ModelLimits, RequestIntake
from nvray.engine.launch import LaunchedStep, launch, num_decode_tokens
from nvray.engine.metrics import RequestMetrics
from nvray.engine.output_processor import complete_text, make_output
from nvray.engine.scheduler import Scheduler, SchedulerOutput
from nvray.engine.sequence import RequestState, SeqPlan, Sequence
from nvray.engine.speculation import Speculator
from nvray.engine.stats import EngineCounters, snapshot
from nvray.engine.step_builder import build_step_input
from nvray.engine.step_results import StepResults
from nvray.engine.steppers import make_stepper
from nvray.lora.registry import LoRARegistry
from nvray.lora.request import LoRARequest
from nvray.lora.slots import LoRASlots
from nvray.outputs import RequestOutput
from nvray.sampling_params import BeamSearchParams, SamplingParams
from nvray.step_protocol import Executor, StepOutput
from nvray.structured_outputs import GrammarSpec

__all__ = ["LLMEngine", "LaunchedStep", "ModelLimits"]


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
        self.speculator = (Speculator(spec, limits.max_model_len, config.max_num_batched_tokens)
                           if spec is not None else None)
        self.new_grammars: list[GrammarSpec] = []  # for the ranks to compile ahead
        self.grammars_done: list[int] = []  # constrained sequences that finished
        self.requests: dict[str, list[RequestState]] = {}  # request_id -> its choices
        self.failed_choices: list[RequestOutput] = []  # ended while scheduling, for step()
        self.plans: dict[int, SeqPlan] = {}  # seq_id -> its plan
        self.beams = BeamSearcher(self.scheduler, tokenizer, self.plans)
        self.metrics = RequestMetrics(limits.max_model_len)
        self.counters = EngineCounters()
        self.results = StepResults(self.requests, self.block_manager, self.beams,
                                   self.speculator, limits.max_model_len)
        self.stepper = make_stepper(self, executor, self.overlap, config.pipeline_parallel_size,
                                    self._drafts_next)

    def _drafts_next(self) -> bool:
        """Overlapped steps: whether the next schedule drafts from the latest tokens."""
        return self.speculator is not None and self.speculator.may_draft(self.scheduler.running,
                                                                         self.plans)

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
        self.counters.num_prompt_tokens += len(token_ids)
        self.counters.num_accepted += len(states)
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
        self.counters.num_prompt_tokens += len(token_ids)
        self.counters.num_accepted += params.beam_width
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
        self.stepper.discard()
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
            self.counters.count_finished(out.finish_reason)
        return finals

    def has_unfinished_requests(self) -> bool:
        return (bool(self.requests) or bool(self.beams.groups)
                or bool(self.stepper.in_flight))

    # ------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        outputs = self.stepper.step()
        if self.failed_choices:  # failed while scheduling (an adapter changed on disk)
            outputs, self.failed_choices = self.failed_choices + outputs, []
        return outputs

    def launch(self, draft: bool = True) -> LaunchedStep | None:
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
        num_decode = num_decode_tokens(out)
        self.counters.last_step_tokens = (out.num_batched_tokens - num_decode, num_decode)
        self.metrics.observe_step(out.num_batched_tokens)
        bm = self.block_manager
        step_input = build_step_input(out, self.plans, bm.take_copies(), bm.take_released(),
                                      self.new_grammars, self.grammars_done,
                                      bm.take_state_copies(),
                                      self.lora_slots.take_loads() if self.lora_slots else None)
        if self.new_grammars or self.grammars_done:
            self.new_grammars, self.grammars_done = [], []
        return launch(out, step_input, num_decode, bm,
                      self.beams.owns if self.beams.groups else None)

    def update_from_output(self, launched: LaunchedStep, result: StepOutput
                           ) -> list[RequestOutput]:
        """Apply a launched step's results: tokens to their requests, stop rules, outputs."""
        outputs, finished, num_tokens = self.results.apply(launched, result, self.clock())
        self.counters.num_generation_tokens += num_tokens
        if finished:
            self.scheduler.finish_many([s.seq for s in finished], lambda s: s.finish_reason)
            for state in finished:
                self._forget(state)
                self._record(state)
        if self.beams.groups:
            outputs += self._count(self.beams.advance())
        return outputs

    def account_step(self, step: LaunchedStep, seconds: float) -> None:
        self.counters.account_step(step.computes_prompt, seconds)

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
        self.counters.count_finished(state.finish_reason)

    def _forget(self, state: RequestState) -> None:
        """A choice finished: drop its plan (and rank 0's matcher), and the request once all
        its choices finished."""
        if self.plans.pop(state.seq.seq_id, state.plan).grammar is not None:
            self.grammars_done.append(state.seq.seq_id)
        rid = state.seq.request_id
        if all(s.finish_reason is not None for s in self.requests.get(rid, ())):
            if self.requests.pop(rid, None) is not None:
                self.metrics.observe_n(state.seq.params.n)

    def stats(self) -> dict[str, Any]:
        """What the engine did since start-up and holds now (``stats.py``)."""
        return snapshot(self.counters, self.scheduler, self.block_manager, self.limits,
                        self.metrics, self.executor, self.speculator, self.lora_slots)
