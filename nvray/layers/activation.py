"""SiluAndMul: the gated activation of Qwen's MLP on a fused [gate | up] tensor.

``enable_torch_compile()`` (called by the model runner on the GPU) makes it one fused
``torch.compile``d kernel; ``use_triton_kernels()`` (called after it where Triton is installed)
one hand-written kernel (``kernels/silu_mul.py``), cheaper to launch on eager steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nvray.layers.compiled import compiled


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2*I] -> [T, I]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self._fn = silu_and_mul

    def enable_torch_compile(self) -> None:
        self._fn = compiled(silu_and_mul)

    def use_triton_kernels(self) -> None:
        from kernels import silu_and_mul as kernel  # noqa: PLC0415 - GPU-only import

        self._fn = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fn(x)
