"""RankWorker: the Ray actor of one tensor-parallel rank.

It joins the engine's torch.distributed group (NCCL on GPU, gloo on CPU) at rank 0's node IP
and a free port rank 0 picked, builds its ModelRunner (model shard + paged KV cache) and runs
steps. Inside the actor the rank's GPU, if any, is ``cuda:0``. A step that raises on one rank
makes it leave a gloo process group, so the others fail at once instead of waiting in a
collective (with NCCL they wait out the group's 120 s timeout).

This module imports torch and the model code only in the actor (its constructor), so the
processes that merely start ranks (``LLM()``, a Serve replica, the driver) never load them.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from typing import TYPE_CHECKING, Any, Iterator

import ray

from nvray.cache_dirs import keep_bytecode
from nvray.config import EngineConfig
from nvray.step_protocol import StepInput, StepOutput
from nvray.gc_freeze import freeze_startup_objects, release_frozen_objects

if TYPE_CHECKING:
    from nvray.worker.model_runner import ModelRunner

_DIST_TIMEOUT = datetime.timedelta(seconds=120)


class RankWorker:
    def __init__(self, config: EngineConfig, rank: int) -> None:
        keep_bytecode("torch")  # where the node keeps no bytecode (cache_dirs.py)
        import torch  # noqa: PLC0415 - see the module's docstring

        self.config = config
        self.rank = rank
        self.runner: ModelRunner | None = None
        if config.device != "cuda":
            torch.set_num_threads(max(1, int(config.num_cpus_per_rank)))

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0's node IP and a port that was free a moment ago."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init_distributed(self, host: str, port: int) -> None:
        world = self.config.tensor_parallel_size
        if world == 1:
            return
        import torch  # noqa: PLC0415 - see the module's docstring
        import torch.distributed as dist  # noqa: PLC0415

        backend = "nccl" if self.config.device == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(0)  # the actor sees one GPU
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank,
                                world_size=world, timeout=_DIST_TIMEOUT)

    def load(self, model_path: str) -> int:
        """Build the model shard; returns how many KV blocks fit on this rank."""
        from nvray.worker.model_runner import ModelRunner  # noqa: PLC0415 - see the docstring
        from nvray.worker.startup import num_kvcache_blocks  # noqa: PLC0415

        self.runner = ModelRunner(self.config, model_path)
        return num_kvcache_blocks(self.runner)

    def model_facts(self) -> dict[str, Any]:
        assert self.runner is not None, "load() first"
        return {"max_model_len": self.runner.max_model_len,
                "vocab_size": self.runner.hf_config.vocab_size, "dtypes": self.runner.dtypes(),
                "kv_group_windows": self.runner.kv_layout.group_windows}

    def startup_phases(self) -> dict[str, float]:
        """This rank's start-up seconds by phase (startup_phases.py)."""
        assert self.runner is not None, "load() first"
        return dict(self.runner.startup.seconds)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        from nvray.worker.startup import prepare_kv_cache  # noqa: PLC0415 - see the docstring

        assert self.runner is not None, "load() first"
        prepare_kv_cache(self.runner, num_blocks)
        freeze_startup_objects()  # the rank's start-up is done (cache and CUDA graphs exist)

    def execute(self, step: StepInput) -> StepOutput:
        assert self.runner is not None, "load() first"
        with self._failing_fast():
            return self.runner.execute(step)

    def execute_overlapped(self, step: StepInput | None) -> StepOutput | None:
        assert self.runner is not None, "load() first"
        with self._failing_fast():
            return self.runner.execute_overlapped(step)

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

    def ping(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        if self.runner is not None:
            release_frozen_objects()  # first: start-up froze the model's reference cycles
            self.runner.close()
            self.runner = None
        import torch.distributed as dist  # noqa: PLC0415 - see the module's docstring

        if dist.is_initialized():
            dist.destroy_process_group()
