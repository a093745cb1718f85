"""Tensor-parallel group access: rank, size and the collectives the layers need.

The group is torch.distributed's default process group (NCCL on GPU, gloo on CPU), set up by
the runtime before the model is built, or the subgroup ``set_tp_group`` names (the ranks of one
tensor-parallel group among more: every collective here stays inside it); without one, rank 0
of a group of one is assumed.
``all_reduce`` sends a message that fits the P2P all-reduce (``p2p_allreduce.py``, set by
``use_p2p_all_reduce`` once the ranks made one) through it, every other through the group.
A row-parallel layer returns its rank's ``PartialSum`` instead of reducing it: the RMSNorm it
feeds finishes the sum (``finish``), fused with its own work where the P2P all-reduce can
(``fused_reducer``); a model's forward ends with ``end_forward()``.
``expert_parallel()``: MoE layers built now place whole experts on ranks (``set_expert_parallel``,
from ``EngineConfig.enable_expert_parallel``; the group's ranks are the experts' ranks).
Inside ``collectives_off()`` the collectives do nothing, for work whose values are thrown away
and that each rank does on its own (compiling kernels ahead, ``worker/compile_ahead.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, NamedTuple

import torch
import torch.distributed as dist

_collectives_on = True
_group: Any = None  # the tensor-parallel group; None: the default group (every rank)
_p2p: Any = None  # a P2pAllReduce, or None: every all-reduce goes to the group
_expert_parallel = False


@contextlib.contextmanager
def collectives_off() -> Iterator[None]:
    """Inside, ``all_reduce`` and ``broadcast_from_first`` leave each rank's values as they
    are and ``gather_last_dim`` gives rank 0 its own slice and uninitialised ones for the
    other ranks."""
    global _collectives_on
    before, _collectives_on = _collectives_on, False
    try:
        yield
    finally:
        _collectives_on = before


def collectives_on() -> bool:
    """False inside ``collectives_off()`` (pipeline sends and receives honour it too)."""
    return _collectives_on


def set_tp_group(group: Any) -> None:
    """The ranks' tensor-parallel group from now on (None: the default group)."""
    global _group
    _group = group


def tp_group() -> Any:
    """The tensor-parallel process group (the default group unless ``set_tp_group`` said)."""
    return _group if _group is not None else dist.group.WORLD


def tp_size() -> int:
    return dist.get_world_size(_group) if dist.is_initialized() else 1


def tp_rank() -> int:
    return dist.get_rank(_group) if dist.is_initialized() else 0


def set_expert_parallel(on: bool) -> None:
    global _expert_parallel
    _expert_parallel = on


def expert_parallel() -> bool:
    """Whether MoE layers place whole experts on the ranks (and there is more than one)."""
    return _expert_parallel and tp_size() > 1


def use_p2p_all_reduce(p2p: Any) -> None:
    """All-reduces that fit ``p2p`` go through it from now on (None: all through the group)."""
    global _p2p
    _p2p = p2p


class PartialSum(NamedTuple):
    """A rank's share of a sum over the ranks, still to be all-reduced by its consumer."""

    partial: torch.Tensor


def finish(x: torch.Tensor | PartialSum) -> torch.Tensor:
    """``x`` summed over the ranks (a plain tensor is already whole)."""
    return all_reduce(x.partial) if isinstance(x, PartialSum) else x


def fused_reducer(x: PartialSum) -> Any:
    """The P2P all-reduce that can fuse ``x``'s sum into the norm it feeds, or None."""
    if _p2p is not None and _collectives_on and tp_size() > 1 and _p2p.fits_fused(x.partial):
        return _p2p
    return None


def end_forward() -> None:
    """Call once a model's forward has queued its last layer."""
    if _p2p is not None and _collectives_on:
        _p2p.end_forward()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place."""
    if tp_size() > 1 and _collectives_on:
        if _p2p is not None and _p2p.fits(x):
            _p2p(x)
        else:
            dist.all_reduce(x, group=_group)
    return x


def broadcast_from_first(x: torch.Tensor) -> torch.Tensor:
    """Every rank gets rank 0's ``x`` (in place)."""
    if tp_size() > 1 and _collectives_on:
        dist.broadcast(x, group=_group, group_src=0)
    return x


def gather_last_dim(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate each rank's slice of the last dim on rank 0; other ranks get None."""
    if tp_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size())] if tp_rank() == 0 else None
    if _collectives_on:
        dist.gather(x.contiguous(), parts, group=_group, group_dst=0)
    elif parts is not None:
        parts[0] = x
    return torch.cat(parts, dim=-1) if parts is not None else None


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}")
    return numerator // denominator
