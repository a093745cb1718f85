"""GPU tier fixtures: a Qwen3-0.6B-shaped random bf16 checkpoint (real vocabulary of 151936)
and a local Ray cluster that owns the GPU. The bf16 oracle lives in ``gpu_oracle.py``."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="session")
def qwen3_06b_path(tmp_path_factory) -> str:
    from nvray.bench.checkpoints import random_qwen3_checkpoint

    return random_qwen3_checkpoint(str(tmp_path_factory.mktemp("qwen3-0.6b")), "0.6b")


@pytest.fixture(scope="session")
def gpu_ray():
    """A local Ray cluster that owns the GPU (rank actors get it through their bundles)."""
    import ray

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if not ray.is_initialized():
        ray.init(num_cpus=8, num_gpus=torch.cuda.device_count(), include_dashboard=False,
                 log_to_driver=False, runtime_env={"env_vars": {
                     "NVRAY_CACHE_DIR": os.environ.get("NVRAY_CACHE_DIR", ""),
                     "TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()
