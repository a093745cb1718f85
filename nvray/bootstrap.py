"""Assemble an LLMEngine from an EngineConfig: model path, tokenizer, EOS ids, executor, limits.

The executor is anything with ``execute(step)``, ``shutdown()`` and the facts ``num_blocks``,
``max_model_len``, ``vocab_size`` (the in-process runner or the Ray rank group). Once the engine
exists, the objects of start-up are frozen out of the cyclic GC (``gc_freeze.py``).
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

from nvray.config import EngineConfig
from nvray.engine.engine import LLMEngine, ModelLimits
from nvray.gc_freeze import freeze_startup_objects
from nvray.models.tiny import resolve_model


def load_tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer  # noqa: PLC0415

    return AutoTokenizer.from_pretrained(model_path)


def eos_token_ids(model_path: str, tokenizer: Any) -> tuple[int, ...]:
    """EOS ids from generation_config.json, config.json and the tokenizer, de-duplicated."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        file = os.path.join(model_path, name)
        if os.path.exists(file):
            with open(file) as f:
                value = json.load(f).get("eos_token_id")
            ids.extend(value if isinstance(value, list) else [value] if value is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))


def create_engine(config: EngineConfig, make_executor: Callable[[EngineConfig, str], Any]) -> LLMEngine:
    model_path = resolve_model(config.model)
    tokenizer = load_tokenizer(model_path)
    executor = make_executor(config, model_path)
    limits = ModelLimits(max_model_len=executor.max_model_len, vocab_size=executor.vocab_size,
                         num_kvcache_blocks=executor.num_blocks, block_size=config.kvcache_block_size,
                         eos_token_ids=eos_token_ids(model_path, tokenizer))
    engine = LLMEngine(tokenizer, executor, limits, max_num_seqs=config.max_num_seqs,
                       max_num_batched_tokens=config.max_num_batched_tokens,
                       scheduling_policy=config.scheduling_policy,
                       enable_prefix_caching=config.enable_prefix_caching,
                       enable_chunked_prefill=config.enable_chunked_prefill,
                       sjf_aging_s=config.sjf_aging_s, overlap=config.overlap_scheduling)
    freeze_startup_objects()  # start-up done: keep full GC passes off the steps
    return engine
