"""EngineRequest: one request, the same type from the caller to the engine's step loop.

A Serve replica, an ``EngineClient``, the offline ``LLM`` and a batch job build it; the output
router (``runtime/output_router.py``) gives it its id and stream mode and sends it to the
driver, which templates a chat prompt and validates the parameters (``runtime/driver.py``); the
engine loop hands it to ``LLMEngine.add_request`` (``runtime/engine_loop.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class EngineRequest:
    prompt: Any  # a string, token ids, or chat messages (the driver renders those)
    params: Any = None  # SamplingParams, BeamSearchParams, or a dict of SamplingParams' fields
    request_id: str | None = None  # None: the output router gives it a fresh one
    priority: int = 0
    stream: bool = False  # an output every step it makes progress, not only the final one
    lora_request: Any = None  # a LoRARequest (nvray/lora): the adapter it runs through
