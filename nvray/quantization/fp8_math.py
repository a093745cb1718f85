"""FP8 (e4m3) quantization math in plain torch: the reference every FP8 path is checked against.

Weights are stored as ``float8_e4m3fn`` with float32 scales such that ``w ≈ q * scale``:

- per output channel: ``scale`` is ``[out, 1]`` (compressed-tensors ``strategy: channel``,
  nvray's on-the-fly quantization);
- per block: ``scale`` is ``[ceil(out / bn), ceil(in / bk)]`` (Qwen's / DeepSeek's
  ``weight_scale_inv``, ``weight_block_size = [bn, bk]``).

An FP8 KV cache (``to_cache_dtype``) stores keys and values as they are (scale 1), saturated.

Activations are quantized dynamically, per token (a row) or per token and group of ``group``
columns, with ``scale = amax / 448``. ``linear_ref`` is the whole FP8 linear layer: quantize the
input as the GPU path does (or take an ``Fp8Activation`` a fused kernel already quantized),
dequantize both operands to the compute dtype, multiply.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
MIN_SCALE = 1e-12  # an all-zero row or block gets this scale instead of 0


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """Saturating cast: torch's own cast turns values beyond ±448 into NaN."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a KV cache of ``dtype`` stores it: an FP8 cache holds values at scale 1,
    saturated at ±448."""
    return to_fp8(x.float()) if dtype == FP8_DTYPE else x.to(dtype)


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (fp8 [out, in], float32 scale [out, 1])."""
    w = w.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    return to_fp8(w / scale), scale


def _expand_blocks(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """A block-scale grid repeated to ``shape`` (the last blocks may be partial)."""
    bn, bk = block
    full = scale.repeat_interleave(bn, dim=0).repeat_interleave(bk, dim=1)
    return full[:shape[0], :shape[1]]


def quantize_per_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (fp8 [out, in], float32 scale [ceil(out/bn), ceil(in/bk)])."""
    bn, bk = block
    out, inp = w.shape
    rows, cols = -(-out // bn), -(-inp // bk)
    padded = torch.zeros(rows * bn, cols * bk, dtype=torch.float32, device=w.device)
    padded[:out, :inp] = w.float()
    amax = padded.view(rows, bn, cols, bk).abs().amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp_min(MIN_SCALE)
    return to_fp8(w.float() / _expand_blocks(scale, (out, inp), block)), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight an FP8 tensor stands for: per channel (``block=None``) or per block."""
    if block is None:
        return (q.float() * scale.float()).to(dtype)
    return (q.float() * _expand_blocks(scale.float(), tuple(q.shape), block)).to(dtype)


def quantize_activation(x: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, K] -> (fp8 [T, K], float32 scale [T, K / group]); ``group=None``: one per row."""
    group = group or x.shape[-1]
    t, k = x.shape
    assert k % group == 0, f"{k} columns do not split into groups of {group}"
    grouped = x.float().view(t, k // group, group)
    scale = (grouped.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    return to_fp8(grouped / scale).view(t, k), scale.view(t, k // group)


class Fp8Activation(NamedTuple):
    """A linear layer's input, quantized by the kernel that produced it (the RMSNorm or the
    gated activation before an FP8 layer): ``q`` ``[T, K]`` e4m3 and ``scale`` ``[T, K / group]``
    float32 as ``quantize_activation`` makes them; ``dtype`` is the compute dtype it stands for
    (the layer's output dtype)."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    def dequantize(self) -> torch.Tensor:
        """``q * scale`` in ``dtype``: what the FP8 GEMM sees of the activation."""
        t, k = self.q.shape
        groups = self.scale.shape[1]
        back = self.q.float().view(t, groups, k // groups) * self.scale.unsqueeze(-1)
        return back.view(t, k).to(self.dtype)


def check_group(columns: int, group: int | None) -> None:
    """A fused kernel's activation group: None (one scale per row) or a power of two dividing
    the row (``ValueError`` naming ``group`` otherwise)."""
    if group is not None and (group < 1 or group & (group - 1) or columns % group):
        raise ValueError(f"group: expected a power of two dividing the {columns} columns or None, "
                         f"got {group}")


def fake_quantize_activation(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """``x`` after an FP8 round trip, in ``x``'s dtype: what the FP8 GEMM sees of it."""
    act = Fp8Activation(*quantize_activation(x.reshape(-1, x.shape[-1]), group), x.dtype)
    return act.dequantize().view(x.shape)


def check_activation_groups(x: Fp8Activation, in_features: int, block: tuple[int, int] | None) -> None:
    """A pre-quantized input must carry the scales the layer's GEMM expects: one per row for
    per-channel weights, one per ``block[1]`` columns for block weights."""
    want = 1 if block is None else in_features // block[1]
    if x.q.dim() != 2 or x.q.shape[1] != in_features or tuple(x.scale.shape) != (x.q.shape[0], want):
        raise ValueError(f"a quantized activation q {tuple(x.q.shape)}, scale {tuple(x.scale.shape)} "
                         f"does not fit a layer of {in_features} inputs with weight block {block} "
                         f"(expected scales [T, {want}])")


def linear_ref(x: torch.Tensor | Fp8Activation, q: torch.Tensor, scale: torch.Tensor,
               block: tuple[int, int] | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The FP8 linear layer in ``x``'s dtype: activations quantized per token (per channel
    weights) or per token and ``block[1]`` columns (block weights); an ``Fp8Activation`` comes
    quantized already."""
    if isinstance(x, Fp8Activation):
        check_activation_groups(x, q.shape[1], block)
        seen = x.dequantize()
    else:
        seen = fake_quantize_activation(x, None if block is None else block[1])
    return F.linear(seen, dequantize(q, scale, block, seen.dtype), bias)
