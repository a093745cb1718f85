"""RankWorker: the Ray actor of one tensor-parallel rank.

It joins the engine's torch.distributed group (NCCL on GPU, gloo on CPU) at rank 0's node IP
and a free port rank 0 picked, builds its ModelRunner (model shard + paged KV cache) and runs
steps. Ray gives a GPU rank actor its own GPU only (``CUDA_VISIBLE_DEVICES``); before CUDA
starts, ``init_distributed`` widens that to the GPUs of all the engine's ranks on its node, so
the ranks of a node can map each other's memory (the P2P all-reduce,
``layers/p2p_allreduce.py``). CUDA's current device belongs to a thread and Ray runs an
actor's calls on several threads, so every call that works on the GPU selects the rank's own
first (``@on_own_gpu``). A step that raises on one rank makes it leave a gloo process group,
so the others fail at once instead of waiting in a collective (with NCCL they wait out the
group's 120 s timeout).

This module imports torch and the model code only in the actor (its constructor), so the
processes that merely start ranks (``LLM()``, a Serve replica, the driver) never load them.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import functools
import socket
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar

import ray

from nvray.cache_dirs import keep_bytecode
from nvray.config import EngineConfig
from nvray.model_facts import ModelFacts
from nvray.step_protocol import StepInput, StepOutput
from nvray.gc_freeze import freeze_startup_objects, release_frozen_objects

if TYPE_CHECKING:
    from nvray.worker.model_runner import ModelRunner

_DIST_TIMEOUT = datetime.timedelta(seconds=120)
F = TypeVar("F", bound=Callable[..., Any])


def on_own_gpu(method: F) -> F:
    """Run ``method`` with the rank's GPU as the calling thread's current CUDA device."""
    @functools.wraps(method)
    def wrapper(self: RankWorker, *args: Any, **kwargs: Any) -> Any:
        if self.gpu_index is not None:
            import torch  # noqa: PLC0415 - see the module's docstring

            torch.cuda.set_device(self.gpu_index)
        return method(self, *args, **kwargs)
    return wrapper  # type: ignore[return-value]


class RankWorker:
    def __init__(self, config: EngineConfig, rank: int) -> None:
        keep_bytecode("torch")  # where the node keeps no bytecode (cache_dirs.py)
        import torch  # noqa: PLC0415 - see the module's docstring

        self.config = config
        self.rank = rank
        self.runner: ModelRunner | None = None
        self.gpu_index: int | None = None  # among the GPUs visible here, once chosen
        if config.device != "cuda":
            torch.set_num_threads(max(1, int(config.num_cpus_per_rank)))

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0's node IP and a port that was free a moment ago."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def gpu_placement(self) -> tuple[str, list[str]]:
        """This rank's node and the ids of the GPUs Ray gave it (none on CPU)."""
        ids = [str(i) for i in ray.get_gpu_ids()] if self.config.device == "cuda" else []
        return ray.get_runtime_context().get_node_id(), ids

    def init_distributed(self, host: str, port: int, node_gpus: list[str] | None = None) -> None:
        """Join the ranks' group; ``node_gpus``: the GPU ids of all the engine's ranks on this
        node (``node_gpu_lists``), made visible here before CUDA starts. With pipeline stages,
        each stage's ranks form the tensor-parallel group (``tp.set_tp_group``) and the rank
        learns its stage (``pp.set_pipeline``)."""
        world = self.config.world_size
        if world == 1:
            return
        import torch  # noqa: PLC0415 - see the module's docstring
        import torch.distributed as dist  # noqa: PLC0415

        backend = "nccl" if self.config.device == "cuda" else "gloo"
        if backend == "nccl":
            self.gpu_index = _select_own_gpu(node_gpus)
            torch.cuda.set_device(self.gpu_index)
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank,
                                world_size=world, timeout=_DIST_TIMEOUT)
        if self.config.pipeline_parallel_size > 1:
            self._join_stage(dist)

    def _join_stage(self, dist: Any) -> None:  # noqa: ANN401 - torch.distributed, imported late
        from nvray.layers.pp import set_pipeline  # noqa: PLC0415 - see the module's docstring
        from nvray.layers.tp import set_tp_group  # noqa: PLC0415

        tp, stages = self.config.tensor_parallel_size, self.config.pipeline_parallel_size
        # every rank makes every stage's group, in the same order (torch.distributed's rule)
        groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(stages)]
        stage = self.rank // tp
        set_tp_group(groups[stage])
        set_pipeline(stage, stages, tp)

    @on_own_gpu
    def load(self, model_path: str) -> int:
        """Build the model shard; returns how many KV blocks fit on this rank."""
        from nvray.worker.model_runner import ModelRunner  # noqa: PLC0415 - see the docstring
        from nvray.worker.startup import num_kvcache_blocks  # noqa: PLC0415

        self.runner = ModelRunner(self.config, model_path)
        return num_kvcache_blocks(self.runner)

    def model_facts(self) -> ModelFacts:
        assert self.runner is not None, "load() first"
        from nvray.worker.rank_facts import rank_facts  # noqa: PLC0415 - see the docstring

        return rank_facts(self.runner)

    def startup_phases(self) -> dict[str, float]:
        """This rank's start-up seconds by phase (startup_phases.py)."""
        assert self.runner is not None, "load() first"
        return dict(self.runner.startup.seconds)

    @on_own_gpu
    def allocate_kv_cache(self, num_blocks: int) -> None:
        from nvray.worker.startup import prepare_kv_cache  # noqa: PLC0415 - see the docstring

        assert self.runner is not None, "load() first"
        prepare_kv_cache(self.runner, num_blocks)
        freeze_startup_objects()  # the rank's start-up is done (cache and CUDA graphs exist)

    @on_own_gpu
    def execute(self, step: StepInput) -> StepOutput:
        assert self.runner is not None, "load() first"
        with self._failing_fast():
            return self.runner.steps.execute(step)

    @on_own_gpu
    def execute_overlapped(self, step: StepInput | None) -> StepOutput | None:
        assert self.runner is not None, "load() first"
        with self._failing_fast():
            return self.runner.steps.execute_overlapped(step)

    @contextlib.contextmanager
    def _failing_fast(self) -> Iterator[None]:
        """A step that raises here leaves the other ranks inside a collective, waiting for
        this one. With gloo, leaving the process group closes its connections, so theirs fail
        now rather than after the group's timeout; NCCL is left alone (destroying a group with
        work in flight can block), and its peers wait out the timeout. The engine is dead
        either way."""
        import torch.distributed as dist  # noqa: PLC0415 - see the module's docstring

        try:
            yield
        except BaseException:
            if dist.is_initialized() and dist.get_backend() == "gloo":
                dist.destroy_process_group()
            raise

    @on_own_gpu
    def expert_load(self) -> list[int]:
        """Pairs this rank's experts computed (``layers/moe.expert_load``)."""
        assert self.runner is not None, "load() first"
        from nvray.layers.moe import expert_load  # noqa: PLC0415 - see the docstring

        return expert_load(self.runner.model)

    def ping(self) -> int:
        return os.getpid()

    @on_own_gpu
    def shutdown(self) -> None:
        if self.runner is not None:
            release_frozen_objects()  # first: start-up froze the model's reference cycles
            self.runner.close()
            self.runner = None
        import torch.distributed as dist  # noqa: PLC0415 - see the module's docstring

        if dist.is_initialized():
            dist.destroy_process_group()


def node_gpu_lists(placements: list[tuple[str, list[str]]]) -> list[list[str] | None]:
    """For each rank (``gpu_placement`` answers, in rank order): the GPU ids of every rank on
    its node, in rank order (None for a rank without GPUs)."""
    by_node: dict[str, list[str]] = {}
    for node, ids in placements:
        listed = by_node.setdefault(node, [])
        listed.extend(i for i in ids if i not in listed)
    return [by_node[node] if ids else None for node, ids in placements]


def _select_own_gpu(node_gpus: list[str] | None) -> int:
    """Make ``node_gpus`` visible (CUDA not started yet) and return this rank's index among
    them; without a list, the one GPU Ray left visible."""
    own = [str(i) for i in ray.get_gpu_ids()]
    if not node_gpus or not own or own[0] not in node_gpus:
        return 0
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpus)
    return node_gpus.index(own[0])
