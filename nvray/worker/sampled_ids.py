"""Sampled token ids on their way from the device to the host, without blocking the launch.

``HostIds.copy_from(ids)`` queues the copy of a step's sampled ids (a device int32 tensor) into
one of two pinned host buffers and returns a ``SampledIds``; its ``result()`` waits for that
copy only (an event), so the caller can launch the next step first. Two buffers suffice: at
most two steps are in flight, and the older one's ids are read before a third is launched.
On the CPU the ids are simply read. A step that reports log-probabilities carries them too
(``logprobs.py``); ``result()`` gives the rank's ``StepOutput``.
"""

from __future__ import annotations

import torch

from nvray.step_protocol import StepOutput
from nvray.worker.logprobs import HostLogprobs


class SampledIds:
    def __init__(self, host: torch.Tensor | None, event: torch.cuda.Event | None,
                 logprobs: HostLogprobs | None = None, ks: list[int] | None = None,
                 pooled: torch.Tensor | None = None, widths: list[int] | None = None) -> None:
        self.host, self.event = host, event
        self.logprobs, self.ks = logprobs, ks
        self.pooled, self.widths = pooled, widths  # pooled rows, flattened; each row's width

    @classmethod
    def none(cls) -> "SampledIds":
        """What a rank other than 0 returns: it samples nothing of its own."""
        return cls(None, None)

    def result(self) -> StepOutput:
        if self.host is None:
            return StepOutput([])
        if self.event is not None:
            self.event.synchronize()
        ids = self.host.tolist()
        logprobs = None if self.logprobs is None else self.logprobs.result(self.ks)  # type: ignore[arg-type]
        if self.pooled is None:
            return StepOutput(ids, logprobs)
        flat, rows, start = self.pooled.tolist(), [], 0
        for width in self.widths or ():
            rows.append(flat[start:start + width])
            start += width
        return StepOutput(ids, logprobs, rows)


class HostIds:
    def __init__(self, capacity: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.buffers = [self._new(capacity) for _ in range(2)] if self.cuda else []
        self.turn = 0

    @staticmethod
    def _new(capacity: int) -> torch.Tensor:
        with torch.inference_mode(False):
            return torch.empty(max(capacity, 1), dtype=torch.int32, pin_memory=True)

    def copy_from(self, ids: torch.Tensor, logprobs: HostLogprobs | None = None,
                  ks: list[int] | None = None, pooled: torch.Tensor | None = None,
                  widths: list[int] | None = None) -> SampledIds:
        """``pooled``: the step's pooled rows (flattened float32), copied with the ids."""
        if not self.cuda:
            return SampledIds(ids, None, logprobs, ks, pooled, widths)
        if pooled is not None:  # rare (pooling steps): a pinned buffer of their own
            with torch.inference_mode(False):
                host_pooled = torch.empty(pooled.shape, dtype=pooled.dtype, pin_memory=True)
            host_pooled.copy_(pooled, non_blocking=True)
            pooled = host_pooled
        self.turn ^= 1
        n = ids.numel()
        if n > self.buffers[self.turn].numel():  # rare: more rows than max_num_seqs (warm-up)
            self.buffers[self.turn] = self._new(n)
        host = self.buffers[self.turn][:n]
        host.copy_(ids, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return SampledIds(host, event, logprobs, ks, pooled, widths)
