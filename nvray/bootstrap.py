"""Assemble an LLMEngine from an EngineConfig: model path, tokenizer and EOS ids
(``tokenizer.py``), executor, limits.

The executor is the step protocol's ``Executor`` (``nvray/step_protocol.py``): the in-process
runner or the Ray rank group, made by ``make_executor``. Once the engine
exists, the objects of start-up are frozen out of the cyclic GC (``gc_freeze.py``).
"""

from __future__ import annotations

import functools
from typing import Callable

from nvray.config import EngineConfig
from nvray.engine.engine import LLMEngine, ModelLimits
from nvray.gc_freeze import freeze_startup_objects
from nvray.grammar import grammar_compiler
from nvray.models.tiny import resolve_model
from nvray.step_protocol import Executor
from nvray.tokenizer import eos_token_ids, load_tokenizer


def create_engine(config: EngineConfig,
                  make_executor: Callable[[EngineConfig, str], Executor]) -> LLMEngine:
    model_path = resolve_model(config.model)
    tokenizer = load_tokenizer(model_path)
    executor = make_executor(config, model_path)
    limits = ModelLimits(max_model_len=executor.max_model_len, vocab_size=executor.vocab_size,
                         num_kvcache_blocks=executor.num_blocks, block_size=config.kvcache_block_size,
                         eos_token_ids=eos_token_ids(model_path, tokenizer))
    engine = LLMEngine(config, tokenizer, executor, limits,
                       grammar_compiler=functools.partial(grammar_compiler, model_path,
                                                          executor.vocab_size))
    freeze_startup_objects()  # start-up done: keep full GC passes off the steps
    return engine
