"""RMSNorm of the hidden states, optionally fused with the residual add, in one kernel.

Contract
--------
``rms_norm(x, weight, eps, residual=None) -> out`` or ``(out, new_residual)``

* ``x``: ``[num_tokens, hidden]`` float32 / float16 / bfloat16, last dim contiguous (rows may be
  strided).
* ``weight``: ``[hidden]``, contiguous, on x's device (any float dtype).
* ``residual``: None, or ``[num_tokens, hidden]`` in x's dtype, last dim contiguous.
* without ``residual``: returns ``weight * x / rms(x)``;
  with it: ``new_residual = x + residual`` (rounded to x's dtype, as the eager layers store it)
  and ``out = weight * new_residual / rms(new_residual)``, both new contiguous tensors.
* ``rms(v) = sqrt(mean(v ** 2) + eps)``, in float32; norm and weight stay in float32 and are
  rounded to x's dtype once, at the end (what the ``torch.compile``d layers it replaces compute).

Why a hand-written kernel: on eager steps (prefill; CUDA graphs replay the decode steps) a
``torch.compile``d function costs ~0.15 ms of host time per call in guards and wrappers, against
~0.03 ms for a Triton launch; with three such calls per layer, an eager
16k-token prefill step of a 28-layer model spent more time launching than the GPU spent
computing. One program per token; ``hidden`` up to 16384.
``rms_norm_ref`` is the pure-torch reference with the same signature.

``rms_norm_fp8(x, weight, eps, residual=None, group=None) -> act`` or ``(act, new_residual)``

* the same norm, its output quantized for the FP8 linear layer it feeds, in the same program:
  ``act`` is an ``Fp8Activation`` whose ``q`` / ``scale`` are ``quantize_fp8_act(out, group)``
  of the ``out`` above (the norm rounded to x's dtype first, then quantized the same way; two
  compiled kernels may still differ by the order of a row's sum: a scale by an ulp, a value by
  one e4m3 step now and then) and whose ``dtype`` is x's. ``group``: one scale per ``group``
  columns, a power of two dividing ``hidden``, or None for one per row. Saves the 16-bit
  output's write and read and one launch per layer input.
``rms_norm_fp8_ref`` is its reference: ``rms_norm_ref`` then ``quantize_activation``.

``sum_rms_norm(peer_ptrs, residual, weight, eps, group=False)`` -> ``(out, new_residual)``

* the tensor-parallel all-reduce fused in: ``x`` is the sum of the ``[num_tokens, hidden]``
  contiguous tensors in residual's dtype at the addresses ``peer_ptrs`` holds (an int64 tensor
  on residual's device, one address per rank: each rank's partial sum in memory every rank
  maps, ``nvray/layers/p2p_allreduce.py``), summed in float32 in rank order and rounded to the
  dtype once (what an all-reduce then :func:`rms_norm` compute); then as :func:`rms_norm` with
  ``residual``. ``group``: False for a 16/32-bit ``out``, else as :func:`rms_norm_fp8`'s (None:
  a scale per row), ``out`` then an ``Fp8Activation``. Saves the all-reduce's copies and a
  launch; the caller makes sure every rank's tensor is written before the launch.
``sum_rms_norm_ref(parts, residual, weight, eps, group=False)`` is its reference over the
partial sums themselves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_gemm import quantize_groups
from nvray.quantization.fp8_math import FP8_DTYPE, FP8_MAX, MIN_SCALE, Fp8Activation, check_group

__all__ = ["rms_norm", "rms_norm_fp8", "sum_rms_norm"]

_MAX_HIDDEN = 16384


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr,
    stride_x, stride_res, hidden, eps,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    NUM_PEERS: tl.constexpr,  # 0: x at x_ptr; n: x the sum of the n tensors at x_ptr's addresses
    QUANT_GROUP: tl.constexpr,  # 0: a 16/32-bit output; else e4m3 with a scale per group
    FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    if NUM_PEERS == 0:
        x = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0)
    else:
        dtype_in = res_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(NUM_PEERS):
            part = tl.load(x_ptr + r).to(tl.pointer_type(dtype_in))
            acc += tl.load(part + t * hidden + offs, mask=mask, other=0.0).to(tl.float32)
        x = acc.to(dtype_in)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + t * stride_res + offs, mask=mask, other=0.0)
        tl.store(res_out_ptr + t * hidden + offs, x, mask=mask)
    dtype = x.dtype
    xf = x.to(tl.float32)
    r = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = (xf * r * w).to(dtype)
    if QUANT_GROUP == 0:
        tl.store(out_ptr + t * hidden + offs, out, mask=mask)
    else:  # the 16-bit values quantized as quantize_fp8_act would (masked columns are 0)
        q, scale = quantize_groups(out.to(tl.float32), BLOCK, QUANT_GROUP, FP8_MAX, MIN_SCALE)
        tl.store(out_ptr + t * hidden + offs, q.to(out_ptr.dtype.element_ty), mask=mask)
        g = tl.arange(0, BLOCK // QUANT_GROUP)
        num_groups = tl.cdiv(hidden, QUANT_GROUP)  # per row: one group of BLOCK >= hidden
        tl.store(scale_ptr + t * num_groups + g, scale, mask=g < num_groups)


_INTERPRET = not isinstance(_rms_norm_kernel, triton.runtime.jit.JITFunction)


def _validate(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in (torch.float32, torch.float16,
                                                            torch.bfloat16):
        raise ValueError(f"x: expected a float [num_tokens, hidden] tensor with a contiguous last "
                         f"dim, got {x.dtype} of shape {tuple(x.shape)} strides {x.stride()}")
    hidden = x.shape[1]
    if not 1 <= hidden <= _MAX_HIDDEN:
        raise ValueError(f"x: expected hidden (dim 1) in [1, {_MAX_HIDDEN}], got {hidden}")
    if weight.shape != (hidden,) or not weight.is_contiguous() or weight.device != x.device:
        raise ValueError(f"weight: expected a contiguous [{hidden}] tensor on {x.device}, got "
                         f"shape {tuple(weight.shape)} on {weight.device}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.stride(1) != 1 or residual.device != x.device):
        raise ValueError(f"residual: expected {x.dtype} of shape {tuple(x.shape)} on {x.device} "
                         f"with a contiguous last dim, got {residual.dtype} of shape "
                         f"{tuple(residual.shape)} on {residual.device}")


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
            out: torch.Tensor, scale: torch.Tensor, quant_group: int,
            peer_ptrs: torch.Tensor | None = None) -> torch.Tensor:
    """Runs the kernel into ``out`` (and ``scale``); returns the new residual (or ``out``).
    With ``peer_ptrs``, ``x`` only gives the shape: the kernel sums the tensors there."""
    if x.device.type != "cuda" and not _INTERPRET:
        raise ValueError(f"x: expected a CUDA tensor, got device {x.device} (CPU tensors need "
                         "TRITON_INTERPRET=1 set before triton kernels are imported)")
    num_tokens, hidden = x.shape
    new_residual = torch.empty_like(x, memory_format=torch.contiguous_format) \
        if residual is not None else out
    if num_tokens:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(num_tokens,)](
            x if peer_ptrs is None else peer_ptrs, residual if residual is not None else x,
            weight, out, new_residual, scale,
            x.stride(0), residual.stride(0) if residual is not None else 0, hidden, eps,
            BLOCK=block, HAS_RESIDUAL=residual is not None,
            NUM_PEERS=0 if peer_ptrs is None else peer_ptrs.numel(), QUANT_GROUP=quant_group,
            FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, num_warps=min(max(block // 256, 1), 8))
    return new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * x / rms(x)``; with ``residual``, of ``x + residual``, returned with it."""
    _validate(x, weight, residual)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = _launch(x, weight, eps, residual, out, out, 0)
    return out if residual is None else (out, new_residual)


def _kernel_group(hidden: int, group: int | None) -> int:
    """The kernel's group: ``group``, or for one scale per row the whole padded row."""
    check_group(hidden, group)
    return group or triton.next_power_of_2(hidden)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None, group: int | None = None
                 ) -> Fp8Activation | tuple[Fp8Activation, torch.Tensor]:
    """:func:`rms_norm` with its output quantized to e4m3, a scale per ``group`` columns
    (None: per row)."""
    _validate(x, weight, residual)
    num_tokens, hidden = x.shape
    kernel_group = _kernel_group(hidden, group)
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(num_tokens, -(-hidden // kernel_group), dtype=torch.float32,
                        device=x.device)
    new_residual = _launch(x, weight, eps, residual, q, scale, kernel_group)
    act = Fp8Activation(q, scale, x.dtype)
    return act if residual is None else (act, new_residual)


def sum_rms_norm(peer_ptrs: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, group: int | None | bool = False
                 ) -> tuple[torch.Tensor | Fp8Activation, torch.Tensor]:
    """:func:`rms_norm` (``group`` False) or :func:`rms_norm_fp8` with ``residual`` of the sum
    of the tensors at ``peer_ptrs`` (module docstring)."""
    _validate(residual, weight, None)
    if (peer_ptrs.dtype != torch.int64 or peer_ptrs.dim() != 1 or not 1 <= peer_ptrs.numel() <= 16
            or peer_ptrs.device != residual.device):
        raise ValueError(f"peer_ptrs: expected 1 to 16 int64 addresses on {residual.device}, got "
                         f"{peer_ptrs.dtype} of shape {tuple(peer_ptrs.shape)} on "
                         f"{peer_ptrs.device}")
    if group is False:
        out = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
        return out, _launch(residual, weight, eps, residual, out, out, 0, peer_ptrs)
    kernel_group = _kernel_group(residual.shape[1], group)  # type: ignore[arg-type]
    q = torch.empty(residual.shape, dtype=FP8_DTYPE, device=residual.device)
    scale = torch.empty(residual.shape[0], -(-residual.shape[1] // kernel_group),
                        dtype=torch.float32, device=residual.device)
    new_residual = _launch(residual, weight, eps, residual, q, scale, kernel_group, peer_ptrs)
    return Fp8Activation(q, scale, residual.dtype), new_residual
