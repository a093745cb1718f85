"""``compiled(fn)``: ``fn`` through ``torch.compile`` (dynamic shapes), compiled at its first call.

One compiled artifact per function, shared by every layer that uses it. ``torch.compile``
imports TorchDynamo and Inductor when it is called (2-4 s of a rank's start-up on a GPU node),
so the call waits for the first use: a layer whose Triton kernel replaces the compiled path
(``use_triton_kernels``) never pays for it.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)


@functools.cache
def compiled(fn: F) -> F:
    compiled_fn: Callable | None = None

    @functools.wraps(fn)
    def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - fn's own signature
        nonlocal compiled_fn
        if compiled_fn is None:
            compiled_fn = torch.compile(fn, dynamic=True)
        return compiled_fn(*args, **kwargs)

    return call  # type: ignore[return-value]
