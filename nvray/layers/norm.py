"""RMSNorm, optionally fused with the residual add (computed in fp32, returned in x's dtype).

On the GPU the model runner calls ``enable_torch_compile()``: the norm then runs through
``torch.compile``d functions (one fused kernel instead of ~7), shared by every RMSNorm; then,
where Triton is installed, ``use_triton_kernels()``: one hand-written kernel
(``kernels/rms_norm.py``), as fast on the GPU and ~0.1 ms cheaper per call to launch on eager
steps. A norm built with ``quantize_for`` (the FP8 layer its output feeds) then returns its
output already quantized for that layer (an ``Fp8Activation``, from ``rms_norm_fp8``) where the
layer's activation groups are a power of two wide (``fused_input_group``): one kernel instead
of two, quantizing the same rounded values.

Under tensor parallelism the norm's input may be a row-parallel layer's ``tp.PartialSum``: the
norm sums it over the ranks first, or, with the Triton kernels, a residual and the P2P
all-reduce able to (``tp.fused_reducer``), sums it inside its own kernel
(``P2pAllReduce.reduce_add_norm``: the same values).

``ZeroCenteredRMSNorm`` is the norm of checkpoints that store ``w`` for a scale of ``1 + w``
(Gemma 3, Qwen3.5): the ``1`` is folded in as the weight loads, so it runs the same kernels.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nvray.layers.compiled import compiled
from nvray.layers.tp import PartialSum, finish, fused_reducer
from nvray.quantization import Fp8LinearMethod, fused_input_group


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6,
                 quantize_for: Fp8LinearMethod | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.quantize_for = quantize_for
        self._norm, self._add_norm = rms_norm, add_rms_norm
        self._quant_group: int | None | bool = False  # the fused reduce's output (False: 16-bit)
        self._fuses_reduce = False

    def enable_torch_compile(self) -> None:
        self._norm, self._add_norm = compiled(rms_norm), compiled(add_rms_norm)

    def use_triton_kernels(self) -> None:
        import kernels  # noqa: PLC0415 - GPU-only import

        fused, group = fused_input_group(self.quantize_for)
        self._fuses_reduce = True
        self._quant_group = group if fused else False
        if fused:
            self._norm = lambda x, weight, eps: kernels.rms_norm_fp8(x, weight, eps, None, group)
            self._add_norm = lambda x, residual, weight, eps: kernels.rms_norm_fp8(
                x, weight, eps, residual, group)
            return
        self._norm = kernels.rms_norm
        self._add_norm = lambda x, residual, weight, eps: kernels.rms_norm(x, weight, eps, residual)

    def forward(self, x: torch.Tensor | PartialSum, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if isinstance(x, PartialSum):
            reducer = fused_reducer(x) if residual is not None and self._fuses_reduce else None
            if reducer is not None:
                return reducer.reduce_add_norm(x.partial, residual, self.weight, self.eps,
                                               self._quant_group)
            x = finish(x)
        if residual is None:
            return self._norm(x, self.weight, self.eps)
        return self._add_norm(x, residual, self.weight, self.eps)


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm scaling by ``1 + w`` for a checkpoint's ``w`` (folded in as it loads)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, **kwargs: Any) -> None:
        super().__init__(hidden_size, eps, **kwargs)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    @staticmethod
    def weight_loader(param: nn.Parameter, loaded: torch.Tensor, *args: object) -> None:
        if tuple(loaded.shape) != tuple(param.shape):
            raise ValueError(f"expected shape {tuple(param.shape)}, checkpoint has {tuple(loaded.shape)}")
        param.data.copy_(loaded.float() + 1.0)
