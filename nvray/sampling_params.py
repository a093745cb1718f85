"""SamplingParams: how one request is sampled and when it stops, validated on construction.

Every invalid value raises ``ValueError`` naming the field, the value and the allowed range,
so the HTTP layer can turn it into a 400 without guessing.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

_MAX_SEED = 2**63 - 1


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

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", self._normalize_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", self._normalize_ids(self.stop_token_ids))
        self._validate_sampling()
        self._validate_lengths()
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
    def _normalize_ids(ids: Any) -> tuple[int, ...]:
        if ids is None:
            return ()
        _check(isinstance(ids, (list, tuple)) and all(_is_int(i) and i >= 0 for i in ids),
               "stop_token_ids", ids, "must be a list of non-negative integers")
        return tuple(ids)

    def _validate_sampling(self) -> None:
        _check(_is_number(self.temperature) and 0.0 <= self.temperature <= 100.0,
               "temperature", self.temperature, "must be a number in [0, 100]")
        _check(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", self.top_p,
               "must be a number in (0, 1]")
        _check(_is_int(self.top_k) and (self.top_k >= -1), "top_k", self.top_k,
               "must be -1 (disabled), 0 (disabled) or a positive integer")
        _check(_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", self.min_p,
               "must be a number in [0, 1]")

    def _validate_lengths(self) -> None:
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
               "max_tokens", self.max_tokens, "must be an integer >= 1 (or None: up to max_model_len)")
        upper = self.max_tokens if self.max_tokens is not None else 2**31
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= upper,
               "min_tokens", self.min_tokens, f"must be an integer in [0, max_tokens={self.max_tokens}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def max_stop_len(self) -> int:
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

