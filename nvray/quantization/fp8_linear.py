"""FP8 weights for nvray's linear layers: the parameters one layer holds and its matmul.

``Fp8LinearMethod.create_weights`` gives a layer an ``float8_e4m3fn`` ``weight`` and a float32
scale named as the checkpoint names it (``weight_scale`` or ``weight_scale_inv``); the scale's
``shard_unit`` tells the layer's weight loader how many weight rows / columns one scale entry
covers (``None``: the dimension is not split), so tensor parallelism shards weights and scales
along the same axis. ``apply`` runs the layer:

- on CUDA, once the model runner has called ``use_triton_kernels`` (as for every layer with
  Triton kernels): activations quantized by one Triton kernel (per token, or per token and block
  column group) unless the kernel before the layer did, then for per-channel weights the Triton
  GEMM at few rows on sm90 or ``torch._scaled_mm``, for block weights the Triton block-scaled
  GEMM (``kernels/fp8_gemm.py``);
- otherwise: ``fp8_math.linear_ref`` (dequantize, compute in the activations' dtype).

Both take the input as a tensor or as an ``Fp8Activation`` that the kernel before the layer
quantized (``fused_input_group``: whether one may, and with how many columns per scale).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from nvray.quantization.config import Fp8Config
from nvray.quantization.fp8_math import FP8_DTYPE, linear_ref, quantize_per_channel


def check_fp8_device(device: torch.device, fp8_weights: bool, fp8_kv_cache: bool) -> None:
    """FP8 on CUDA needs FP8 tensor cores and conversions: compute capability 8.9 (Ada) or
    newer, 9.0 (Hopper) for the weights' GEMMs. Elsewhere the reference path runs."""
    if device.type != "cuda" or not (fp8_weights or fp8_kv_cache):
        return
    capability = torch.cuda.get_device_capability(device)
    need = (9, 0) if fp8_weights else (8, 9)
    if capability < need:
        what = "FP8 weights" if fp8_weights else "kv_cache_dtype='fp8'"
        raise ValueError(f"{what} need a GPU of compute capability {need[0]}.{need[1]} or newer; "
                         f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}")


class Fp8LinearMethod:
    def __init__(self, config: Fp8Config) -> None:
        self.config = config
        self.block = config.block
        self.gpu_linear: Callable[..., torch.Tensor] | None = None  # set by use_triton_kernels

    def use_triton_kernels(self) -> None:
        """The CUDA path (Triton activation quantization, FP8 GEMMs), chosen once on the GPU."""
        from kernels.fp8_gemm import fp8_linear  # noqa: PLC0415 - GPU-only import

        self.gpu_linear = fp8_linear

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        self.config.check_shard("input features per rank", in_features, 1)
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE),
                                    requires_grad=False)
        if self.block is None:
            shape, unit = (out_features, 1), (1, None)
        else:
            bn, bk = self.block
            shape, unit = (-(-out_features // bn), -(-in_features // bk)), (bn, bk)
        scale = nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False)
        scale.shard_unit = unit  # type: ignore[attr-defined]
        setattr(layer, self.config.scale_name, scale)

    def quantize_checkpoint_tensor(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """On-the-fly FP8: a full 16/32-bit checkpoint weight -> (fp8 weight, per-channel scale),
        before it is sharded, so every rank count quantizes alike."""
        assert self.block is None, "on-the-fly quantization is per channel"
        return quantize_per_channel(tensor)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        scale = getattr(layer, self.config.scale_name)
        linear = self.gpu_linear or linear_ref
        return linear(x, layer.weight, scale, self.block, bias)


def fused_input_group(consumer: Fp8LinearMethod | None) -> tuple[bool, int | None]:
    """(whether the kernel producing ``consumer``'s input may quantize it, columns per scale:
    None for one per token). Not for a layer that is not FP8; the fused norm and activation
    kernels take power-of-two groups, and a block of another width keeps the layer's own
    quantization."""
    if consumer is None:
        return False, None
    if consumer.block is None:
        return True, None
    group = consumer.block[1]
    return group & (group - 1) == 0, group
