"""Assemble an LLMEngine from an EngineConfig: model path, tokenizer and EOS ids
(``tokenizer.py``), executor, limits.

The executor is the step protocol's ``Executor`` (``nvray/step_protocol.py``): the in-process
runner or the Ray rank group, made by ``make_executor``. Once the engine
exists, the objects of start-up are frozen out of the cyclic GC (``gc_freeze.py``), and the
engine is given its start-up seconds by phase (``startup_phases.py``).
"""

from __future__ import annotations

import functools
import time
from typing import Callable

from nvray.config import EngineConfig
from nvray.engine.engine import LLMEngine, ModelLimits
from nvray.gc_freeze import freeze_startup_objects
from nvray.grammar import grammar_compiler
from nvray.models.tiny import resolve_model
from nvray.startup_phases import StartupPhases
from nvray.step_protocol import Executor
from nvray.tokenizer import eos_token_ids, load_tokenizer


def create_engine(config: EngineConfig,
                  make_executor: Callable[[EngineConfig, str], Executor],
                  phases: StartupPhases | None = None, start: float | None = None) -> LLMEngine:
    """``phases`` and ``start``: a start-up the caller began timing earlier (its imports)."""
    start = time.perf_counter() if start is None else start
    phases = phases or StartupPhases()
    with phases.phase("model_files"):
        model_path = resolve_model(config.model)
    with phases.phase("tokenizer"):
        tokenizer = load_tokenizer(model_path)
    executor_start = time.perf_counter()
    executor = make_executor(config, model_path)
    ranks = getattr(executor, "startup_phases", {})
    phases.add(ranks)
    phases.seconds["executor_other"] = max(0.0, time.perf_counter() - executor_start
                                           - sum(ranks.values()))
    with phases.phase("engine"):
        limits = ModelLimits(max_model_len=executor.max_model_len,
                             vocab_size=executor.vocab_size, num_kvcache_blocks=executor.num_blocks,
                             block_size=config.kvcache_block_size,
                             eos_token_ids=eos_token_ids(model_path, tokenizer))
        engine = LLMEngine(config, tokenizer, executor, limits,
                           grammar_compiler=functools.partial(grammar_compiler, model_path,
                                                              executor.vocab_size))
    with phases.phase("gc_freeze"):
        freeze_startup_objects()  # start-up done: keep full GC passes off the steps
    engine.record_startup(phases.seconds, time.perf_counter() - start)
    return engine
