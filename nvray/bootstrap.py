"""Assemble an LLMEngine from an EngineConfig: model path, tokenizer and EOS ids
(``tokenizer.py``), executor, limits.

The executor is the step protocol's ``Executor`` (``nvray/step_protocol.py``): the in-process
runner or the Ray rank group, made by ``make_executor``. Once the engine
exists, the objects of start-up are frozen out of the cyclic GC (``gc_freeze.py``), and the
engine is given its start-up seconds by phase (``startup_phases.py``).
"""

from __future__ import annotations

import concurrent.futures
import functools
import time
from typing import Any, Callable, TypeVar

from nvray.config import EngineConfig
from nvray.engine.engine import LLMEngine, ModelLimits
from nvray.gc_freeze import freeze_startup_objects
from nvray.grammar import grammar_compiler
from nvray.models.tiny import resolve_model
from nvray.startup_phases import StartupPhases
from nvray.step_protocol import Executor
from nvray.tokenizer import eos_token_ids, load_tokenizer

T = TypeVar("T")


def create_engine(config: EngineConfig,
                  make_executor: Callable[[EngineConfig, str], Executor],
                  phases: StartupPhases | None = None, start: float | None = None) -> LLMEngine:
    """``phases`` and ``start``: a start-up the caller began timing earlier (its imports).
    The tokenizer loads in a thread while the executor starts (its import of transformers
    alone takes seconds): beside rank processes on Ray, beside CUDA and file work in-process."""
    start = time.perf_counter() if start is None else start
    phases = phases or StartupPhases()
    with phases.phase("model_files"):
        model_path = resolve_model(config.model)
    with concurrent.futures.ThreadPoolExecutor(1, "nvray-tokenizer") as pool:
        loading = pool.submit(_timed, load_tokenizer, model_path)
        executor = _timed_executor(make_executor, config, model_path, phases)
        with phases.phase("tokenizer_wait"):  # what the executor's start did not hide
            tokenizer, phases.beside["tokenizer"] = loading.result()
    with phases.phase("engine"):
        limits = ModelLimits.of(executor.facts, num_kvcache_blocks=executor.num_blocks,
                                block_size=config.kvcache_block_size,
                                eos_token_ids=eos_token_ids(model_path, tokenizer))
        engine = LLMEngine(config, tokenizer, executor, limits,
                           grammar_compiler=functools.partial(grammar_compiler, model_path,
                                                              limits.vocab_size))
    with phases.phase("gc_freeze"):
        freeze_startup_objects()  # start-up done: keep full GC passes off the steps
    engine.counters.record_startup(phases.seconds, time.perf_counter() - start, phases.beside)
    return engine


def _timed(fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    start = time.perf_counter()
    return fn(*args), time.perf_counter() - start


def _timed_executor(make_executor: Callable[[EngineConfig, str], Executor], config: EngineConfig,
                    model_path: str, phases: StartupPhases) -> Executor:
    """The executor, its ranks' phases added to ``phases`` and the rest as executor_other."""
    executor, seconds = _timed(make_executor, config, model_path)
    phases.add_within(getattr(executor, "startup_phases", {}), seconds, "executor_other")
    return executor
