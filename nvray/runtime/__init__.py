"""Ray runtime: one engine = a placement group holding an EngineDriver actor (tokenizer,
scheduler, block manager, step loop) and one RankWorker actor per tensor-parallel rank.

``start_engine(config)`` places and starts an engine and returns an ``EngineClient``; the
driver's methods are the one API that the offline LLM, Serve and batch jobs use.

The names below load on first use: importing a light submodule (``nvray.runtime.cluster``,
which connects to Ray) does not import torch and the engine, so ``LLM()`` can connect to Ray
while those imports run beside it.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"EngineClient": "nvray.runtime.client", "start_engine": "nvray.runtime.client",
            "EngineDeadError": "nvray.runtime.errors"}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'nvray.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
