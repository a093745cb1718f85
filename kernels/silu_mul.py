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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["silu_and_mul", "silu_and_mul_ref"]

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, inter, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    row = x_ptr + t * stride_x
    gate = tl.load(row + offs, mask=mask, other=0.0)
    dtype = gate.dtype
    gate = gate.to(tl.float32)
    up = tl.load(row + inter + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + t * inter + offs, out.to(dtype), mask=mask)


_INTERPRET = not isinstance(_silu_and_mul_kernel, triton.runtime.jit.JITFunction)


def _validate(x: torch.Tensor) -> None:
    if (x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1
            or x.dtype not in (torch.float32, torch.float16, torch.bfloat16)):
        raise ValueError(f"x: expected a float [num_tokens, 2 * inter] tensor with a contiguous "
                         f"last dim, got {x.dtype} of shape {tuple(x.shape)} strides {x.stride()}")


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :inter]) * x[:, inter:]``."""
    _validate(x)
    if x.device.type != "cuda" and not _INTERPRET:
        raise ValueError(f"x: expected a CUDA tensor, got device {x.device} (CPU tensors need "
                         "TRITON_INTERPRET=1 set before triton kernels are imported)")
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    if num_tokens and inter:
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, _BLOCK))](
            x, out, x.stride(0), inter, BLOCK=_BLOCK, num_warps=4)
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Pure-torch reference of :func:`silu_and_mul` (same contract)."""
    _validate(x)
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
