"""SamplingParams: how one request is sampled, what it reports and when it stops, validated on
construction; BeamSearchParams: the settings of a beam search.

Every invalid value raises ``ValueError`` naming the field, the value and the allowed range,
so the HTTP layer can turn it into a 400 without guessing. Meanings follow vLLM:

- ``logprobs=k``: each output token comes with its log-probability and the ``k`` most likely
  tokens' (0: the sampled token's only); ``prompt_logprobs=k``: the same for every prompt token
  but the first. Both are computed from the model's raw logits: before temperature, penalties,
  biases and top-k/top-p/min-p filtering.
- ``presence_penalty``/``frequency_penalty`` (in [-2, 2]) subtract ``presence`` once and
  ``frequency`` per occurrence from the logit of every token already in the output;
  ``repetition_penalty`` (> 0, 1 is off) divides a positive logit / multiplies a negative one
  of every token in the prompt or the output.
- ``logit_bias`` adds a bias (in [-100, 100]) to chosen token ids; ``allowed_token_ids`` keeps
  only those ids; ``bad_words`` are never generated (a word's last token is banned whenever the
  output ends with the word's other tokens).
- ``n`` independent completions of the prompt (a seeded request's i-th uses ``seed + i``).
- ``structured_outputs`` (``StructuredOutputsParams``, or a dict of its fields): the output
  follows a JSON schema, a regex, a choice or a grammar (``nvray/structured_outputs.py``).
- ``max_tokens=0`` generates nothing: the prompt is only prefilled (and scored, with
  ``prompt_logprobs``).
- ``speculate=False``: this request decodes a token a step even in an engine with a
  ``speculative_config`` (``nvray/speculative.py``); its tokens are the same either way.
- ``pool`` (with ``max_tokens=0``; what ``LLM.embed`` / ``LLM.score`` and the pooling routes
  send): the output's ``pooled`` is the final hidden state of the prompt's last token (``()``)
  or the logits of the listed token ids at that position (``nvray/pooling.py``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from nvray.structured_outputs import StructuredOutputsParams

_MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20  # most top log-probabilities per token (OpenAI's limit)
MAX_N = 128


def _check(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: {allowed}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request (vLLM's names and meanings)."""

    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    max_tokens: int | None = 16  # None: as many as max_model_len leaves room for
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    include_stop_str_in_output: bool = False
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    structured_outputs: StructuredOutputsParams | None = None
    pool: tuple[int, ...] | None = None
    speculate: bool = True  # False: a token a step even where the engine speculates

    def __post_init__(self) -> None:
        if self.structured_outputs is not None:
            object.__setattr__(self, "structured_outputs",
                               StructuredOutputsParams.coerce(self.structured_outputs))
        object.__setattr__(self, "stop", self._normalize_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", self._normalize_ids(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", self._normalize_bias(self.logit_bias))
        if self.allowed_token_ids is not None:
            ids = self._normalize_ids(self.allowed_token_ids, "allowed_token_ids")
            _check(bool(ids), "allowed_token_ids", self.allowed_token_ids,
                   "must list at least one token id (or be None)")
            object.__setattr__(self, "allowed_token_ids", ids)
        object.__setattr__(self, "bad_words", self._normalize_words(self.bad_words))
        self._validate_sampling()
        self._validate_penalties()
        self._validate_reporting()
        self._validate_lengths()
        _check(isinstance(self.speculate, bool), "speculate", self.speculate, "must be a bool")
        if self.pool is not None:
            object.__setattr__(self, "pool", self._normalize_ids(self.pool, "pool"))
            _check(self.max_tokens == 0, "max_tokens", self.max_tokens,
                   "must be 0 with pool (a pooling request generates nothing)")
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed <= _MAX_SEED),
               "seed", self.seed, f"must be an integer in [0, {_MAX_SEED}] or None")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", self.ignore_eos,
               "must be a boolean")

    @staticmethod
    def _normalize_stop(stop: Any) -> tuple[str, ...]:
        if stop is None:
            return ()
        if isinstance(stop, str):
            stop = (stop,)
        _check(isinstance(stop, (list, tuple)) and all(isinstance(s, str) and s for s in stop),
               "stop", stop, "must be a non-empty string or a list of non-empty strings")
        return tuple(stop)

    @staticmethod
    def _normalize_ids(ids: Any, name: str = "stop_token_ids") -> tuple[int, ...]:
        if ids is None:
            return ()
        _check(isinstance(ids, (list, tuple)) and all(_is_int(i) and i >= 0 for i in ids),
               name, ids, "must be a list of non-negative integers")
        return tuple(ids)

    @staticmethod
    def _normalize_bias(bias: Any) -> dict[int, float] | None:
        """Token id -> bias; keys may be strings of digits (JSON objects have string keys)."""
        if not bias:
            return None
        _check(isinstance(bias, dict), "logit_bias", bias, "must map token ids to numbers")
        out = {}
        for key, value in bias.items():
            token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
            _check(_is_int(token) and token >= 0, "logit_bias", key,
                   "keys must be non-negative token ids")
            _check(_is_number(value) and -100 <= value <= 100, "logit_bias", value,
                   "values must be numbers in [-100, 100]")
            out[token] = float(value)
        return out

    @staticmethod
    def _normalize_words(words: Any) -> tuple[str, ...]:
        if not words:
            return ()
        if isinstance(words, str):
            words = (words,)
        _check(isinstance(words, (list, tuple)) and all(isinstance(w, str) and w.strip()
                                                        for w in words),
               "bad_words", words, "must be a list of non-blank strings")
        return tuple(words)

    def _validate_sampling(self) -> None:
        _check(_is_number(self.temperature) and 0.0 <= self.temperature <= 100.0,
               "temperature", self.temperature, "must be a number in [0, 100]")
        _check(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", self.top_p,
               "must be a number in (0, 1]")
        _check(_is_int(self.top_k) and (self.top_k >= -1), "top_k", self.top_k,
               "must be -1 (disabled), 0 (disabled) or a positive integer")
        _check(_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", self.min_p,
               "must be a number in [0, 1]")

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2.0 <= value <= 2.0, name, value,
                   "must be a number in [-2, 2]")
        _check(_is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
               "repetition_penalty", self.repetition_penalty,
               "must be a number in (0, 10] (1 is off)")

    def _validate_reporting(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS), name, value,
                   f"must be an integer in [0, {MAX_LOGPROBS}] or None")
        _check(_is_int(self.n) and 1 <= self.n <= MAX_N, "n", self.n,
               f"must be an integer in [1, {MAX_N}]")

    def _validate_lengths(self) -> None:
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 0),
               "max_tokens", self.max_tokens,
               "must be an integer >= 0 (0: prefill only) or None (up to max_model_len)")
        upper = self.max_tokens if self.max_tokens is not None else 2**31
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= upper,
               "min_tokens", self.min_tokens, f"must be an integer in [0, max_tokens={self.max_tokens}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def adjusts_logits(self) -> bool:
        """Penalties, biases or allowed ids change the logits before sampling."""
        return self.has_penalties or bool(self.logit_bias) or self.allowed_token_ids is not None

    @cached_property
    def max_stop_len(self) -> int:
        """The longest stop string (read for every streamed token: computed once)."""
        return max((len(s) for s in self.stop), default=0)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SamplingParams":
        """Build from a plain dict; unknown keys are an error that names them."""
        if not isinstance(values, dict):
            raise ValueError(f"sampling_params must be a dict or SamplingParams, got {type(values).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {unknown}; allowed: {sorted(names)}")
        return cls(**values)

    @classmethod
    def coerce(cls, value: "SamplingParams | dict[str, Any] | None") -> "SamplingParams":
        if value is None:
            return cls()
        return value if isinstance(value, cls) else cls.from_dict(value)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)



@dataclass(frozen=True)
class BeamSearchParams:
    """A beam search: keep the ``beam_width`` most likely continuations, token by token.

    A beam's score is its cumulative log-probability divided by ``length ** length_penalty``
    (length: prompt + generated tokens, as vLLM counts it); a beam that reaches EOS is done
    (unless ``ignore_eos``). ``LLM.beam_search`` returns the ``beam_width`` best beams.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # only 0 (log-probabilities of the raw logits) is defined
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        widest = MAX_LOGPROBS // 2  # each step ranks 2 * beam_width candidates per beam
        _check(_is_int(self.beam_width) and 1 <= self.beam_width <= widest,
               "beam_width", self.beam_width, f"must be an integer in [1, {widest}]")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", self.max_tokens,
               "must be an integer >= 1")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", self.ignore_eos,
               "must be a boolean")
        _check(self.temperature == 0.0, "temperature", self.temperature,
               "beam search ranks beams by the model's log-probabilities: only 0 is supported")
        _check(_is_number(self.length_penalty) and -10 <= self.length_penalty <= 10,
               "length_penalty", self.length_penalty, "must be a number in [-10, 10]")


def num_choices(params: Any) -> int:
    """How many outputs a request gives: ``n``, or a beam search's ``beam_width`` (params as a
    SamplingParams, a BeamSearchParams or a dict); 1 if that is not a valid count (the engine
    then rejects the request, naming the field)."""
    if isinstance(params, BeamSearchParams):
        return params.beam_width
    n = params.get("n", 1) if isinstance(params, dict) else getattr(params, "n", 1)
    valid = isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_N
    return n if valid else 1
