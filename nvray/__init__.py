"""nvray: an LLM inference engine and serving framework on Ray.

``from nvray import LLM, SamplingParams`` is the offline API; importing nvray needs neither
CUDA, Triton, flash-attn nor Ray (heavy parts are imported when used).
"""

from __future__ import annotations

from typing import Any

from nvray.config import EngineConfig
from nvray.lora.request import LoRARequest
from nvray.outputs import RequestOutput, TokenLogprobs
from nvray.sampling_params import BeamSearchParams, SamplingParams

__all__ = ["LLM", "BeamSearchParams", "EngineConfig", "LoRARequest", "RequestOutput",
           "SamplingParams", "TokenLogprobs"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from nvray.llm import LLM  # noqa: PLC0415 - torch is imported only when LLM is used

        return LLM
    raise AttributeError(f"module 'nvray' has no attribute {name!r}")
