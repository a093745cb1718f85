"""Request intake: turn a prompt and its parameters into the states the step loop runs.

``RequestIntake`` tokenizes, and validates against the model's limits (``ModelLimits``) and the
scheduler's token budget: a request that can never run (empty, out-of-vocabulary ids, longer than
``max_model_len``, bigger than the KV cache) raises ``ValueError`` naming the problem, so nothing
that is accepted can stall the queue. ``new_choices`` builds a request's ``RequestState`` per
choice (``n > 1``: forks of the first, sharing its prompt KV).
"""

from __future__ import annotations

import dataclasses
from array import array
from dataclasses import dataclass, field
from typing import Any, Callable

from nvray.engine.block_manager import BlockManager
from nvray.engine.detokenizer import IncrementalDetokenizer
from nvray.engine.sequence import RequestState, SeqPlan, Sequence
from nvray.kv_layout import peak_blocks
from nvray.model_facts import ModelFacts
from nvray.sampling_params import BeamSearchParams, SamplingParams
from nvray.structured_outputs import GrammarSpec


@dataclass(frozen=True)
class ModelLimits(ModelFacts):
    """The model's facts (``nvray/model_facts.py``) and what the engine's start-up adds: the
    KV cache's blocks and the EOS ids."""

    num_kvcache_blocks: int = field(kw_only=True)
    block_size: int = field(kw_only=True)
    eos_token_ids: tuple[int, ...] = field(kw_only=True)

    @classmethod
    def of(cls, facts: ModelFacts, **added: Any) -> "ModelLimits":
        return cls(**facts.as_info(), **added)


# how much of an over-long text is tokenized to refuse it (characters per max_model_len token):
# well above what a token of a real vocabulary spans on average (3-5 characters of prose)
HEAD_CHARS_PER_TOKEN = 8


class RequestIntake:
    def __init__(self, tokenizer: Any, limits: ModelLimits, block_manager: BlockManager,
                 max_num_batched_tokens: int, enable_chunked_prefill: bool,
                 grammar_compiler: Callable[[], Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self._grammar_compiler = grammar_compiler
        self._grammars: Any = None
        self.limits = limits
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = False,
                 within_max_model_len: bool = False) -> list[int]:
        """A string's ids (``add_special_tokens``: with what the tokenizer adds around a text,
        for pooling prompts), or token ids checked to be ints. ``within_max_model_len``: a
        string far longer than ``max_model_len`` tokens is refused from its head alone, without
        tokenizing all of it (a 10 MB prompt took 14.5 s of the engine's process for a 400)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if within_max_model_len:
                self._refuse_if_surely_too_long(prompt, add_special_tokens)
            return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        if not isinstance(prompt, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("prompt must be a string or a list of token ids")
        return list(prompt)

    def _refuse_if_surely_too_long(self, prompt: str, add_special_tokens: bool) -> None:
        """A text longer than ``HEAD_CHARS_PER_TOKEN * max_model_len`` characters: its head of
        that many characters is tokenized first; past ``max_model_len`` (+1: the cut may split a
        token in two), the whole text is longer still, and is refused."""
        limit = self.limits.max_model_len
        head = HEAD_CHARS_PER_TOKEN * limit
        if len(prompt) <= head:
            return
        count = len(self.tokenizer.encode(prompt[:head], add_special_tokens=add_special_tokens))
        if count > limit + 1:
            raise ValueError(f"prompt is longer than max_model_len={limit} tokens: its first "
                             f"{head:,} of {len(prompt):,} characters alone are {count} tokens")

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
        self._check_fits(total)
        return params

    @property
    def grammars(self) -> Any:
        """The ``GrammarCompiler`` (``nvray/grammar.py``), made on first use."""
        if self._grammars is None:
            if self._grammar_compiler is None:
                raise ValueError("structured_outputs: this engine has no grammar compiler")
            self._grammars = self._grammar_compiler()
        return self._grammars

    def compile_grammar(self, params: SamplingParams) -> GrammarSpec | None:
        """The request's grammar, compiled (cached: a caller may have compiled it ahead, off
        the step loop); None without structured outputs. ValueError names what fails."""
        constraint = params.structured_outputs
        if constraint is None:
            return None
        spec = constraint.spec()
        self.grammars.compile(spec, constraint.origin)
        return spec

    def _check_fits(self, total: int) -> None:
        """A sequence of ``total`` tokens fits one step's budget (unchunked) and the KV cache."""
        lim = self.limits
        if not self.enable_chunked_prefill and total > self.max_num_batched_tokens:
            raise ValueError(f"prompt + max_tokens = {total} exceeds max_num_batched_tokens="
                             f"{self.max_num_batched_tokens} and chunked prefill is disabled")
        bm = self.block_manager
        chunk = self.max_num_batched_tokens if self.enable_chunked_prefill else total
        blocks = peak_blocks(bm.group_windows, total, bm.block_size, min(chunk, total))
        if blocks > lim.num_kvcache_blocks:
            raise ValueError(f"request needs {blocks} KV cache blocks but the cache has only "
                             f"{lim.num_kvcache_blocks}")

    def _check_token_ids(self, params: SamplingParams) -> None:
        vocab = self.limits.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ()),
                          ("stop_token_ids", params.stop_token_ids),
                          ("pool", params.pool or ())):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab})")

    def eos_ids(self, params: SamplingParams | BeamSearchParams) -> tuple[int, ...]:
        return () if params.ignore_eos else self.limits.eos_token_ids

    def stop_ids(self, params: SamplingParams) -> tuple[int, ...]:
        """The ids that end a sequence: EOS (unless ignore_eos), then ``stop_token_ids``."""
        return tuple(dict.fromkeys(self.eos_ids(params) + params.stop_token_ids))

    def bad_word_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Each bad word's token ids, as written and with a leading space (how a word usually
        appears mid-text)."""
        variants = []
        for word in words:
            for text in dict.fromkeys((word, word if word.startswith(" ") else " " + word)):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids:
                    variants.append(ids)
        return tuple(dict.fromkeys(variants))

    def new_choices(self, request_id: str, prompt: str | list[int], token_ids: list[int],
                    params: SamplingParams, priority: int, stream: bool,
                    clock: Callable[[], float]) -> list[RequestState]:
        """One state per choice of a validated request; choices after the first share its
        prompt KV (a scored prompt is computed by each)."""
        stop_ids, bad_words = self.stop_ids(params), self.bad_word_ids(params.bad_words)
        states = [self._new_choice(request_id, i, prompt, token_ids, params, stop_ids,
                                   bad_words, priority, stream, clock()) for i in range(params.n)]
        if len(token_ids) > 1 and params.prompt_logprobs is None:
            for state in states[1:]:
                state.seq.fork_of = states[0].seq
        return states

    def _new_choice(self, request_id: str, index: int, prompt: str | list[int],
                    token_ids: list[int], params: SamplingParams, stop_ids: tuple[int, ...],
                    bad_words: tuple[tuple[int, ...], ...], priority: int, stream: bool,
                    now: float) -> RequestState:
        if index and params.seed is not None:  # choice i of a seeded request: seed + i
            params = dataclasses.replace(params, seed=(params.seed + index) % (2**63))
        plan = SeqPlan.of(params, stop_ids, bad_words)
        seq = Sequence(request_id, token_ids, params, now, priority)
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
