"""Host lists and arrays to device tensors without waiting for the device.

``torch.tensor(values, device="cuda")`` copies from pageable memory, which waits for everything
already queued on the stream — with overlapped steps, the step in flight. ``to_device`` stages
the values in pinned memory and copies them non-blocking instead (PyTorch keeps the pinned block
until the copy is done); on the CPU it is a plain tensor.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def to_device(values: Any, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``values``: a list (of lists) or a numpy array."""
    if isinstance(values, np.ndarray):
        host = torch.from_numpy(values).to(dtype)
    else:
        host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def copy_cache_blocks(caches: list[torch.Tensor], copies: list[tuple[int, int]],
                      device: torch.device) -> None:
    """Copy-on-write: each (src, dst) block of every cache tensor (as bytes for FP8: torch has
    no index_copy_ for float8)."""
    src = to_device([c[0] for c in copies], device)
    dst = to_device([c[1] for c in copies], device)
    for cache in caches:
        raw = cache.view(torch.uint8) if cache.element_size() == 1 else cache
        raw.index_copy_(0, dst, raw.index_select(0, src))
