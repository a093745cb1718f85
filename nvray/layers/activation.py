"""SiluAndMul: the gated activation of Qwen's MLP on a fused [gate | up] tensor.

``enable_torch_compile()`` (called by the model runner on the GPU) makes it one fused
``torch.compile``d kernel; ``use_triton_kernels()`` (called after it where Triton is installed)
one hand-written kernel (``kernels/silu_mul.py``), cheaper to launch on eager steps; built with
``quantize_for`` (the FP8 layer it feeds), that kernel also quantizes its output for it
(``silu_and_mul_fp8``, an ``Fp8Activation``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nvray.layers.compiled import compiled
from nvray.quantization import Fp8LinearMethod, fused_input_group


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2*I] -> [T, I]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def __init__(self, quantize_for: Fp8LinearMethod | None = None) -> None:
        super().__init__()
        self.quantize_for = quantize_for
        self._fn = silu_and_mul

    def enable_torch_compile(self) -> None:
        self._fn = compiled(silu_and_mul)

    def use_triton_kernels(self) -> None:
        import kernels  # noqa: PLC0415 - GPU-only import

        fused, group = fused_input_group(self.quantize_for)
        self._fn = (lambda x: kernels.silu_and_mul_fp8(x, group)) if fused else kernels.silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fn(x)
