"""FP8 (e4m3) linear layers: dynamic activation quantization, the per-channel and the block-scaled
GEMMs.

Contract
--------
``quantize_fp8_act(x, group) -> (q, scale)``

* ``x``: ``[M, K]`` bf16/fp16/fp32, last dim contiguous; ``group``: columns per scale, a
  divisor of ``K``, or ``None`` for one scale per row.
* ``q``: ``[M, K]`` ``float8_e4m3fn``; ``scale``: ``[M, K // group]`` float32 with
  ``x ≈ q * scale`` (``scale = max(amax, 1e-12 * 448) / 448`` over each row's group).
  One program per (row, group).

``block_fp8_mm(a, a_scale, w, w_scale, block, out_dtype) -> out``

* ``a``: ``[M, K]`` fp8, ``a_scale``: ``[M, K // bk]`` float32 (``quantize_fp8_act`` with
  ``group = bk``); ``w``: ``[N, K]`` fp8, ``w_scale``: ``[ceil(N / bn), K // bk]`` float32;
  ``block = (bn, bk)`` with ``bk`` 16, 32, 64, 128 or a multiple of 128, dividing ``K`` (K is
  walked in tiles of ``min(bk, 128)``, each inside one scale group).
* ``out[m, n] = Σ_k a[m, k] * a_scale[m, k // bk] * w[n, k] * w_scale[n // bn, k // bk]``,
  products accumulated in fp32 per K block, written in ``out_dtype``.

``channel_fp8_mm(a, a_scale, w, w_scale, out_dtype) -> out``

* per-channel weights and per-token activations: ``a`` ``[M, K]`` fp8 with ``a_scale``
  ``[M, 1]``, ``w`` ``[N, K]`` fp8 with ``w_scale`` ``[N, 1]`` (float32); K a multiple of 16.
* ``out[m, n] = a_scale[m] * w_scale[n] * Σ_k a[m, k] * w[n, k]`` (fp32 accumulation: on
  Hopper, each K tile's partial sum is added into fp32), in ``out_dtype``. Tiles of 64
  rows, 256 (or 128) columns of K, and as many output columns as keep ~128 programs in the
  grid: at decode's row counts this beats cuBLAS's FP8 GEMM (``torch._scaled_mm`` picks
  128x128 tiles, a few dozen programs for Qwen3-0.6B's layers).

``fp8_linear(x, w, w_scale, block, bias) -> y`` is a whole layer on ``x`` of any leading shape:
per-channel weights (``block=None``, ``w_scale [N, 1]``) go through ``channel_fp8_mm`` for
few rows or little work on an sm90 GPU (``use_channel_triton``) and ``torch._scaled_mm``
otherwise, with per-token activation scales; block weights through ``block_fp8_mm``. ``x``
may instead be an ``Fp8Activation`` (``[T, K]``, quantized by the kernel that produced it,
e.g. ``rms_norm_fp8``): its scales must be the ones the layer's GEMM takes (one per row, or
one per ``block[1]`` columns), and the output has its ``dtype``. The ``*_ref`` functions are the
pure-torch references with the same signatures.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from nvray.quantization.fp8_math import (FP8_DTYPE, FP8_MAX, MIN_SCALE, Fp8Activation,
                                         check_activation_groups)

__all__ = ["quantize_fp8_act", "block_fp8_mm", "channel_fp8_mm", "fp8_linear"]

# per-channel layers go to channel_fp8_mm up to this many rows, or below this much work
# (M * N * K), on the GPU it was measured on (compute capability 9.0, whose 228 KB of shared
# memory per SM the 4-stage tiles need); elsewhere, and beyond, to cuBLAS. H100, per layer
# against torch._scaled_mm (2026-11-27, each K tile promoted to fp32): Qwen3-0.6B's shapes
# 0.64x at 16 rows, 0.71x at 128, 0.81x at 256, 0.99x at 512; Qwen3-8B's 0.72x at 16, 0.94x at
# 128, 1.29x at 256.
CHANNEL_TRITON_MAX_ROWS = 128
CHANNEL_TRITON_MAX_WORK = 2**31
_CHANNEL_TRITON_CAPABILITY = (9, 0)


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def use_channel_triton(a: torch.Tensor, n: int) -> bool:
    """Whether ``channel_fp8_mm`` takes ``a`` ``[M, K]`` times an ``[N, K]`` weight."""
    m, k = a.shape
    if a.device.type == "cuda" and _capability(a.device.index or 0) != _CHANNEL_TRITON_CAPABILITY:
        return False
    return m <= CHANNEL_TRITON_MAX_ROWS or m * n * k < CHANNEL_TRITON_MAX_WORK


@triton.jit
def quantize_groups(y, BLOCK: tl.constexpr, GROUP: tl.constexpr, FP8_MAX: tl.constexpr,
                    MIN_SCALE: tl.constexpr):
    """``y`` (``BLOCK`` float32 values of one row) quantized in groups of ``GROUP`` consecutive
    values as ``quantize_fp8_act`` does: (``BLOCK`` e4m3-range values, ``BLOCK // GROUP``
    scales). For the kernels that quantize their own output (``rms_norm_fp8``,
    ``silu_and_mul_fp8``); padding values must be 0."""
    groups = tl.reshape(y, (BLOCK // GROUP, GROUP))
    scale = tl.maximum(tl.max(tl.abs(groups), axis=1) / FP8_MAX, MIN_SCALE)
    return tl.reshape(tl.clamp(groups / scale[:, None], -FP8_MAX, FP8_MAX), (BLOCK,)), scale


@triton.jit
def _quantize_act_kernel(x_ptr, q_ptr, s_ptr, stride_xm, stride_qm, stride_sm,
                         GROUP: tl.constexpr, CHUNK: tl.constexpr, FP8_MAX: tl.constexpr,
                         MIN_SCALE: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = tl.arange(0, CHUNK)
    start = g * GROUP
    amax = tl.zeros([CHUNK], dtype=tl.float32)
    for c in range(0, GROUP, CHUNK):
        cols = start + c + offs
        x = tl.load(x_ptr + m * stride_xm + cols, mask=c + offs < GROUP, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, MIN_SCALE)
    for c in range(0, GROUP, CHUNK):
        cols = start + c + offs
        mask = c + offs < GROUP
        x = tl.load(x_ptr + m * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + m * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + m * stride_sm + g, scale)


def quantize_fp8_act(x: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [M, K] with a contiguous last dim, got {tuple(x.shape)}")
    m, k = x.shape
    group = group or k
    if k % group:
        raise ValueError(f"group={group} does not divide K={k}")
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, k // group), dtype=torch.float32, device=x.device)
    if m:
        chunk = min(triton.next_power_of_2(group), 2048)
        _quantize_act_kernel[(m, k // group)](x, q, scale, x.stride(0), q.stride(0), scale.stride(0),
                                              GROUP=group, CHUNK=chunk, FP8_MAX=FP8_MAX,
                                              MIN_SCALE=MIN_SCALE, num_warps=4)
    return q, scale


@triton.jit
def _tile(a_ptr, w_ptr, M, N, stride_am, stride_wn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr):
    """This program's output tile: its rows and columns, their masks, and the first K step's
    pointers into ``a`` (rows) and ``w`` (columns, as the dot's right operand)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    return offs_m, offs_n, offs_k, offs_m < M, offs_n < N, a_rows, w_cols


@triton.jit
def _store_tile(out_ptr, acc, offs_m, offs_n, mask_m, mask_n, stride_om):
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _block_fp8_mm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, M, N, K,
                         stride_am, stride_asm, stride_wn, stride_wsn, stride_om,
                         BN_SCALE: tl.constexpr, BK_SCALE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m, offs_n, offs_k, mask_m, mask_n, a_rows, w_cols = _tile(
        a_ptr, w_ptr, M, N, stride_am, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K)
    as_rows = as_ptr + offs_m.to(tl.int64) * stride_asm
    ws_rows = ws_ptr + (offs_n // BN_SCALE).to(tl.int64) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_rows + (k0 + offs_k)[None, :], mask=mask_m[:, None], other=0.0)
        w = tl.load(w_cols + (k0 + offs_k)[:, None], mask=mask_n[None, :], other=0.0)
        a_s = tl.load(as_rows + k0 // BK_SCALE, mask=mask_m, other=0.0)
        w_s = tl.load(ws_rows + k0 // BK_SCALE, mask=mask_n, other=0.0)
        acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
    _store_tile(out_ptr, acc, offs_m, offs_n, mask_m, mask_n, stride_om)


def _check_block_args(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor,
                      w_scale: torch.Tensor, block: tuple[int, int]) -> None:
    (m, k), (n, kw), (bn, bk) = a.shape, w.shape, block
    if k != kw:
        raise ValueError(f"a has K={k}, w has K={kw}")
    if not ((16 <= bk <= 128 and bk & (bk - 1) == 0) or bk % 128 == 0) or k % bk:
        raise ValueError(f"block={block}: bk must be 16, 32, 64, 128 or a multiple of 128, "
                         f"dividing K={k}")
    if tuple(a_scale.shape) != (m, k // bk) or tuple(w_scale.shape) != (-(-n // bn), k // bk):
        raise ValueError(f"scales {tuple(a_scale.shape)} / {tuple(w_scale.shape)} do not fit "
                         f"a {tuple(a.shape)}, w {tuple(w.shape)}, block {block}")
    if a.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("a and w need a contiguous last dim")


def block_fp8_mm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                 block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    _check_block_args(a, a_scale, w, w_scale, block)
    (m, k), n = a.shape, w.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    block_m, block_n, num_warps, num_stages = _block_mm_config(m)
    block_k = min(block[1], 128)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _block_fp8_mm_kernel[grid](a, a_scale, w, w_scale, out, m, n, k, a.stride(0),
                               a_scale.stride(0), w.stride(0), w_scale.stride(0), out.stride(0),
                               BN_SCALE=block[0], BK_SCALE=block[1], BLOCK_M=block_m,
                               BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
                               num_stages=num_stages)
    return out


def _block_mm_config(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for ``m`` rows: the best of a sweep on an H100
    over Qwen3-8B's layer shapes (16 rows: 19-51 us; 256: 23-88 us; 2048: 107-619 us).
    cuBLAS's own 1x128/128x128 block scaling (torch 2.11) was no alternative: it refused row
    counts that are not a multiple of 16 and gave wrong products at 256x256 weights."""
    if m <= 32:
        return (16 if m <= 16 else 32), 64, 4, 4
    if m <= 256:
        return 64, 64, 4, 4
    return 64, 128, 4, 3


@triton.jit
def _channel_fp8_mm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, M, N, K,
                           stride_am, stride_wn, stride_om,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           EVEN_K: tl.constexpr):
    offs_m, offs_n, offs_k, mask_m, mask_n, a_rows, w_cols = _tile(
        a_ptr, w_ptr, M, N, stride_am, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k < K) | EVEN_K
        a = tl.load(a_rows + (k0 + offs_k)[None, :], mask=mask_m[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_cols + (k0 + offs_k)[:, None], mask=mask_n[None, :] & k_mask[:, None],
                    other=0.0)
        # Hopper's FP8 tensor cores add in less than fp32 (Triton's default on sm90 keeps the
        # whole K loop there): each K tile is summed on its own and added in fp32, as the block
        # kernel does per K block. Promoting every 128 products instead (as cuBLAS does) made
        # this kernel 1.3x slower at 256 rows of Qwen3-0.6B's layers on an H100, for ~1.4x less
        # error on positive operands.
        acc += tl.dot(a, w)
    a_s = tl.load(as_ptr + offs_m, mask=mask_m, other=0.0)
    w_s = tl.load(ws_ptr + offs_n, mask=mask_n, other=0.0)
    acc = acc * a_s[:, None] * w_s[None, :]
    _store_tile(out_ptr, acc, offs_m, offs_n, mask_m, mask_n, stride_om)


def _check_channel_args(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor,
                        w_scale: torch.Tensor) -> None:
    (m, k), (n, kw) = a.shape, w.shape
    if k != kw or k % 16:
        raise ValueError(f"a has K={k}, w has K={kw}: they must agree, a multiple of 16")
    if tuple(a_scale.shape) != (m, 1) or w_scale.numel() != n:
        raise ValueError(f"scales {tuple(a_scale.shape)} / {tuple(w_scale.shape)} do not fit "
                         f"a {tuple(a.shape)}, w {tuple(w.shape)} (per row / per channel)")
    if a.stride(-1) != 1 or w.stride(-1) != 1 or not (a_scale.is_contiguous()
                                                      and w_scale.is_contiguous()):
        raise ValueError("a and w need a contiguous last dim, the scales contiguous")


def _channel_mm_config(m: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): the widest output tile that still gives ~128 programs (an
    H100 sweep over Qwen3-0.6B's layers at 16-256 rows: 64 x 32..128 x 256 won every shape, by
    1.4x over cuBLAS's FP8 GEMM per layer)."""
    block_m = 64
    rows = triton.cdiv(m, block_m)
    block_n = next((bn for bn in (128, 64) if rows * triton.cdiv(n, bn) >= 128), 32)
    return block_m, block_n, 256 if k % 256 == 0 else 128


def channel_fp8_mm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
    _check_channel_args(a, a_scale, w, w_scale)
    (m, k), n = a.shape, w.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    block_m, block_n, block_k = _channel_mm_config(m, n, k)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _channel_fp8_mm_kernel[grid](a, a_scale, w, w_scale, out, m, n, k, a.stride(0), w.stride(0),
                                 out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                 EVEN_K=k % block_k == 0, num_warps=4, num_stages=4)
    return out


def fp8_linear(x: torch.Tensor | Fp8Activation, w: torch.Tensor, w_scale: torch.Tensor,
               block: tuple[int, int] | None, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(x, Fp8Activation):
        check_activation_groups(x, w.shape[1], block)
        (q, scale, dtype), lead = x, x.q.shape[:-1]
    else:
        q, scale = quantize_fp8_act(x.reshape(-1, x.shape[-1]), None if block is None else block[1])
        dtype, lead = x.dtype, x.shape[:-1]
    if block is None and use_channel_triton(q, w.shape[0]):
        y = channel_fp8_mm(q, scale, w, w_scale, dtype)
    elif block is None:
        # row-wise scales give bf16 on every torch/cuBLAS build; other dtypes only on some
        y = torch._scaled_mm(q, w.t(), scale_a=scale, scale_b=w_scale.view(1, -1),
                             out_dtype=torch.bfloat16).to(dtype)
    else:
        y = block_fp8_mm(q, scale, w, w_scale, block, dtype)
    if bias is not None:
        y = y + bias
    return y.view(*lead, w.shape[0])
