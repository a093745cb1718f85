"""Compiling a rank's Triton kernels side by side before its start-up runs them.

On a machine whose Triton cache is empty, a rank's start-up compiles every kernel
specialization its warm-up, memory profile and graph captures launch, one after another, each
as the first launch of it waits (~20 s of a Qwen3-0.6B start on an H100 host). Triton's
compiler releases the GIL for much of its work, so compiles run well side by side in threads.

``compile_ahead(probe, rest, threads)`` rehearses those launches: it runs the start-up's
forwards once, eagerly (the warm-up step as the probe; then the kernel warm-up's steps and every
decode, verification and prefill graph's forward, ``startup.rehearse_startup``), with Triton's
``jit_cache_hook`` set, so that a launch whose kernel is not yet in memory submits its compile to
a thread pool (``triton.AsyncCompileMode``) and returns without running; the pool also builds
each kernel's launcher (a C extension, built with the host's C compiler). Nothing of the
rehearsal is kept: the tensors it makes hold whatever memory held before (the skipped kernels
write nothing), its sampled ids are discarded, its random draws are undone (the generators'
states restored), and it runs with the tensor-parallel collectives off (``layers/tp.py``), so
each rank rehearses on its own. On leaving, it waits for the compiles; each compiled kernel
lands in its function's in-memory cache (and in Triton's cache on disk), so the real start-up
launches it at once. When the probe's compiles were all cache hits (Triton's cache directory
did not grow), the cache is taken as warm and the rest is not rehearsed: a warm start pays for
one rehearsed step. A cache that holds the warm-up step's kernels but not the others (a start
cut short, a change to the decode kernel only) so compiles the others one after another, as
without this module.

Contract: it changes no result (every launch after it runs normally, and a compile that failed
ahead is retried at its real launch, which then reports the error); on the CPU, without a
compiled Triton (``TRITON_INTERPRET``), where a ``jit_cache_hook`` is set already, or with
``NVRAY_COMPILE_AHEAD=0`` it does nothing.
``NVRAY_COMPILE_AHEAD=<n>`` sets the threads (default: min(8, usable cores)).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

from nvray.cache_dirs import switched_off
from nvray.layers.tp import collectives_off

logger = logging.getLogger(__name__)

_ENV = "NVRAY_COMPILE_AHEAD"
_MAX_THREADS = 8


def compile_threads() -> int:
    """Threads for the compiles: ``NVRAY_COMPILE_AHEAD`` (0/off/false/no: none; a number: that
    many), else min(8, usable cores)."""
    raw = os.environ.get(_ENV, "").strip().lower()
    if switched_off(raw):
        return 0
    if raw.isdigit():
        return int(raw)
    if raw not in ("", "true", "on", "yes"):  # (a number, "1" too, was read above)
        raise ValueError(f"{_ENV}={raw!r}: expected 0/off, on, or a number of threads")
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(_MAX_THREADS, cores))


def _compiled_triton() -> bool:
    """Triton is there, compiles (not its interpreter) and can compile in a pool."""
    try:
        import triton  # noqa: PLC0415
        from triton import knobs  # noqa: PLC0415
    except ImportError:
        return False
    return hasattr(triton, "AsyncCompileMode") and not knobs.runtime.interpret


class _CompileAndBuildLauncher(ThreadPoolExecutor):
    """A pool whose every task (one of Triton's compiles) also builds the compiled kernel's
    launcher: a C extension that Triton otherwise builds with the host's C compiler at the
    kernel's first launch, on the launching thread. Built here, it lands in Triton's cache, where
    that launch finds it."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        return super().submit(_with_launcher, fn, *args, **kwargs)


def _with_launcher(compile_kernel: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """One pool task: the compile, then its launcher (a failed build is left to the launch)."""
    kernel = compile_kernel(*args, **kwargs)
    try:
        from triton.runtime.driver import driver  # noqa: PLC0415

        driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception:  # noqa: BLE001 - the first launch builds it (and reports a failure)
        logger.debug("building a Triton launcher ahead failed", exc_info=True)
    return kernel


@contextlib.contextmanager
def launches_compile_ahead(threads: int) -> Iterator[set[tuple[int, str]]]:
    """Inside, a Triton launch from this thread whose kernel is not compiled yet submits the
    compile to a pool of ``threads`` and does not run (launches from other threads go on as
    usual); leaving waits for every compile. Yields the specializations submitted (kernel,
    cache key), filled in as it goes."""
    import triton  # noqa: PLC0415
    from triton import knobs  # noqa: PLC0415

    submitted: set[tuple[int, str]] = set()
    rehearsing = threading.get_ident()
    preloading = False

    def hook(*, fn: Any, compile: dict[str, Any], **_: Any) -> bool | None:
        nonlocal preloading
        if threading.get_ident() != rehearsing or preloading:
            return None  # not the rehearsal's launch, or preload's own compile (to the pool)
        key = (id(fn.jit_function), compile["key"])
        if key not in submitted:
            preloading = True
            try:
                fn.jit_function.preload(compile["specialization_data"])
            finally:
                preloading = False
            submitted.add(key)
        return True  # skip this launch

    previous = knobs.runtime.jit_cache_hook
    with _CompileAndBuildLauncher(threads, thread_name_prefix="nvray-compile") as pool:
        mode = triton.AsyncCompileMode(pool, ignore_errors=True)
        with mode:
            knobs.runtime.jit_cache_hook = hook
            try:
                yield submitted
            finally:
                knobs.runtime.jit_cache_hook = previous


def ahead_threads(device_type: str) -> int:
    """Threads to compile ahead with on ``device_type``; 0 where it does not apply (the CPU,
    no compiled Triton, a ``jit_cache_hook`` someone else set, or turned off)."""
    if device_type != "cuda" or not _compiled_triton():
        return 0
    from triton import knobs  # noqa: PLC0415

    return 0 if knobs.runtime.jit_cache_hook is not None else compile_threads()


def _cache_entries() -> int:
    """Entries in Triton's cache directory (each compile that is not a cache hit adds one, and
    so does each launcher built)."""
    from triton import knobs  # noqa: PLC0415

    try:
        return len(os.listdir(knobs.cache.dir))
    except OSError:
        return 0


def compile_ahead(probe: Callable[[], None], rest: Callable[[], None], threads: int) -> None:
    """Rehearse the start-up's launches with compiles going ahead on ``threads`` (see the
    module docstring): ``probe`` first; only if its compiles were not all cache hits (Triton's
    cache grew), ``rest``. A warm start so pays for one rehearsed step. Each rank decides on
    its own, so the rehearsal runs with the collectives off; the random draws it makes are
    undone (the CPU's and the current GPU's generators are restored). Logs what it did; a
    failing rehearsal is logged and the start goes on (its kernels then compile at first
    launch)."""
    import torch  # noqa: PLC0415

    start = time.perf_counter()
    gpus = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    try:
        with collectives_off(), torch.random.fork_rng(devices=gpus):
            before = _cache_entries()
            with launches_compile_ahead(threads) as probed:
                probe()
            if _cache_entries() == before:
                logger.info("Triton kernels cached: %d loaded ahead in %.2f s", len(probed),
                            time.perf_counter() - start)
                return
            with launches_compile_ahead(threads) as submitted:
                rest()
    except Exception:  # noqa: BLE001 - an optimisation: the start goes on without it
        logger.warning("compiling Triton kernels ahead failed; they compile as they are first "
                       "launched", exc_info=True)
        return
    logger.info("compiled %d Triton kernels ahead in %.1f s on %d threads",
                len(probed) + len(submitted), time.perf_counter() - start, threads)
