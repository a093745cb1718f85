"""DraftIds: the ids a rank's drafter proposed for the step running, on the device and the host.

``start(drafts)`` starts the copy of the drafter's ids [D] (on the device they fill the step's
draft placeholders) to pinned host memory, queued before the target's forward so that reading
them waits for the drafter's forwards only; ``host()`` waits for that copy once and returns
the ids as a list (the penalties and grammar masks of draft rows and the step's answer read
it); ``clear()`` forgets them once the step is answered. On the CPU the copy is a clone.
"""

from __future__ import annotations

from typing import Any

import torch


class DraftIds:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host: tuple[torch.Tensor, Any] | list[int] | None = None  # (copy, its event)

    def start(self, drafts: torch.Tensor | None) -> None:
        self._host = self._copy_to_host(drafts) if drafts is not None else None

    def _copy_to_host(self, drafts: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if self.device.type != "cuda":
            return drafts.clone(), None
        host = torch.empty(drafts.shape, dtype=drafts.dtype, pin_memory=True)
        host.copy_(drafts, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done

    def host(self) -> list[int] | None:
        """The step's drafter ids (None: the step has none)."""
        if self._host is None or isinstance(self._host, list):
            return self._host
        host, done = self._host
        if done is not None:
            done.synchronize()
        self._host = host.tolist()
        return self._host

    def clear(self) -> None:
        self._host = None
