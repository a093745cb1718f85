"""In-process engines on the embedded tiny model, as the engine tests build them."""

from __future__ import annotations

from typing import Any

from nvray import LLM

BLOCK = 8  # KV block size: small, so short prompts fill several blocks


def tiny_inprocess(max_model_len: int = 128, **options: Any) -> LLM:
    return LLM("tiny", runtime="inprocess", max_model_len=max_model_len,
               kvcache_block_size=BLOCK, **options)
