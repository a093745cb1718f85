"""Helpers shared by the Serve tests: the app's max_model_len, greedy params, /metrics reads."""

from __future__ import annotations

import re

import requests

from nvray import SamplingParams

MAX_MODEL_LEN = 512


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def metric(base_url: str, name: str, **labels: str) -> float:
    """The first sample of /metrics' family ``name`` whose labels include ``labels``."""
    text = requests.get(f"{base_url}/metrics", timeout=30).text
    for label_text, value in re.findall(rf"^{name}(?:\{{([^}}]*)\}})? (\S+)$", text, re.M):
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            return float(value)
    raise AssertionError(f"{name} {labels or ''} not in /metrics")


def assert_counters_balance(base_url: str) -> None:
    """An idle engine: every request it accepted has finished, once (stop, length, abort or
    error)."""
    text = requests.get(f"{base_url}/metrics", timeout=30).text
    finished = sum(float(v) for v in re.findall(r"^nvray_requests_finished_total\{[^}]*\} (\S+)$",
                                                text, re.M))
    assert metric(base_url, "nvray_requests_accepted_total") == finished
