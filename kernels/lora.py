"""Batched LoRA: every token's delta through its own adapter's slot, for a whole step at once.

Contract
--------
The tokens of a step are grouped by slot: ``rows`` (int32) lists the rows of the tokens that use
an adapter, slot by slot (slot ``s``'s are ``rows[starts[s] : starts[s] + counts[s]]``);
``counts`` / ``starts`` (int32, ``[num_slots]``). Base tokens appear nowhere. The buffers may
be longer than what they hold (a CUDA graph's static buffers): only ``counts`` say what is read.

``lora_shrink(x, a, h, rows, counts, starts)``

* ``x``: ``[T, K]`` activations (rows may be strided, last dim contiguous); ``a``:
  ``[num_slots, N, K]`` the slots' stacked A matrices (N = slices x max rank); ``h``:
  ``[splits, T, N]`` float32 partial sums over ``splits`` equal parts of K (``shrink_splits``:
  a decode step's few rows split K, so that enough programs run), written at the grouped rows
  only: ``h.sum(0)[t] = x[t] @ a[slot(t)].T``.

``lora_expand(h, b, y, rows, counts, starts, h_col, y_col, width)``

* ``b``: ``[num_slots, OUT, R]`` the slots' B matrices (scaling folded in); adds, at the grouped
  rows, ``h.sum(0)[t, h_col : h_col + R] @ b[slot(t), y_col : y_col + width].T`` (the partial
  sums added in a fixed order: deterministic) to
  ``y[t, y_col : y_col + width]`` (``y``: ``[T, OUT]``, x's dtype, in place), rounding once.
  A fused projection (q/k/v, gate/up) calls it once per slice.

Products accumulate in float32; float32 weights multiply in IEEE float32 (no TF32), 16-bit ones
on the tensor cores (``h`` rounded to B's dtype first).

Grid ``(cdiv(T, BLOCK_M), cdiv(N, BLOCK_N) x splits or cdiv(width, BLOCK_N), num_slots)``: a program takes up to
BLOCK_M of one slot's tokens (gathered through ``rows``) and one tile of outputs; programs past
a slot's count return at once, so a graph captured for T rows serves any mix of slots.
``lora_shrink_ref`` / ``lora_expand_ref`` are the pure-torch references (``nvray/lora/ops.py``,
the CPU path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nvray.lora.ops import expand_torch, shrink_torch

__all__ = ["lora_shrink", "lora_expand", "lora_shrink_ref", "lora_expand_ref", "shrink_splits"]

lora_shrink_ref = shrink_torch
lora_expand_ref = expand_torch

_BLOCK_M = 16
_BLOCK_N = 64
_BLOCK_K = 64
_TARGET_PROGRAMS = 512  # split K until a step's row tiles make about this many shrink programs


def shrink_splits(num_rows: int, k: int) -> int:
    """How many parts ``lora_shrink`` splits the input features into for ``num_rows`` rows:
    a decode step has few row tiles (a slot's tokens), and its K (the hidden size, up to the
    MLP's width) would run as one long loop per program; a prefill step has many."""
    row_tiles = triton.cdiv(max(num_rows, 1), _BLOCK_M)
    return max(1, min(triton.cdiv(k, 4 * _BLOCK_K), _TARGET_PROGRAMS // row_tiles))


@triton.jit
def _slot_rows(rows_ptr, starts_ptr, slot, count, pid_m, BLOCK_M: tl.constexpr):
    offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = offs < count
    rows = tl.load(rows_ptr + tl.load(starts_ptr + slot) + offs, mask=valid, other=0)
    return rows.to(tl.int64), valid


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, rows_ptr, counts_ptr, starts_ptr, K, N, k_per_split,
                   n_tiles, stride_x, stride_as, stride_an, stride_hs, stride_h,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr):
    pid_m, pid_nk, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    count = tl.load(counts_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    rows, valid = _slot_rows(rows_ptr, starts_ptr, slot, count, pid_m, BLOCK_M)
    pid_n, split = pid_nk % n_tiles, pid_nk // n_tiles
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_end = tl.minimum(K, (split + 1) * k_per_split)
    for k0 in range(split * k_per_split, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        x = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_base + offs_n[None, :] * stride_an + offs_k[:, None],
                    mask=(offs_n < N)[None, :] & k_ok[:, None], other=0.0)
        acc += tl.dot(x, a, input_precision=PRECISION)
    tl.store(h_ptr + split * stride_hs + rows[:, None] * stride_h + offs_n[None, :], acc,
             mask=valid[:, None] & (offs_n < N)[None, :])


@triton.jit
def _expand_kernel(h_ptr, b_ptr, y_ptr, rows_ptr, counts_ptr, starts_ptr, R, width, splits,
                   h_col, y_col, stride_hs, stride_h, stride_bs, stride_bo, stride_y,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   PRECISION: tl.constexpr):
    pid_m, pid_n, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    count = tl.load(counts_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    rows, valid = _slot_rows(rows_ptr, starts_ptr, slot, count, pid_m, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    n_ok = offs_n < width
    b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + (y_col + offs_n)[None, :] * stride_bo
                + offs_r[:, None], mask=n_ok[None, :] & (offs_r < R)[:, None], other=0.0)
    h_tile = h_ptr + rows[:, None] * stride_h + h_col + offs_r[None, :]
    h_mask = valid[:, None] & (offs_r < R)[None, :]
    h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for split in range(0, splits):  # the shrink's partial sums, in a fixed order
        h += tl.load(h_tile + split * stride_hs, mask=h_mask, other=0.0)
    delta = tl.dot(h.to(b.dtype), b, input_precision=PRECISION)
    out = y_ptr + rows[:, None] * stride_y + y_col + offs_n[None, :]
    mask = valid[:, None] & n_ok[None, :]
    y = tl.load(out, mask=mask, other=0.0)
    tl.store(out, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


def _precision(dtype: torch.dtype) -> str:
    """float32 weights multiply in full precision (not TF32); 16-bit ones on tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_meta(rows: torch.Tensor, counts: torch.Tensor, starts: torch.Tensor,
                num_slots: int) -> None:
    for name, t in (("rows", rows), ("counts", counts), ("starts", starts)):
        if t.dtype != torch.int32 or t.dim() != 1:
            raise ValueError(f"{name} must be a 1-D int32 tensor, got {t.dtype} {tuple(t.shape)}")
    if counts.numel() != num_slots or starts.numel() != num_slots:
        raise ValueError(f"counts/starts must have one entry per slot ({num_slots})")


def lora_shrink(x: torch.Tensor, a: torch.Tensor, h: torch.Tensor, rows: torch.Tensor,
                counts: torch.Tensor, starts: torch.Tensor) -> None:
    if x.dim() != 2 or a.dim() != 3 or h.dim() != 3 or x.stride(1) != 1:
        raise ValueError("x [T, K] (last dim contiguous), a [slots, N, K], h [splits, T, N] "
                         "expected")
    (t, k), (slots, n, ka) = x.shape, a.shape
    splits = h.shape[0]
    if (ka != k or h.shape[1:] != (t, n) or h.dtype != torch.float32 or not a.is_contiguous()
            or not h.is_contiguous()):
        raise ValueError(f"shapes do not fit: x {tuple(x.shape)}, a {tuple(a.shape)}, "
                         f"h {tuple(h.shape)} {h.dtype} (float32; a and h contiguous)")
    _check_meta(rows, counts, starts, slots)
    if t == 0:
        return
    k_per_split = triton.cdiv(triton.cdiv(k, splits), _BLOCK_K) * _BLOCK_K
    n_tiles = triton.cdiv(n, _BLOCK_N)
    grid = (triton.cdiv(t, _BLOCK_M), n_tiles * splits, slots)
    _shrink_kernel[grid](x, a, h, rows, counts, starts, k, n, k_per_split, n_tiles,
                         x.stride(0), a.stride(0), a.stride(1), h.stride(0), h.stride(1),
                         BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
                         PRECISION=_precision(a.dtype))


def lora_expand(h: torch.Tensor, b: torch.Tensor, y: torch.Tensor, rows: torch.Tensor,
                counts: torch.Tensor, starts: torch.Tensor, h_col: int, y_col: int,
                width: int) -> None:
    if h.dim() != 3 or b.dim() != 3 or y.dim() != 2 or y.stride(1) != 1 or not b.is_contiguous():
        raise ValueError("h [splits, T, N], b [slots, OUT, R] (contiguous), y [T, OUT] expected")
    slots, out, r = b.shape
    if (y.shape[0] != h.shape[1] or y_col + width > min(out, y.shape[1])
            or h_col + r > h.shape[2] or not h.is_contiguous()):
        raise ValueError(f"shapes do not fit: h {tuple(h.shape)}, b {tuple(b.shape)}, "
                         f"y {tuple(y.shape)}, h_col {h_col}, y_col {y_col}, width {width}")
    _check_meta(rows, counts, starts, slots)
    t = y.shape[0]
    if t == 0 or width == 0:
        return
    grid = (triton.cdiv(t, _BLOCK_M), triton.cdiv(width, _BLOCK_N), slots)
    _expand_kernel[grid](h, b, y, rows, counts, starts, r, width, h.shape[0], h_col, y_col,
                         h.stride(0), h.stride(1), b.stride(0), b.stride(1), y.stride(0),
                         BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N,
                         BLOCK_R=max(16, triton.next_power_of_2(r)),
                         PRECISION=_precision(b.dtype))
