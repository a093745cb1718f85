"""An ``LLM`` whose engine runs in the calling process, for benches that reach into it.

``engine_here(model, tensor_parallel_size=n, ...)``: at n = 1 the in-process runtime; at n > 1
the engine (scheduler, block manager, speculator) in this process, driving n rank actors on Ray
through the same ``RayExecutor`` the driver actor uses (as ``bench ray-overhead`` does). So a
bench can swap the engine's drafter and reach every rank's model (``on_ranks``) whatever the
tensor-parallel size; its steps cross the same Ray channels as a served engine's.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

from nvray.llm import LLM


def engine_here(model: str, tensor_parallel_size: int = 1, **options: Any) -> LLM:
    if tensor_parallel_size == 1:
        return LLM(model, runtime="inprocess", **options)
    return _RanksLLM(model, tensor_parallel_size=tensor_parallel_size, **options)


class _RanksLLM(LLM):
    """``LLM``'s in-process path (``self.engine``) over rank actors in a placement group."""

    def __init__(self, model: str, **options: Any) -> None:  # noqa: D107 - see the class
        from nvray.bootstrap import create_engine  # noqa: PLC0415 - Ray only when asked
        from nvray.config import EngineConfig  # noqa: PLC0415
        from nvray.runtime.cluster import ensure_ray, resolve_device  # noqa: PLC0415
        from nvray.runtime.placement import create_engine_placement_group  # noqa: PLC0415
        from nvray.runtime.ray_executor import RayExecutor, start_rank_actors  # noqa: PLC0415

        ensure_ray()
        self.config = resolve_device(EngineConfig.from_kwargs(model, runtime="ray", **options))
        self.client, self._ids = None, itertools.count()
        self.pg = create_engine_placement_group(self.config, self.config.device == "cuda")
        def ranks(cfg: EngineConfig, path: str) -> RayExecutor:
            return RayExecutor(cfg, path, start_rank_actors(cfg, self.pg))

        try:
            self.engine = create_engine(self.config, ranks)
        except BaseException:
            self._remove_placement_group()
            raise

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self._remove_placement_group()

    def _remove_placement_group(self) -> None:
        from ray.util.placement_group import remove_placement_group  # noqa: PLC0415

        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None


def on_ranks(llm: LLM, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """``fn(runner, *args)`` on every rank's ``ModelRunner`` (``llm`` from ``engine_here``), with
    nothing in flight; what each returns, by rank. ``fn`` must pickle (a module's function)."""
    assert llm.engine is not None, "on_ranks needs an engine in this process (engine_here)"
    executor = llm.engine.executor
    workers = getattr(executor, "workers", None)
    if workers is None:
        return [fn(executor.runner, *args)]  # type: ignore[attr-defined] - the in-process one
    import ray  # noqa: PLC0415

    return ray.get([w.__ray_call__.remote(_on_own_runner, fn, *args) for w in workers])


def _on_own_runner(worker: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """On a rank actor: its GPU current in this thread (the call may come on another thread
    than the steps'), then ``fn`` on its runner."""
    if worker.gpu_index is not None:
        import torch  # noqa: PLC0415

        torch.cuda.set_device(worker.gpu_index)
    return fn(worker.runner, *args)
