"""The gated activation of a SwiGLU MLP, ``silu(gate) * up``, in one kernel.

Contract
--------
``silu_and_mul(x) -> out``

* ``x``: ``[num_tokens, 2 * inter]`` float32 / float16 / bfloat16, the fused projection output
  ``[gate | up]``; last dim contiguous (rows may be strided).
* returns ``[num_tokens, inter]``, contiguous, x's dtype: ``silu(gate) * up`` computed in
  float32 and rounded once (what the ``torch.compile``d layer it replaces computes).

Why: see ``rms_norm.py`` — on eager steps a Triton launch costs a fraction of the host time of
a ``torch.compile``d call. Grid ``(num_tokens, cdiv(inter, BLOCK))``.
``silu_and_mul_ref`` is the pure-torch reference.

``silu_and_mul_fp8(x, group=None) -> act``

* the same activation, quantized for the FP8 layer it feeds (``down_proj``) in the same kernel:
  an ``Fp8Activation`` whose ``q`` / ``scale`` are ``quantize_fp8_act(silu_and_mul(x),
  group)`` (the product rounded to x's dtype first, then quantized the same way), ``dtype``
  x's. ``group``: a power of two dividing ``inter`` (grid ``(num_tokens, cdiv(inter,
  BLOCK))``, BLOCK a multiple of it), or None for one scale per row (one program a row: the
  whole row at once up to 16,384 columns, else two passes over it, the amax, then the
  quantized values).
``silu_and_mul_fp8_ref`` is its reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_gemm import quantize_groups
from nvray.quantization.fp8_math import FP8_DTYPE, FP8_MAX, MIN_SCALE, Fp8Activation, check_group

__all__ = ["silu_and_mul", "silu_and_mul_fp8"]

_BLOCK = 1024
_ROW_ONE_PASS = 16384  # a per-row FP8 program holds rows up to this long (padded) at once
_ROW_CHUNK = 2048  # and walks longer ones twice in pieces of this many columns


@triton.jit
def _silu_mul(row, offs, mask, inter):
    """silu(gate) * up for the columns ``offs`` of one row, in float32, rounded to x's dtype."""
    gate = tl.load(row + offs, mask=mask, other=0.0)
    dtype = gate.dtype
    gate = gate.to(tl.float32)
    up = tl.load(row + inter + offs, mask=mask, other=0.0).to(tl.float32)
    return (gate / (1.0 + tl.exp(-gate)) * up).to(dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, inter, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    tl.store(out_ptr + t * inter + offs, _silu_mul(x_ptr + t * stride_x, offs, mask, inter),
             mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(x_ptr, q_ptr, scale_ptr, stride_x, inter, BLOCK: tl.constexpr,
                             GROUP: tl.constexpr, ONE_PASS: tl.constexpr, FP8_MAX: tl.constexpr,
                             MIN_SCALE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    row = x_ptr + t * stride_x
    if GROUP == 0 and ONE_PASS:  # one scale per row, the whole row in one block
        offs = tl.arange(0, BLOCK)
        mask = offs < inter
        y = _silu_mul(row, offs, mask, inter).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(y), axis=0) / FP8_MAX, MIN_SCALE)
        q = tl.clamp(y / scale, -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + t * inter + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + t, scale)
    elif GROUP == 0:  # one scale per row, longer than a block: its amax first, then the values
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(0, inter, BLOCK):
            offs = c + tl.arange(0, BLOCK)
            y = _silu_mul(row, offs, offs < inter, inter).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(y))
        scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, MIN_SCALE)
        for c in range(0, inter, BLOCK):
            offs = c + tl.arange(0, BLOCK)
            mask = offs < inter
            y = _silu_mul(row, offs, mask, inter).to(tl.float32)
            q = tl.clamp(y / scale, -FP8_MAX, FP8_MAX)
            tl.store(q_ptr + t * inter + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + t, scale)
    else:  # BLOCK // GROUP whole groups (inter is a multiple of GROUP)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < inter
        y = _silu_mul(row, offs, mask, inter).to(tl.float32)
        q, scale = quantize_groups(y, BLOCK, GROUP, FP8_MAX, MIN_SCALE)
        tl.store(q_ptr + t * inter + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
        g = tl.program_id(1) * (BLOCK // GROUP) + tl.arange(0, BLOCK // GROUP)
        tl.store(scale_ptr + t * (inter // GROUP) + g, scale, mask=g < inter // GROUP)


_INTERPRET = not isinstance(_silu_and_mul_kernel, triton.runtime.jit.JITFunction)


def _validate_device(x: torch.Tensor) -> None:
    if x.device.type != "cuda" and not _INTERPRET:
        raise ValueError(f"x: expected a CUDA tensor, got device {x.device} (CPU tensors need "
                         "TRITON_INTERPRET=1 set before triton kernels are imported)")


def _validate(x: torch.Tensor) -> None:
    if (x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1
            or x.dtype not in (torch.float32, torch.float16, torch.bfloat16)):
        raise ValueError(f"x: expected a float [num_tokens, 2 * inter] tensor with a contiguous "
                         f"last dim, got {x.dtype} of shape {tuple(x.shape)} strides {x.stride()}")


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :inter]) * x[:, inter:]``."""
    _validate(x)
    _validate_device(x)
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    if num_tokens and inter:
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, _BLOCK))](
            x, out, x.stride(0), inter, BLOCK=_BLOCK, num_warps=4)
    return out


def silu_and_mul_fp8(x: torch.Tensor, group: int | None = None) -> Fp8Activation:
    """:func:`silu_and_mul` quantized to e4m3, a scale per ``group`` columns (None: per row)."""
    _validate(x)
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    check_group(inter, group)
    _validate_device(x)
    q = torch.empty(num_tokens, inter, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(num_tokens, 1 if group is None else inter // group, dtype=torch.float32,
                        device=x.device)
    if not inter:
        scale.fill_(MIN_SCALE)  # an empty row's scale
    if num_tokens and inter:
        padded, warps = triton.next_power_of_2(inter), 4
        one_pass = group is None and padded <= _ROW_ONE_PASS
        if group is not None:
            block = max(_BLOCK, group)
            grid = (num_tokens, triton.cdiv(inter, block))
        elif one_pass:  # ~32 values a thread
            block, grid, warps = padded, (num_tokens,), min(max(padded // 1024, 4), 16)
        else:
            block, grid = _ROW_CHUNK, (num_tokens,)
        _silu_and_mul_fp8_kernel[grid](x, q, scale, x.stride(0), inter, BLOCK=block,
                                       GROUP=group or 0, ONE_PASS=one_pass, FP8_MAX=FP8_MAX,
                                       MIN_SCALE=MIN_SCALE, num_warps=warps)
    return Fp8Activation(q, scale, x.dtype)
