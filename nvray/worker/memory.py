"""GPU memory budget of the KV cache: what ``gpu_memory_utilization`` leaves after the rest.

The engine may bring the device's memory use up to ``total * gpu_memory_utilization``. Before
the KV cache exists, the runner measures what else it will need (nano-vllm's and vLLM's method):

- ``used``: memory in use now — CUDA context, weights, other processes, NCCL buffers;
- ``activations``: the peak of a warm-up step of ``max_num_batched_tokens`` tokens through the
  model, the LM head and the sampler (one row per sequence, up to ``max_num_seqs``), run on a
  one-block scratch cache (its allocator blocks are kept, not returned);
- ``cuda_graphs``: the decode graphs' pool and per-graph memory, estimated by capturing the
  largest and the smallest graph on the scratch cache (largest's pool + count x smallest's cost).

``kv = total * utilization - used - activations - cuda_graphs``. On the CPU the KV cache gets
``cpu_kvcache_space_gib`` instead.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

GIB = 2**30


@dataclass(frozen=True)
class GpuMemoryReport:
    total: int
    utilization: float
    used: int  # context, weights, other processes: everything in use before the warm-up
    allocated: int  # by torch in this process before the warm-up: the weights (+ small buffers)
    activations: int
    cuda_graphs: int

    @property
    def kv_budget(self) -> int:
        return int(self.total * self.utilization) - self.used - self.activations - self.cuda_graphs

    def describe(self) -> str:
        return (f"total {self.total / GIB:.2f} GiB x gpu_memory_utilization {self.utilization} = "
                f"{self.total * self.utilization / GIB:.2f} GiB; in use before the KV cache "
                f"{self.used / GIB:.2f} GiB (this process's tensors {self.allocated / GIB:.2f} GiB: "
                f"the weights; the rest: CUDA context, other processes); activation peak "
                f"{self.activations / GIB:.2f} GiB; CUDA graphs {self.cuda_graphs / GIB:.2f} GiB; "
                f"left for the KV cache {self.kv_budget / GIB:.2f} GiB")


def free_cached_memory() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def measure_used(device: torch.device) -> int:
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def graph_memory_estimate(capture_one, num_graphs: int, device: torch.device) -> int:
    """Memory of ``num_graphs`` graphs from capturing the largest, then the smallest.

    ``capture_one(which)`` captures the ``"largest"`` or ``"smallest"`` graph into one pool.
    (Entering a capture empties the allocator's cache, so the cache is emptied first here too.)
    """
    free_cached_memory()
    before = measure_used(device)
    capture_one("largest")
    after_largest = measure_used(device)
    capture_one("smallest")
    per_graph = max(measure_used(device) - after_largest, 0)
    return after_largest - before + (num_graphs - 1) * per_graph
