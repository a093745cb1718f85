"""Fused Mixture-of-Experts MLP (Qwen3-MoE style: SwiGLU experts, top-k routing) in two grouped
GEMMs.

Contract
--------
``fused_moe(x, w13, w2, topk_weights, topk_ids, *, w13_scale=None, w2_scale=None,
block_shape=None, skips_pairs=False) -> out``

* ``x``: ``[T, H]`` float32 / float16 / bfloat16, contiguous. ``T`` may be 0 (an empty result).
* ``w13``: ``[E, 2 * I, H]``, x's dtype, contiguous: per expert HF's ``gate_proj.weight``
  ``[I, H]`` stacked over ``up_proj.weight`` ``[I, H]``.
* ``w2``: ``[E, H, I]``, x's dtype, contiguous: per expert HF's ``down_proj.weight``.
* ``topk_weights``: ``[T, K]`` float32; ``topk_ids``: ``[T, K]`` int32 / int64 with values in
  ``[0, E)`` (not checked: that would take a host sync), or, with ``skips_pairs``, also ids
  outside it (another rank's experts under expert parallelism): those pairs add nothing.
* returns ``[T, H]`` in x's dtype: ``out[t] = Σ_k topk_weights[t, k] * w2[e] @ (silu(w13[e, :I]
  @ x[t]) * (w13[e, I:] @ x[t]))`` with ``e = topk_ids[t, k]``. Products are accumulated in
  float32; the activation ``silu(gate) * up`` is rounded once to x's dtype (it is the second
  GEMM's operand), the K weighted expert outputs are summed in float32 and rounded once.
* FP8 block-scaled weights (Qwen3-30B-A3B-FP8 / DeepSeek checkpoints): ``w13`` / ``w2``
  ``float8_e4m3fn`` with float32 ``w13_scale`` ``[E, ceil(2I / bn), ceil(H / bk)]`` and
  ``w2_scale`` ``[E, ceil(H / bn), ceil(I / bk)]`` (``weight ≈ q * scale`` per ``bn x bk``
  block; HF's ``weight_scale_inv``), ``block_shape = (bn, bk)``, ``bk`` 16, 32, 64, 128 or a
  multiple of 128. The activations stay in x's dtype: each weight tile is upcast exactly to
  x's dtype in the kernel and each K tile's partial product (inside one scale block) is
  multiplied by its column's scale in float32. All three are given, or none.
* No host-device synchronisation (CUDA-graph capturable): every buffer is sized by its upper
  bound from shapes alone, and programs whose block holds no tokens return at once.

Steps: :func:`moe_align` sorts the ``T * K`` (token, slot) pairs by expert into blocks of
``BLOCK_M`` rows (one expert a block); GEMM 1 (grid ``(blocks, cdiv(I, BLOCK_N))``) gathers each
block's x rows and computes its gate and up tiles in the same program, writing ``silu(gate) *
up`` to an intermediate ``[blocks * BLOCK_M, I]`` (x's dtype, padded positions); GEMM 2 (grid
``(blocks, cdiv(H, BLOCK_N))``) multiplies it by ``w2[e]^T``, scales each row by its routing
weight and writes it to the pair's row of a float32 ``[T * K, H]``; torch sums its K rows per
token (deterministic, no atomics). Tiles (``_config``, swept on an H100): ``BLOCK_M`` 16 / 32 /
64 / 128 for < 8 / <= 64 / <= 128 / more pairs per expert on average, ``BLOCK_N`` 32 to 128
(GEMM 1 holds two accumulators, gate and up), ``BLOCK_K`` 64 or 128 (FP8: 128 or 16 to 64 at
less than 128 per K scale block), 4 warps (8 at ``BLOCK_M`` 128). At Qwen3-30B-A3B's shapes
(E=128, K=8, H=2048, I=768, bf16, H100, graph-replayed) a call took 57 us at 1 token, 299 at
16, 466 at 256, 1217 at 4096 (2.6 TB/s of expert weights at 16 to 256 tokens, 254 TFLOP/s at
4096); with FP8 weights 47, 180, 404 and 1757 (upcasting the weight tiles in the kernel costs
more than the bytes it saves from ~1024 tokens on).
``fused_moe_ref`` is the pure-torch reference (a loop over the experts that have tokens, also
the CPU path of the model layer), same signature.

``moe_align(topk_ids, num_experts, block_m) -> (sorted_ids, expert_ids, num_post_padded)``

* ``topk_ids``: ``[T, K]`` int32 / int64 in ``[0, num_experts)``; ``block_m`` >= 1.
* ``sorted_ids``: int32 ``[num_blocks * block_m]``, the flat pair indices ``t * K + k`` grouped
  by expert in ascending expert order (ascending index within an expert), each expert's run
  padded to a multiple of ``block_m`` with the sentinel ``T * K``; positions past the end are
  the sentinel too. Experts without pairs get no block.
* ``expert_ids``: int32 ``[num_blocks]``, the expert of each block, -1 past the end.
* ``num_post_padded``: int32 ``[1]``, the number of valid (padded) positions, a multiple of
  ``block_m``.
* ``num_blocks = cdiv(n + min(n, E) * (block_m - 1), block_m)`` with ``n = T * K``, the upper
  bound from shapes alone. Three Triton launches, no host sync: a program per chunk of pairs
  counts its pairs per expert (and writes the sentinel over a share of ``sorted_ids``); one
  program turns the counts into the padded runs and each chunk's start in each run; a program
  per chunk puts each pair at its place (and writes a share of ``expert_ids``). 12 us at 1
  token, 22 to 25 at 16 to 1024, 50 at 4096 (H100, graph-replayed, E=128, K=8), where the
  torch ops of ``moe_align_ref`` took 48 to 150 us.

``moe_align_ref`` is its pure-torch reference (scatter_add, cumsum, stable argsort,
searchsorted; also free of host syncs), same signature and output; ``moe_align`` falls back to
it for CPU tensors outside the interpreter and past 1024 experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nvray.quantization.fp8_math import FP8_DTYPE

__all__ = ["fused_moe", "moe_align", "moe_align_ref"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --- align ---------------------------------------------------------------------------------------

def moe_num_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The number of ``block_m``-row blocks :func:`moe_align` allocates (an upper bound)."""
    return triton.cdiv(num_pairs + min(num_pairs, num_experts) * (block_m - 1), block_m)


def _check_align_args(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids: expected an int32/int64 [T, K] tensor, got {topk_ids.dtype} "
                         f"of shape {tuple(topk_ids.shape)}")
    if num_experts < 1:
        raise ValueError(f"num_experts: expected >= 1, got {num_experts}")
    if block_m < 1:
        raise ValueError(f"block_m: expected >= 1, got {block_m}")


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``T * K`` (token, slot) pairs sorted by expert into blocks of ``block_m`` rows (see the
    module docstring): three Triton launches, or :func:`moe_align_ref` on a CPU tensor outside
    the interpreter or past 1024 experts."""
    _check_align_args(topk_ids, num_experts, block_m)
    if num_experts > _ALIGN_MAX_EXPERTS or (topk_ids.device.type != "cuda" and not _INTERPRET):
        return moe_align_ref(topk_ids, num_experts, block_m)
    device, n = topk_ids.device, topk_ids.numel()
    num_blocks = moe_num_blocks(n, num_experts, block_m)
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=device)
    total = torch.empty(1, dtype=torch.int32, device=device)
    if n == 0:
        return sorted_ids, expert_ids, total.zero_()
    block_e = max(triton.next_power_of_2(num_experts), 16)
    chunk = min(max(8192 // block_e, 16), 256)  # a [CHUNK, BLOCK_E] one-hot of <= 8192 values
    rows = max(16384 // block_e, 16)
    num_chunks = triton.cdiv(n, chunk)
    ids = topk_ids.reshape(-1)
    offsets = torch.empty(num_chunks, block_e, dtype=torch.int32, device=device)
    pad_end = torch.empty(block_e, dtype=torch.int32, device=device)
    _align_count_kernel[(num_chunks,)](ids, offsets, sorted_ids, n, num_experts,
                                       num_blocks * block_m, BLOCK_E=block_e, CHUNK=chunk,
                                       FILL=1024, num_warps=4)
    _align_scan_kernel[(1,)](offsets, pad_end, total, num_chunks, BLOCK_M=block_m,
                             BLOCK_E=block_e, ROWS=rows, num_warps=8)
    _align_scatter_kernel[(num_chunks,)](ids, offsets, pad_end, total, sorted_ids, expert_ids, n,
                                         num_experts, num_blocks, BLOCK_M=block_m,
                                         BLOCK_E=block_e, CHUNK=chunk, num_warps=4)
    return sorted_ids, expert_ids, total


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-torch :func:`moe_align` (same contract and output; scatter_add, cumsum, stable
    argsort, searchsorted: no host sync either)."""
    _check_align_args(topk_ids, num_experts, block_m)
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    num_blocks = moe_num_blocks(n, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + (block_m - 1)) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    dest = pad_start[expert_of] + torch.arange(n, device=device) - count_start[expert_of]
    sorted_ids = torch.full((num_blocks * block_m,), n, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(num_blocks, device=device) * block_m
    expert_ids = torch.searchsorted(pad_end, starts, right=True)
    expert_ids = torch.where(starts < pad_end[-1], expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids, pad_end[-1:].to(torch.int32)


_ALIGN_MAX_EXPERTS = 1024


@triton.jit
def _one_hot(ids_ptr, pid, num_pairs, num_experts, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """This program's CHUNK pairs (their indices) and their experts as a [CHUNK, BLOCK_E] int32
    one-hot (all zero for padding lanes and ids outside [0, E), which are dropped)."""
    pair = pid * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + pair, mask=pair < num_pairs, other=-1).to(tl.int32)
    experts = tl.arange(0, BLOCK_E)
    hit = (e[:, None] == experts[None, :]) & (experts < num_experts)[None, :]
    return pair, hit.to(tl.int32)


@triton.jit
def _align_count_kernel(ids_ptr, counts_ptr, sorted_ptr, num_pairs, num_experts, sorted_len,
                        BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr):
    """Align 1/3, a program per CHUNK pairs: their count per expert (a row of counts), and the
    sentinel over a share of sorted_ids (the pairs' own entries overwrite it in step 3)."""
    pid = tl.program_id(0)
    _, onehot = _one_hot(ids_ptr, pid, num_pairs, num_experts, BLOCK_E, CHUNK)
    tl.store(counts_ptr + pid * BLOCK_E + tl.arange(0, BLOCK_E), tl.sum(onehot, axis=0))
    sentinel = tl.full([FILL], 0, dtype=tl.int32) + num_pairs
    for p0 in range(pid * FILL, sorted_len, tl.num_programs(0) * FILL):
        pos = p0 + tl.arange(0, FILL)
        tl.store(sorted_ptr + pos, sentinel, mask=pos < sorted_len)


@triton.jit
def _align_scan_kernel(counts_ptr, pad_end_ptr, total_ptr, num_chunks, BLOCK_M: tl.constexpr,
                       BLOCK_E: tl.constexpr, ROWS: tl.constexpr):
    """Align 2/3, one program: the experts' padded runs (their ends, the total), then each
    chunk's row of counts replaced in place by where its pairs of each expert start (the run's
    start plus the expert's pairs in earlier chunks)."""
    experts = tl.arange(0, BLOCK_E)
    rows = tl.arange(0, ROWS)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for r0 in range(0, num_chunks, ROWS):
        r = r0 + rows
        tile = counts_ptr + r[:, None] * BLOCK_E + experts[None, :]
        counts += tl.sum(tl.load(tile, mask=(r < num_chunks)[:, None], other=0), axis=0)
    padded = (counts + (BLOCK_M - 1)) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, axis=0)
    tl.store(pad_end_ptr + experts, pad_end)
    tl.store(total_ptr, tl.sum(padded, axis=0))
    start = pad_end - padded
    for r0 in range(0, num_chunks, ROWS):
        r = r0 + rows
        tile = counts_ptr + r[:, None] * BLOCK_E + experts[None, :]
        c = tl.load(tile, mask=(r < num_chunks)[:, None], other=0)
        tl.store(tile, tl.cumsum(c, axis=0) - c + start[None, :], mask=(r < num_chunks)[:, None])
        start += tl.sum(c, axis=0)


@triton.jit
def _align_scatter_kernel(ids_ptr, offsets_ptr, pad_end_ptr, total_ptr, sorted_ptr,
                          expert_ids_ptr, num_pairs, num_experts, num_blocks,
                          BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """Align 3/3, a program per CHUNK pairs: each pair to its expert's start for the chunk plus
    the chunk's earlier pairs of that expert; and the expert of a share of the blocks."""
    pid = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    pair, onehot = _one_hot(ids_ptr, pid, num_pairs, num_experts, BLOCK_E, CHUNK)
    start = tl.load(offsets_ptr + pid * BLOCK_E + experts)
    earlier = tl.cumsum(onehot, axis=0) - onehot
    dest = tl.sum(onehot * (earlier + start[None, :]), axis=1)
    in_range = (dest >= 0) & (dest < num_blocks * BLOCK_M)  # see _safe_indices
    tl.store(sorted_ptr + dest, pair, mask=(tl.sum(onehot, axis=1) > 0) & in_range)
    pad_end = tl.load(pad_end_ptr + experts)
    total = tl.load(total_ptr)
    for b0 in range(pid * CHUNK, num_blocks, tl.num_programs(0) * CHUNK):
        block = b0 + tl.arange(0, CHUNK)
        first = block * BLOCK_M
        owner = tl.sum((pad_end[None, :] <= first[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + block, tl.where(first < total, owner, -1),
                 mask=block < num_blocks)


# --- kernels -------------------------------------------------------------------------------------
# _safe_indices: the kernels that index memory with what an earlier kernel computed (pairs, expert
# ids, scatter destinations) drop indices out of range rather than trust them. Valid align output
# never has any; but start-up's compile-ahead rehearsal (nvray/worker/compile_ahead.py) skips the
# launches of kernels not yet compiled, leaving their outputs as whatever memory held, and a
# kernel downstream must not fault on that (an illegal address seen once on an H100 start-up of
# the Qwen3-30B-A3B shape with FP8 experts).

@triton.jit
def _dot(a, w, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``a @ w`` in float32 (``w`` may be FP8: upcast exactly to a's dtype first). DOT_F32: both
    operands as float32 (x float32, or bfloat16 under the interpreter, whose bf16 dot is
    wrong)."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision=DOT_PRECISION)
    else:
        return tl.dot(a, w.to(a.dtype))


@triton.jit
def _moe_gemm1_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, sorted_ptr, expert_ptr, total_ptr,
                      num_pairs, num_experts, H, I, stride_xt, stride_we, stride_wn, stride_wse, stride_wsn,
                      stride_om, TOPK: tl.constexpr, FP8_W: tl.constexpr, BN_SCALE: tl.constexpr,
                      BK_SCALE: tl.constexpr, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    if (e < 0) | (e >= num_experts):  # (an expert id never out of range: see _safe_indices)
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m)
    mask_m = (pair >= 0) & (pair < num_pairs)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = x_ptr + (pair // TOPK).to(tl.int64)[:, None] * stride_xt
    w_e = w_ptr + e * stride_we
    gate_cols = w_e + offs_n.to(tl.int64)[None, :] * stride_wn
    up_cols = w_e + (offs_n + I).to(tl.int64)[None, :] * stride_wn
    if FP8_W:
        ws_e = ws_ptr + e * stride_wse
        gate_scales = ws_e + (offs_n // BN_SCALE).to(tl.int64) * stride_wsn
        up_scales = ws_e + ((offs_n + I) // BN_SCALE).to(tl.int64) * stride_wsn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        mask_k = k0 + offs_k < H
        a = tl.load(a_rows + (k0 + offs_k)[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0)
        w_mask = mask_n[None, :] & mask_k[:, None]
        w_gate = tl.load(gate_cols + (k0 + offs_k)[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(up_cols + (k0 + offs_k)[:, None], mask=w_mask, other=0.0)
        if FP8_W:  # the K tile lies inside one scale block: scale its partial product
            s_gate = tl.load(gate_scales + k0 // BK_SCALE, mask=mask_n, other=0.0)
            s_up = tl.load(up_scales + k0 // BK_SCALE, mask=mask_n, other=0.0)
            acc_gate += _dot(a, w_gate, DOT_F32, DOT_PRECISION) * s_gate[None, :]
            acc_up += _dot(a, w_up, DOT_F32, DOT_PRECISION) * s_up[None, :]
        else:
            acc_gate += _dot(a, w_gate, DOT_F32, DOT_PRECISION)
            acc_up += _dot(a, w_up, DOT_F32, DOT_PRECISION)
    act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, act.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _moe_gemm2_kernel(a_ptr, w_ptr, ws_ptr, out_ptr, sorted_ptr, expert_ptr, total_ptr,
                      topk_w_ptr, num_pairs, num_experts, H, I, stride_am, stride_we, stride_wn, stride_wse,
                      stride_wsn, stride_om, FP8_W: tl.constexpr, BN_SCALE: tl.constexpr,
                      BK_SCALE: tl.constexpr, DOT_F32: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    if (e < 0) | (e >= num_experts):  # (an expert id never out of range: see _safe_indices)
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m)
    mask_m = (pair >= 0) & (pair < num_pairs)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    w_cols = w_ptr + e * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn
    if FP8_W:
        w_scales = ws_ptr + e * stride_wse + (offs_n // BN_SCALE).to(tl.int64) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        mask_k = k0 + offs_k < I
        a = tl.load(a_rows + (k0 + offs_k)[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0)
        w = tl.load(w_cols + (k0 + offs_k)[:, None], mask=mask_n[None, :] & mask_k[:, None],
                    other=0.0)
        if FP8_W:
            s = tl.load(w_scales + k0 // BK_SCALE, mask=mask_n, other=0.0)
            acc += _dot(a, w, DOT_F32, DOT_PRECISION) * s[None, :]
        else:
            acc += _dot(a, w, DOT_F32, DOT_PRECISION)
    acc = acc * tl.load(topk_w_ptr + pair, mask=mask_m, other=0.0)[:, None]
    out = out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc, mask=mask_m[:, None] & mask_n[None, :])


_INTERPRET = not isinstance(_moe_gemm1_kernel, triton.runtime.jit.JITFunction)


# --- launchers -----------------------------------------------------------------------------------

def _check_args(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, w13_scale: torch.Tensor | None,
                w2_scale: torch.Tensor | None, block_shape: tuple[int, int] | None) -> bool:
    """Validates the arguments (``ValueError`` naming the argument); True for FP8 weights."""
    if x.dim() != 2 or x.dtype not in _FLOAT_DTYPES or not x.is_contiguous():
        raise ValueError(f"x: expected a contiguous float32/float16/bfloat16 [T, H] tensor, got "
                         f"{x.dtype} of shape {tuple(x.shape)} strides {x.stride()}")
    t, h = x.shape
    fp8 = w13_scale is not None or w2_scale is not None or block_shape is not None
    for name, arg in (("w13_scale", w13_scale), ("w2_scale", w2_scale),
                      ("block_shape", block_shape)):
        if fp8 and arg is None:
            raise ValueError(f"{name}: FP8 weights need w13_scale, w2_scale and block_shape, "
                             f"{name} is None")
    w_dtype = FP8_DTYPE if fp8 else x.dtype
    if (w13.dim() != 3 or w13.shape[1] % 2 or w13.shape[2] != h or w13.dtype != w_dtype
            or not w13.is_contiguous()):
        raise ValueError(f"w13: expected a contiguous {w_dtype} [E, 2 * I, H={h}] tensor, got "
                         f"{w13.dtype} of shape {tuple(w13.shape)}")
    e, inter = w13.shape[0], w13.shape[1] // 2
    if (tuple(w2.shape) != (e, h, inter) or w2.dtype != w_dtype or not w2.is_contiguous()):
        raise ValueError(f"w2: expected a contiguous {w_dtype} [E={e}, H={h}, I={inter}] tensor, "
                         f"got {w2.dtype} of shape {tuple(w2.shape)}")
    if topk_weights.dim() != 2 or topk_weights.shape[0] != t or topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights: expected a float32 [T={t}, K] tensor, got "
                         f"{topk_weights.dtype} of shape {tuple(topk_weights.shape)}")
    if (topk_ids.dim() != 2 or tuple(topk_ids.shape) != tuple(topk_weights.shape)
            or topk_ids.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"topk_ids: expected an int32/int64 tensor of topk_weights' shape "
                         f"{tuple(topk_weights.shape)}, got {topk_ids.dtype} of shape "
                         f"{tuple(topk_ids.shape)}")
    if fp8:
        bn, bk = tuple(block_shape) if len(block_shape) == 2 else (0, 0)
        if bn < 1 or not ((16 <= bk <= 128 and bk & (bk - 1) == 0) or bk % 128 == 0):
            raise ValueError(f"block_shape: expected (bn, bk) with bk 16, 32, 64, 128 or a "
                             f"multiple of 128, got {block_shape}")
        for name, scale, rows, cols in (("w13_scale", w13_scale, 2 * inter, h),
                                        ("w2_scale", w2_scale, h, inter)):
            want = (e, triton.cdiv(rows, bn), triton.cdiv(cols, bk))
            if (tuple(scale.shape) != want or scale.dtype != torch.float32
                    or not scale.is_contiguous()):
                raise ValueError(f"{name}: expected a contiguous float32 {want} tensor, got "
                                 f"{scale.dtype} of shape {tuple(scale.shape)}")
    tensors = [("w13", w13), ("w2", w2), ("topk_weights", topk_weights), ("topk_ids", topk_ids)]
    if fp8:
        tensors += [("w13_scale", w13_scale), ("w2_scale", w2_scale)]
    for name, arg in tensors:
        if arg.device != x.device:
            raise ValueError(f"{name}: expected x's device {x.device}, got {arg.device}")
    return fp8


def _config(num_pairs: int, num_experts: int, dtype: torch.dtype, fp8: bool = False
            ) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N of GEMM 1, BLOCK_N of GEMM 2, BLOCK_K, num_warps, num_stages) for
    ``num_pairs`` (token, slot) pairs over ``num_experts``: blocks about as tall as an expert's
    average share of the pairs. The best of sweeps on an H100 at Qwen3-30B-A3B's shapes (E=128,
    K=8, H=2048, I=768, bf16 activations, graph-replayed; 2026-11-27; the bf16 sweep with a
    slower align step). bf16 weights: 1 token 16/32/32/64 (93 us against 111 for 16/64/64/64),
    256 tokens 32/64/64/128 (541 us against 580), 4096 tokens 128/128/128/64 with 8 warps (1316
    us against 1441 for 64/64/128/64).
    FP8 weights (K tiles of 128, the scale block): 1 token 16/32/32/128 (47 us), 64 tokens
    16/32/64/128 (267), 1024 and 4096 tokens 64/64/128/128 (602 and 1777 us against 753 and
    3173 for the bf16 weights' tiles); at decode batches of 128-256 tokens (up to 16 pairs per
    expert) 16/32/64/128 too: 0.415-0.475 ms a layer against 0.547-0.558 for 64-row tiles
    (2026-11-27 sweep, kernels' CUDA-event medians, one H100)."""
    per_expert = num_pairs / num_experts
    if fp8:
        config = (16, 32, 64, 128, 4, 3) if per_expert <= 16 else (64, 64, 128, 128, 4, 3)
    elif per_expert < 8:
        config = (16, 32, 32, 64, 4, 4)
    elif per_expert <= 64:
        config = (32, 64, 64, 128, 4, 3)
    elif per_expert <= 128:
        config = (64, 128, 128, 64, 4, 4)
    else:
        config = (128, 128, 128, 64, 8, 3)
    if dtype == torch.float32:  # twice the shared memory a stage
        config = (*config[:4], config[4], 2)
    return config


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None,
              block_shape: tuple[int, int] | None = None,
              skips_pairs: bool = False) -> torch.Tensor:
    """The routed experts' SwiGLU MLPs, weighted and summed per token (see the module
    docstring); ``skips_pairs``: some ids are outside ``[0, E)`` (experts of other ranks, under
    expert parallelism): those pairs add nothing."""
    fp8 = _check_args(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block_shape)
    if x.device.type != "cuda" and not _INTERPRET:
        raise ValueError(f"x: expected a CUDA tensor, got device {x.device} (CPU tensors need "
                         "TRITON_INTERPRET=1 set before triton kernels are imported)")
    (t, h), (e, inter), top_k = x.shape, (w13.shape[0], w13.shape[1] // 2), topk_ids.shape[1]
    num_pairs = t * top_k
    if num_pairs == 0 or h == 0 or inter == 0:
        return torch.zeros_like(x)
    block_m, block_n1, block_n2, block_k, num_warps, num_stages = _config(num_pairs, e, x.dtype,
                                                                          fp8)
    bn_scale, bk_scale = block_shape if fp8 else (1, 1)
    if fp8:
        block_k = min(block_k, bk_scale)  # each K tile inside one scale block
    sorted_ids, expert_ids, total = moe_align(topk_ids, e, block_m)
    num_blocks = expert_ids.numel()
    dot_f32 = x.dtype == torch.float32 or (_INTERPRET and x.dtype == torch.bfloat16)
    dot_precision = "ieee" if dot_f32 else "tf32"  # (tf32: unused, the operands are 16-bit)
    ws13 = w13_scale if fp8 else x  # a placeholder pointer, never read
    ws2 = w2_scale if fp8 else x
    ws13_strides = (w13_scale.stride(0), w13_scale.stride(1)) if fp8 else (0, 0)
    ws2_strides = (w2_scale.stride(0), w2_scale.stride(1)) if fp8 else (0, 0)

    inter_cache = torch.empty(num_blocks * block_m, inter, dtype=x.dtype, device=x.device)
    _moe_gemm1_kernel[(num_blocks, triton.cdiv(inter, block_n1))](
        x, w13, ws13, inter_cache, sorted_ids, expert_ids, total, num_pairs, e, h, inter,
        x.stride(0), w13.stride(0), w13.stride(1), *ws13_strides, inter_cache.stride(0),
        TOPK=top_k, FP8_W=fp8, BN_SCALE=bn_scale, BK_SCALE=bk_scale, DOT_F32=dot_f32,
        DOT_PRECISION=dot_precision, BLOCK_M=block_m, BLOCK_N=block_n1, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages)

    # skips_pairs: a pair whose id is outside [0, E) (another rank's expert) is never written
    per_pair = (torch.zeros if skips_pairs else torch.empty)(num_pairs, h, dtype=torch.float32,
                                                             device=x.device)
    _moe_gemm2_kernel[(num_blocks, triton.cdiv(h, block_n2))](
        inter_cache, w2, ws2, per_pair, sorted_ids, expert_ids, total,
        topk_weights.reshape(-1), num_pairs, e, h, inter, inter_cache.stride(0), w2.stride(0),
        w2.stride(1), *ws2_strides, per_pair.stride(0), FP8_W=fp8, BN_SCALE=bn_scale,
        BK_SCALE=bk_scale, DOT_F32=dot_f32, DOT_PRECISION=dot_precision, BLOCK_M=block_m,
        BLOCK_N=block_n2, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    return per_pair.view(t, top_k, h).sum(dim=1).to(x.dtype)
