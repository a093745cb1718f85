"""GPU memory budget of the KV cache: what ``gpu_memory_utilization`` leaves after the rest.

``gpu_memory_utilization`` is the share of the device's memory that this engine may use (vLLM's
meaning): two engines at 0.45 each share one GPU. Memory that was in use when the rank started
(other processes, other engines, this process's CUDA context) is not the engine's and is not
counted against it. Before the KV cache exists, the runner measures what else it will need
(nano-vllm's and vLLM's method):

- ``used``: what the engine holds now, beyond what was in use when its rank started (the
  ``baseline``): weights, buffers, NCCL's;
- ``activations``: the peak of a warm-up step of ``max_num_batched_tokens`` tokens through the
  model, the LM head and the sampler (``EngineConfig.max_sampled_rows``: one row per sequence,
  up to ``max_num_seqs``, and with speculation draft rows too), run on a one-block scratch
  cache (its allocator blocks are kept, not returned);
- ``cuda_graphs``: the CUDA graphs' pool and per-graph memory, estimated by trial captures on
  the scratch cache: the largest verification graph (with speculation), the largest decode
  graph, the decode graph whose attention holds the most split scratch (a mid-size batch below
  the decode kernel's split threshold) where that is another, then the smallest (pool after the first ones + the smallest's cost for each other
  graph, the prefill and verification graphs included).

``kv = total * utilization - used - activations - cuda_graphs``, and never more than the device
has free less the activations and graphs (another process may hold more than the rest of the
device). On the CPU the KV cache gets ``cpu_kvcache_space_gib`` instead.
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
    baseline: int  # in use when the rank started: other processes, this process's CUDA context
    used: int  # this engine's, beyond the baseline, before the warm-up: weights, buffers
    allocated: int  # by torch in this process before the warm-up: the weights (+ small buffers)
    activations: int
    cuda_graphs: int
    free: int  # free on the device before the KV cache

    @property
    def kv_budget(self) -> int:
        share = int(self.total * self.utilization) - self.used - self.activations - self.cuda_graphs
        return min(share, self.free - self.activations - self.cuda_graphs)

    def describe(self) -> str:
        return (f"total {self.total / GIB:.2f} GiB x gpu_memory_utilization {self.utilization} = "
                f"{self.total * self.utilization / GIB:.2f} GiB for this engine; in use by it "
                f"before the KV cache {self.used / GIB:.2f} GiB (its tensors "
                f"{self.allocated / GIB:.2f} GiB: the weights); activation peak "
                f"{self.activations / GIB:.2f} GiB; CUDA graphs {self.cuda_graphs / GIB:.2f} GiB; "
                f"not the engine's (other processes, the CUDA context) {self.baseline / GIB:.2f} "
                f"GiB; free {self.free / GIB:.2f} GiB; left for the KV cache "
                f"{self.kv_budget / GIB:.2f} GiB")


def free_cached_memory() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def measure_used(device: torch.device) -> int:
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def graph_memory_estimate(capture_one, trial_sizes: list, num_graphs: int,
                          device: torch.device) -> int:
    """Memory of ``num_graphs`` graphs sharing one pool, from trial captures.

    ``capture_one(trial)`` captures the graph a trial names (startup.py: a ``GraphShapes`` of
    one graph) into the shared pool. All but the last of ``trial_sizes`` (the largest; the one with the most
    scratch) set the pool, which the
    others reuse; the last (the smallest) costs what each graph that does not set the pool
    adds, itself included.
    (Entering a capture empties the allocator's cache, so the cache is emptied first here too.)
    """
    free_cached_memory()
    before = measure_used(device)
    for size in trial_sizes[:-1]:
        capture_one(size)
    pool = measure_used(device) - before
    capture_one(trial_sizes[-1])
    per_graph = max(measure_used(device) - before - pool, 0)
    return pool + (num_graphs - len(trial_sizes) + 1) * per_graph
