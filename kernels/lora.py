"""Batched LoRA: every token's delta through its own adapter's slot, for a whole step at once.

Contract
--------
The tokens of a step that use an adapter are grouped by slot in ``rows`` (int32: their rows in
the step's tensors) and cut into tiles of at most ``tile_rows`` (a power of two >= 16) rows of
one slot: ``tiles`` (int32 ``[3, num_tiles]``, ``nvray/lora/batch.py``) holds each tile's slot
(-1: none), first entry in ``rows`` and row count. Base tokens appear nowhere. A step of T rows
launches ``num_tiles`` = ``cdiv(T, tile_rows) + num_slots`` programs along the rows (what any
mix of slots can need); a CUDA graph captured for T rows serves every mix, its tiles read at
each replay.

``lora_shrink(x, a, h, rows, tiles, tile_rows=16)``

* ``x``: ``[T, K]`` activations (rows may be strided, last dim contiguous); ``a``:
  ``[num_slots, N, K]`` the slots' stacked A matrices (N = slices x max rank); ``h``:
  ``[splits, T, N]`` float32 partial sums over ``splits`` equal parts of K (``shrink_splits``:
  a decode step's few rows split K, so that enough programs run), written at the grouped rows
  only: ``h.sum(0)[t] = x[t] @ a[slot(t)].T``.

``lora_expand(h, b, y, rows, tiles, slices, tile_rows=16)``

* ``b``: ``[num_slots, OUT, R]`` the slots' B matrices (scaling folded in); ``slices``: the
  ``(h_col, y_col, width)`` of each part of a fused projection (q/k/v, gate/up; one for the
  others), all in one launch (three a launch). For each slice it adds, at the grouped rows,
  ``h.sum(0)[t, h_col : h_col + R] @ b[slot(t), y_col : y_col + width].T`` (the partial sums
  added in a fixed order, once a program: deterministic) to ``y[t, y_col : y_col + width]``
  (``y``: ``[T, OUT]``, x's dtype, in place), rounding once.

Products accumulate in float32; float32 weights multiply in IEEE float32 (no TF32), 16-bit ones
on the tensor cores (``h`` rounded to B's dtype first). Grids: ``(num_tiles, cdiv(N, BLOCK_N) x
splits)`` and ``(num_tiles, sum of cdiv(width, chunks x BLOCK_OUT) over the slices)``, an
expand program adding ``chunks`` column blocks of one slice (more for a wide step, so that h is
summed fewer times); a program whose tile has no slot returns at once. ``lora_shrink_ref`` / ``lora_expand_ref`` are the pure-torch references, tile by
tile (the engine's CPU path is ``nvray/lora/ops.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["lora_shrink", "lora_expand", "shrink_splits", "expand_chunks"]

_BLOCK_N = 64  # shrink: columns of h a program computes
_BLOCK_OUT = 128  # expand: output columns a program adds to
_BLOCK_K = 64
_TARGET_PROGRAMS = 512  # split K until a step's row tiles make about this many shrink programs


def shrink_splits(num_rows: int, k: int, tile_rows: int = 16) -> int:
    """How many parts ``lora_shrink`` splits the input features into for ``num_rows`` rows:
    a decode step has few row tiles, and its K (the hidden size, up to the MLP's width) would
    run as one long loop per program; a prefill step has many."""
    row_tiles = triton.cdiv(max(num_rows, 1), tile_rows)
    return max(1, min(triton.cdiv(k, 4 * _BLOCK_K), _TARGET_PROGRAMS // row_tiles))


@triton.jit
def _tile_rows(rows_ptr, tiles_ptr, stride_t, pid_t, BLOCK_M: tl.constexpr):
    start = tl.load(tiles_ptr + stride_t + pid_t)
    count = tl.load(tiles_ptr + 2 * stride_t + pid_t)
    offs = tl.arange(0, BLOCK_M)
    valid = offs < count
    rows = tl.load(rows_ptr + start + offs, mask=valid, other=0)
    return rows.to(tl.int64), valid


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, rows_ptr, tiles_ptr, K, N, k_per_split, n_tiles,
                   stride_t, stride_x, stride_as, stride_an, stride_hs, stride_h,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr):
    pid_t, pid_nk = tl.program_id(0), tl.program_id(1)
    slot = tl.load(tiles_ptr + pid_t)
    if slot < 0:
        return
    rows, valid = _tile_rows(rows_ptr, tiles_ptr, stride_t, pid_t, BLOCK_M)
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
def _expand_kernel(h_ptr, b_ptr, y_ptr, rows_ptr, tiles_ptr, R, splits,
                   h0, y0, w0, nb0, h1, y1, w1, nb1, h2, y2, w2,
                   stride_t, stride_hs, stride_h, stride_bs, stride_bo, stride_y,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr,
                   BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):
    pid_t, pid_n = tl.program_id(0), tl.program_id(1)
    slot = tl.load(tiles_ptr + pid_t)
    if slot < 0:
        return
    rows, valid = _tile_rows(rows_ptr, tiles_ptr, stride_t, pid_t, BLOCK_M)
    in0, in1 = pid_n < nb0, pid_n < nb0 + nb1  # the slice of this program's columns
    h_col = tl.where(in0, h0, tl.where(in1, h1, h2))
    y_col = tl.where(in0, y0, tl.where(in1, y1, y2))
    width = tl.where(in0, w0, tl.where(in1, w1, w2))
    block = tl.where(in0, pid_n, tl.where(in1, pid_n - nb0, pid_n - nb0 - nb1))
    offs_r = tl.arange(0, BLOCK_R)
    h_tile = h_ptr + rows[:, None] * stride_h + h_col + offs_r[None, :]
    h_mask = valid[:, None] & (offs_r < R)[None, :]
    h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for split in range(0, splits):  # the shrink's partial sums, in a fixed order
        h += tl.load(h_tile + split * stride_hs, mask=h_mask, other=0.0)
    b_base = b_ptr + slot.to(tl.int64) * stride_bs
    for chunk in tl.static_range(CHUNKS):
        offs_n = (block * CHUNKS + chunk) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < width
        b = tl.load(b_base + (y_col + offs_n)[None, :] * stride_bo + offs_r[:, None],
                    mask=n_ok[None, :] & (offs_r < R)[:, None], other=0.0)
        delta = tl.dot(h.to(b.dtype), b, input_precision=PRECISION)
        out = y_ptr + rows[:, None] * stride_y + y_col + offs_n[None, :]
        mask = valid[:, None] & n_ok[None, :]
        y = tl.load(out, mask=mask, other=0.0)
        tl.store(out, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


def _precision(dtype: torch.dtype) -> str:
    """float32 weights multiply in full precision (not TF32); 16-bit ones on tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_meta(rows: torch.Tensor, tiles: torch.Tensor) -> None:
    if rows.dtype != torch.int32 or rows.dim() != 1:
        raise ValueError(f"rows must be a 1-D int32 tensor, got {rows.dtype} {tuple(rows.shape)}")
    if tiles.dtype != torch.int32 or tiles.dim() != 2 or tiles.shape[0] != 3 or tiles.stride(1) != 1:
        raise ValueError(f"tiles must be int32 [3, num_tiles] (rows contiguous), got "
                         f"{tiles.dtype} {tuple(tiles.shape)}")


def lora_shrink(x: torch.Tensor, a: torch.Tensor, h: torch.Tensor, rows: torch.Tensor,
                tiles: torch.Tensor, tile_rows: int = 16) -> None:
    if x.dim() != 2 or a.dim() != 3 or h.dim() != 3 or x.stride(1) != 1:
        raise ValueError("x [T, K] (last dim contiguous), a [slots, N, K], h [splits, T, N] "
                         "expected")
    (t, k), (_, n, ka) = x.shape, a.shape
    splits = h.shape[0]
    if (ka != k or h.shape[1:] != (t, n) or h.dtype != torch.float32 or not a.is_contiguous()
            or not h.is_contiguous()):
        raise ValueError(f"shapes do not fit: x {tuple(x.shape)}, a {tuple(a.shape)}, "
                         f"h {tuple(h.shape)} {h.dtype} (float32; a and h contiguous)")
    _check_meta(rows, tiles)
    if t == 0:
        return
    k_per_split = triton.cdiv(triton.cdiv(k, splits), _BLOCK_K) * _BLOCK_K
    n_tiles = triton.cdiv(n, _BLOCK_N)
    grid = (tiles.shape[1], n_tiles * splits)
    _shrink_kernel[grid](x, a, h, rows, tiles, k, n, k_per_split, n_tiles, tiles.stride(0),
                         x.stride(0), a.stride(0), a.stride(1), h.stride(0), h.stride(1),
                         BLOCK_M=tile_rows, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
                         PRECISION=_precision(a.dtype))


def expand_chunks(num_tiles: int, widths: list[int]) -> int:
    """Column blocks an expand program adds: more for a wide step (a prefill, a wide decode
    batch over a wide projection), so that fewer programs each sum h's partial sums, while
    enough programs run to fill the GPU."""
    chunks = 1
    while chunks < 4 and num_tiles * sum(
            triton.cdiv(w, 2 * chunks * _BLOCK_OUT) for w in widths) >= _TARGET_PROGRAMS * 2:
        chunks *= 2
    return chunks


def lora_expand(h: torch.Tensor, b: torch.Tensor, y: torch.Tensor, rows: torch.Tensor,
                tiles: torch.Tensor, slices: list[tuple[int, int, int]],
                tile_rows: int = 16, chunks: int | None = None) -> None:
    """``chunks``: column blocks a program adds (None: ``expand_chunks``'s choice)."""
    if h.dim() != 3 or b.dim() != 3 or y.dim() != 2 or y.stride(1) != 1 or not b.is_contiguous():
        raise ValueError("h [splits, T, N], b [slots, OUT, R] (contiguous), y [T, OUT] expected")
    _, out, r = b.shape
    for h_col, y_col, width in slices:
        if (y.shape[0] != h.shape[1] or y_col + width > min(out, y.shape[1])
                or h_col + r > h.shape[2] or not h.is_contiguous()):
            raise ValueError(f"shapes do not fit: h {tuple(h.shape)}, b {tuple(b.shape)}, "
                             f"y {tuple(y.shape)}, slice (h_col {h_col}, y_col {y_col}, "
                             f"width {width})")
    _check_meta(rows, tiles)
    if y.shape[0] == 0:
        return
    for first in range(0, len(slices), 3):
        _expand_launch(h, b, y, rows, tiles, list(slices[first:first + 3]), tile_rows, chunks)


def _expand_launch(h, b, y, rows, tiles, slices, tile_rows, chunks):
    """One launch over up to three slices."""
    chunks = chunks or expand_chunks(tiles.shape[1], [w for _, _, w in slices])
    blocks = [triton.cdiv(w, chunks * _BLOCK_OUT) for _, _, w in slices]
    padded = slices + [(0, 0, 0)] * (3 - len(slices))
    blocks += [0] * (3 - len(blocks))
    if sum(blocks) == 0:
        return
    (h0, y0, w0), (h1, y1, w1), (h2, y2, w2) = padded
    r = b.shape[2]
    _expand_kernel[(tiles.shape[1], sum(blocks))](
        h, b, y, rows, tiles, r, h.shape[0], h0, y0, w0, blocks[0], h1, y1, w1, blocks[1],
        h2, y2, w2, tiles.stride(0), h.stride(0), h.stride(1), b.stride(0), b.stride(1),
        y.stride(0), BLOCK_M=tile_rows, BLOCK_N=_BLOCK_OUT, CHUNKS=chunks,
        BLOCK_R=max(16, triton.next_power_of_2(r)), PRECISION=_precision(b.dtype))
