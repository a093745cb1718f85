"""P2pAllReduce: the tensor-parallel all-reduce of decode-sized messages over memory the ranks
share, NCCL beyond.

A decode step makes two all-reduces a layer of a few hundred rows; NCCL's latency there is a
large share of a TP step (issue 49's probe, 2x H100 over NVLink: 32.7 us for 256 x 4096 bf16
against 14.1 us for torch symmetric memory's two-shot all-reduce). Each rank allocates one
buffer of ``max_bytes`` in torch's symmetric memory (``torch.distributed._symmetric_memory``:
CUDA IPC handles exchanged once, every rank's buffer mapped into every other's address space);
an all-reduce copies the message into the buffer, runs ``two_shot`` (reduce-scatter then
all-gather through the peers' buffers: each rank reads 1/n of each) and copies the sum back;
``one_shot`` (each rank reads every peer's whole buffer) is there for the bench. Both are
captured in CUDA graphs. Messages under ``MIN_BYTES`` or over ``max_bytes``, of another dtype,
or not contiguous go to NCCL. Measured on 2x H100 (NVLink, one process a GPU, CUDA-graph
replays, staging copies included; ``python -m nvray.bench allreduce``), rows x 4096 bf16, NCCL /
one-shot / two-shot in us: 1 row 11.0 / 13.5 / 13.4; 32: 14.1 / 13.8 / 13.5; 256 (a decode
batch): 33.5 / 25.2 / 21.1; 1,024: 53.9 / 62.2 / 45.9; 2,048: 83.5 / 111.5 / 80.6; 8,192:
256.8 / 422.2 / 314.6. On 4x H100 (all pairs NV18): 32 rows 16.7 / 17.2 / 14.5; 256: 31.3 /
33.8 / 26.1; 512: 45.7 / 54.9 / 37.1; 2,048: 101.8 / 180.9 / 114.0. Hence two-shot from 256 KiB
to 16 MiB over two ranks, to 8 MiB over four (``max_bytes`` halved per doubling past two), NCCL
outside.

The all-reduce before an RMSNorm with a residual (every row-parallel layer's output in the
shared decoder: ``tp.PartialSum``) is fused into the norm instead (``reduce_add_norm``): the
rank copies its partial sum into one of two regions of the buffer (alternating: the barrier of
a call proves every peer is done reading the region before last, so one barrier a call is
enough), passes a barrier (every rank's partial written), and one kernel
(``kernels.sum_rms_norm``) reads all ranks' partials where they lie, sums them, adds the
residual and norms (quantizing for an FP8 layer where the norm does): one copy, one barrier and
one kernel instead of the all-reduce's two copies and two-shot kernel and the norm's kernel.
Each rank reads every partial, so the fused path pays while the bytes read from peers are few:
up to ``FUSED_PEER_BYTES / (world - 1)`` a message (measured, 4,096-wide bf16 rows, fused /
all-reduce then norm, in us: 2x H100 256 rows 16.0 / 32.9, 512 rows 21.9 / 36.9; 4x H100 32 rows
13.8 / 15.3, 256 rows 34.4 / 31.5: 3 MiB of peers' rows is about where the two meet); a forward
that makes an odd number of such calls ends with a barrier (``end_forward``), so the next one
starts on the first region again, as CUDA graphs captured that way expect.

It never uses NVLink multicast (``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` is set before the
buffer is made, unless the environment says otherwise): multicast objects can put a host's
GPUs out of service (the GPU machines forbid them), and the two kernels here do not need them.

``create_p2p_all_reduce(dtype, device, max_bytes)`` is collective: every rank calls it; it
returns None on every rank (NCCL stays) when a rank sees fewer GPUs than there are ranks
(symmetric memory tells peers apart by device index: the engine's Ray ranks see all their
node's engine GPUs, ``runtime/rank_worker.py``), when the ranks are on more than one host, or
when symmetric memory cannot be set up on one of them (the reason logged).
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from nvray.layers.tp import tp_group, tp_size, use_p2p_all_reduce

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 16 << 20  # 2,048 rows of 4,096 bf16: beyond, NCCL's bandwidth wins
MIN_BYTES = 256 << 10  # 32 rows of 4,096 bf16: below, the staging copies cost what P2P saves
FUSED_MAX_BYTES = 4 << 20  # 512 rows of 4,096 bf16, per region (two regions)
FUSED_PEER_BYTES = 3 << 20  # fused while a rank reads at most this much of its peers' rows
_ALIGN_BYTES = 16  # each rank's share of a two-shot message starts 16-byte aligned


class P2pAllReduce:
    def __init__(self, memory: torch.Tensor, handle: Any, group_name: str, max_bytes: int,
                 min_bytes: int = MIN_BYTES, fused_bytes: int = FUSED_MAX_BYTES) -> None:
        """``memory``: the rendezvoused symmetric tensor (``handle``): ``max_bytes`` for
        two-shot, then the two regions of ``fused_bytes`` for ``reduce_add_norm``."""
        size = memory.element_size()
        self.buffer = memory[:max_bytes // size]
        fused = fused_bytes // size
        self.regions = [memory[len(self.buffer) + i * fused:][:fused] for i in range(2)]
        self.handle = handle
        self.group_name = group_name
        self.world_size = world_size = handle.world_size
        self.min_bytes = min_bytes
        self.align = world_size * _ALIGN_BYTES // size
        own = handle.buffer_ptrs[handle.rank]
        self.peer_ptrs = [torch.tensor([base + region.data_ptr() - own for base in handle.buffer_ptrs],
                                       dtype=torch.int64, device=memory.device)
                          for region in self.regions]  # per region: every rank's, rank order
        self.fused_calls = 0  # in this forward
        self.fused_limit = min(fused_bytes, FUSED_PEER_BYTES // max(world_size - 1, 1)) // size
        self.two_shot_limit = self.buffer.numel() * 2 // max(world_size, 2)

    def fits_fused(self, x: torch.Tensor, any_size: bool = False) -> bool:
        """Whether ``x``'s all-reduce is fused into the norm it feeds (``reduce_add_norm``;
        ``any_size``: whatever its size up to a region's, for the bench)."""
        limit = self.regions[0].numel() if any_size else self.fused_limit
        return (x.dtype == self.buffer.dtype and x.is_contiguous() and x.dim() == 2
                and x.numel() <= limit)

    def reduce_add_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float, group: int | None | bool = False) -> tuple[Any, torch.Tensor]:
        """``kernels.sum_rms_norm`` of every rank's ``x`` (``fits_fused(x)`` must hold):
        (the norm of the sum plus ``residual``, that new residual)."""
        import kernels  # noqa: PLC0415 - GPU-only import

        phase = self.fused_calls % 2
        self.fused_calls += 1
        self.regions[phase][:x.numel()].copy_(x.view(-1))
        self.handle.barrier(channel=0)
        return kernels.sum_rms_norm(self.peer_ptrs[phase], residual, weight, eps, group)

    def end_forward(self) -> None:
        """After a forward's last ``reduce_add_norm``: the next forward starts on region 0, so
        after an odd count every rank must be done reading region 0 first."""
        if self.fused_calls % 2:
            self.handle.barrier(channel=0)
        self.fused_calls = 0

    def fits(self, x: torch.Tensor, any_size: bool = False) -> bool:
        """Whether ``x`` goes through here (``any_size``: whatever its size up to the
        buffer's, for the bench)."""
        padded = -(-x.numel() // self.align) * self.align
        limit = self.buffer.numel() if any_size else self.two_shot_limit
        return (x.dtype == self.buffer.dtype and x.is_contiguous() and padded <= limit
                and (any_size or x.numel() * x.element_size() >= self.min_bytes))

    def describe(self) -> str:
        size = self.buffer.element_size()
        return (f"p2p: fused into the next norm up to {self.fused_limit * size >> 10} KiB, "
                f"two-shot {self.min_bytes >> 10} KiB-{self.two_shot_limit * size >> 20} MiB, "
                "nccl beyond")

    def path_for(self, x: torch.Tensor) -> str:
        """How the engine sums ``x`` before a norm with a residual: fused, two_shot or nccl."""
        return "fused" if self.fits_fused(x) else "two_shot" if self.fits(x) else "nccl"

    def __call__(self, x: torch.Tensor, method: str = "two_shot") -> torch.Tensor:
        """Sum ``x`` over the ranks in place (``fits(x)`` must hold); two-shot (measured,
        module docstring), or ``one_shot`` for the bench."""
        n = x.numel()
        flat = x.view(-1)
        if method == "one_shot":
            staged = self.buffer[:n]
            staged.copy_(flat)
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, flat)
            return x
        padded = -(-n // self.align) * self.align  # the tail past n: stale values, never read
        staged = self.buffer[:padded]
        staged[:n].copy_(flat)
        torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group_name)
        flat.copy_(staged[:n])
        return x


def create_p2p_all_reduce(dtype: torch.dtype, device: torch.device,
                          max_bytes: int = DEFAULT_MAX_BYTES) -> P2pAllReduce | None:
    """Collective over the tensor-parallel group (``tp.tp_group()``): its P2P all-reduce, or
    None (NCCL) on every rank."""
    group = tp_group()
    world = dist.get_world_size(group)
    if torch.cuda.device_count() < world:  # e.g. ranks on several hosts, or one GPU each
        logger.info("all-reduce: NCCL (each rank sees %d GPU(s); the P2P buffers need the "
                    "peers' GPUs visible)", torch.cuda.device_count())
        return None
    hosts: list[str | None] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if len(set(hosts)) > 1:
        logger.info("all-reduce: NCCL (the ranks span %d hosts)", len(set(hosts)))
        return None
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    buffer, reason = None, ""
    try:
        from torch.distributed import _symmetric_memory as symm_mem  # noqa: PLC0415

        buffer = symm_mem.empty((max_bytes + 2 * FUSED_MAX_BYTES) // dtype.itemsize, dtype=dtype,
                                device=device)
    except Exception as e:  # noqa: BLE001 - any failure: NCCL stays
        reason = f"{type(e).__name__}: {e}"
    ok = torch.tensor([buffer is not None], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if not ok.item():
        logger.warning("all-reduce: NCCL (symmetric memory unavailable on a rank%s)",
                       f": {reason}" if reason else "")
        return None
    group_name = group.group_name
    try:  # it fails on every rank alike (it checks what all of them exchanged)
        handle = symm_mem.rendezvous(buffer, group_name)
    except RuntimeError as e:  # e.g. two ranks on one GPU
        logger.warning("all-reduce: NCCL (symmetric memory rendezvous failed: %s)", e)
        return None
    logger.info("all-reduce: P2P two-shot over symmetric memory from %d KiB to %d MiB, NCCL "
                "outside", MIN_BYTES >> 10, max_bytes >> 20)
    return P2pAllReduce(buffer, handle, group_name, max_bytes)


def set_up_all_reduce(mode: str, dtype: torch.dtype, device: torch.device) -> str:
    """Collective: decode-sized all-reduces over P2P shared memory where the ranks can
    (``all_reduce="auto"``, CUDA, TP > 1, one host), NCCL for the rest; what is in use
    (``"none"`` with TP 1, ``"gloo"`` on the CPU)."""
    use_p2p_all_reduce(None)
    if tp_size() == 1:
        return "none"
    if device.type != "cuda":
        return "gloo"
    if mode != "auto":
        return "nccl"
    p2p = create_p2p_all_reduce(dtype, device)
    use_p2p_all_reduce(p2p)
    return p2p.describe() if p2p is not None else "nccl"
