"""Paged prefill attention: variable-length query chunks over a paged KV prefix.

Contract
--------
``paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q,
seq_lens, max_seqlen_q, scale, *, sliding_window=None) -> out``

* ``q``: ``[total_q_tokens, num_heads, head_dim]`` fp16 / bf16 / fp32; dims 0/1
  may be strided, last dim contiguous. Sequence ``b`` owns rows
  ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]`` (``qlen_b`` rows, possibly 1).
* ``k_cache``, ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``,
  contiguous, the dtype of ``q`` or ``float8_e4m3fn`` (read as in decode_attention.py);
  ``head_dim`` a power of two in [16, 256];
  ``num_heads`` a multiple of ``num_kv_heads``.
* ``block_tables``: ``[batch, max_num_blocks]`` int32 (last dim contiguous);
  only the first ``ceil(seq_lens[b] / block_size)`` entries are read. With a
  sliding window ``W``, neither are the entries (nor the blocks) whose positions
  all lie before the window of the sequence's first query row (all
  ``< seq_lens[b] - qlen_b - W + 1``): they may hold anything (the engine frees
  those blocks).
* ``cu_seqlens_q``: ``[batch + 1]`` int32, ``cu_seqlens_q[0] == 0``,
  non-decreasing, ``cu_seqlens_q[batch] == total_q_tokens`` (not checked on the
  device: that would need a host sync).
* ``seq_lens``: ``[batch]`` int32, the whole context length of each sequence
  INCLUDING its new query tokens, whose K/V must already be in the cache;
  ``seq_lens[b] >= qlen_b``.
* ``max_seqlen_q``: host int, ``>= max_b qlen_b`` (sizes the grid).
* query row ``i`` of sequence ``b`` sits at position ``p = seq_lens[b] - qlen_b + i``
  and attends causally to cache positions ``0 .. p``; with ``sliding_window=W``
  (``W >= 1``; None or 0: none) to positions ``p - W < k <= p`` only (Gemma 3's
  local layers, Mistral: HF transformers' sliding window).
* returns ``[total_q_tokens, num_heads, head_dim]`` contiguous, dtype of ``q``;
  online softmax with fp32 accumulation.

Algorithm: grid ``(cdiv(max_seqlen_q, BLOCK_Q), num_kv_heads, batch)``. A
program takes ``BLOCK_Q`` query tokens of one sequence and all
``group = num_heads // num_kv_heads`` q heads that share one KV head, flattened
into ``BLOCK_Q * next_pow2(group)`` rows of one ``tl.dot`` tile (row ``r`` is
token ``r // G_PAD``, head ``r % G_PAD``), so K/V are read once per group. It
walks the context from position 0 up to its last query position in tiles of
``BLOCK_N`` positions, translating positions through the block table. Tiles
wholly below the tile's first query position run unmasked; the remaining ones
(the diagonal) apply the causal mask ``key_pos <= query_pos``. Programs past
their sequence's query length exit at once.

With a window ``W`` a program's walk starts at its first query position's window
start, ``max(0, p0 - W + 1)``, rounded down to ``BLOCK_N`` (positions below that
start inside the first tile are masked out of the loads, so no block wholly
before the window is touched); tiles not visible in full to every row (the
window's lower edge) take the window mask ``key_pos > query_pos - W`` as well
as the causal one, and the tiles between run unmasked.

``paged_prefill_attention_ref`` is the pure-torch reference, same signature.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_attention import (_LOG2E, _check_int_vector, _check_kernel_device, _check_window,
                               _validate_q_cache_tables)

__all__ = ["paged_prefill_attention"]


@triton.jit
def _prefill_tile(
    q, m_i, l_i, acc, q_pos,
    k_cache_ptr, v_cache_ptr, bt_row, head_off, offs_d, n0, kv_lo, kv_end, window, scale_log2,
    stride_cb, stride_ct,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,  # False: every position of the tile is visible to every row
    DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,  # (MASKED only) apply the window mask; rows may be fully masked
):
    """One online-softmax step over context positions ``n0 .. n0 + BLOCK_N``."""
    offs_n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    if MASKED:
        n_mask = offs_n < kv_end
        if HAS_WINDOW:
            n_mask = n_mask & (offs_n >= kv_lo)  # never load a position before the tile's window
        blk = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + offs_n // PAGE_SIZE).to(tl.int64)
    kv_off = blk * stride_cb + (offs_n % PAGE_SIZE) * stride_ct + head_off
    kv_ptrs = kv_off[:, None] + offs_d[None, :]  # [BLOCK_N, D]
    if MASKED:
        k = tl.load(k_cache_ptr + kv_ptrs, mask=n_mask[:, None], other=0.0).to(q.dtype)
    else:
        k = tl.load(k_cache_ptr + kv_ptrs).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
    if MASKED:
        causal = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if HAS_WINDOW:
            causal = causal & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(causal, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if HAS_WINDOW:  # (passed only with MASKED)
        # a row may see nothing in this tile (its window starts further on), so m_new can
        # be -inf: exponentiate against 0 then (p == 0, alpha == 0 while l_i, acc are 0)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        # without a window position 0 is visible to every row (q_pos >= 0) and is in the
        # first tile, so m_i is finite from then on and fully masked rows get p == 0; with
        # one, unmasked tiles come after a row's first visible position
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_cache_ptr + kv_ptrs, mask=n_mask[:, None], other=0.0).to(q.dtype)
    else:
        v = tl.load(v_cache_ptr + kv_ptrs).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(
    q_ptr,  # [TQ, H, D]
    k_cache_ptr,  # [NB, BS, Hkv, D] contiguous
    v_cache_ptr,  # [NB, BS, Hkv, D] contiguous
    block_tables_ptr,  # [B, MAXB] int32
    cu_seqlens_q_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [TQ, H, D]
    scale_log2,  # softmax scale * log2(e)
    window,  # sliding window W (> 0; read only when HAS_WINDOW)
    stride_qt,
    stride_qh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_btb,
    stride_cu,
    stride_sl,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,  # q heads per kv head
    G_PAD: tl.constexpr,  # next_pow2(GROUP)
    BLOCK_Q: tl.constexpr,  # query tokens per program; BLOCK_Q * G_PAD >= 16
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,  # cache block_size
    BLOCK_N: tl.constexpr,  # context positions per inner tile
    DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    qt = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    b64 = b.to(tl.int64)

    q_start = tl.load(cu_seqlens_q_ptr + b64 * stride_cu)
    q_len = tl.load(cu_seqlens_q_ptr + (b64 + 1) * stride_cu) - q_start
    tile_q0 = qt * BLOCK_Q
    if tile_q0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b64 * stride_sl)
    ctx0 = seq_len - q_len  # position of query row 0 (= cached prefix length)

    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    t_idx = tile_q0 + offs_m // G_PAD  # query index within the sequence  [BLOCK_M]
    g_idx = offs_m % G_PAD  # head within the group                       [BLOCK_M]
    row_mask = (t_idx < q_len) & (g_idx < GROUP)
    heads = kvh * GROUP + g_idx
    tok = (q_start + t_idx).to(tl.int64)  # row in q / out
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_mask[:, None],
        other=0.0,
    )  # [BLOCK_M, D]
    q_pos = ctx0 + t_idx  # [BLOCK_M]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # last query position of this tile + 1 (never past seq_len)
    kv_end = tl.minimum(ctx0 + tl.minimum(tile_q0 + BLOCK_Q, q_len), seq_len)
    bt_row = block_tables_ptr + b64 * stride_btb
    head_off = kvh.to(tl.int64) * stride_ch
    # positions < ctx0 + tile_q0 (the tile's first query position) are visible
    # to every row: full tiles below it need no mask
    n_full = ((ctx0 + tile_q0) // BLOCK_N) * BLOCK_N
    if HAS_WINDOW:
        # the first query row sees positions >= kv_lo (no row of the tile sees fewer): the walk
        # starts on the tile boundary at or below it and never loads a position below it, so a
        # block wholly before the window (maybe freed) is never read. Positions >= kv_end - W
        # are in every row's window: from the first tile boundary at or above that on (up to
        # the diagonal), tiles need no mask; the ones before take the window mask.
        kv_lo = tl.maximum(ctx0 + tile_q0 - window + 1, 0)
        n_start = (kv_lo // BLOCK_N) * BLOCK_N
        n_win = tl.maximum(kv_end - window, 0)
        n_win = tl.minimum(((n_win + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, n_full)
        for n0 in range(n_start, n_win, BLOCK_N):
            m_i, l_i, acc = _prefill_tile(
                q, m_i, l_i, acc, q_pos, k_cache_ptr, v_cache_ptr, bt_row, head_off, offs_d, n0,
                kv_lo, kv_end, window, scale_log2, stride_cb, stride_ct, PAGE_SIZE, BLOCK_N, True,
                DOT_PRECISION, True,
            )
        n_win = tl.maximum(n_win, n_start)
    else:
        kv_lo = 0
        n_win = 0
    for n0 in range(n_win, n_full, BLOCK_N):
        m_i, l_i, acc = _prefill_tile(
            q, m_i, l_i, acc, q_pos, k_cache_ptr, v_cache_ptr, bt_row, head_off, offs_d, n0,
            kv_lo, kv_end, window, scale_log2, stride_cb, stride_ct, PAGE_SIZE, BLOCK_N, False,
            DOT_PRECISION, False,
        )
    for n0 in range(n_full, kv_end, BLOCK_N):  # n_start <= n_win <= n_full
        m_i, l_i, acc = _prefill_tile(
            q, m_i, l_i, acc, q_pos, k_cache_ptr, v_cache_ptr, bt_row, head_off, offs_d, n0,
            kv_lo, kv_end, window, scale_log2, stride_cb, stride_ct, PAGE_SIZE, BLOCK_N, True,
            DOT_PRECISION, HAS_WINDOW,
        )

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None],
    )


_INTERPRET = not isinstance(_prefill_kernel, triton.runtime.jit.JITFunction)


def _validate(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_q: int,
) -> tuple[int, int, int, int, int]:
    if seq_lens.dim() != 1:
        raise ValueError(f"seq_lens: expected shape [batch], got {tuple(seq_lens.shape)}")
    batch = seq_lens.shape[0]
    num_heads, num_kv_heads, head_dim, block_size = _validate_q_cache_tables(
        q, k_cache, v_cache, block_tables, seq_lens, batch
    )
    _check_int_vector("cu_seqlens_q", cu_seqlens_q, batch + 1, q.device)
    if isinstance(max_seqlen_q, bool) or int(max_seqlen_q) != max_seqlen_q or max_seqlen_q < 0:
        raise ValueError(f"max_seqlen_q: expected a host int >= 0, got {max_seqlen_q!r}")
    return batch, num_heads, num_kv_heads, head_dim, block_size


def _prefill_config(head_dim: int, group: int, max_seqlen_q: int) -> tuple[int, int, int, int]:
    """Returns (BLOCK_Q, BLOCK_N, num_warps, num_stages)."""
    g_pad = triton.next_power_of_2(group)
    if _INTERPRET:
        block_m, block_n, num_warps, num_stages = 32, 32, 4, 1
    elif head_dim <= 128:
        # measured on H100, bf16, head_dim 128, GQA 2: within ~10% of the best
        # of 36 configs on full prefill, chunked prefill and short-query cases
        block_m, block_n, num_warps, num_stages = 128, 64, 4, 3
    else:
        block_m, block_n, num_warps, num_stages = 64, 32, 4, 2
    block_q = max(1, block_m // g_pad)
    # short query chunks (prefix-cache hits, small chunks): shrink the tile
    block_q = min(block_q, triton.next_power_of_2(max(int(max_seqlen_q), 1)))
    block_q = max(block_q, triton.cdiv(16, g_pad))  # tl.dot needs >= 16 rows
    return block_q, block_n, num_warps, num_stages


def paged_prefill_attention(
    q: torch.Tensor,  # [TQ, H, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    block_tables: torch.Tensor,  # [B, MAXB] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32, includes the new query tokens
    max_seqlen_q: int,
    scale: float,
    *,
    sliding_window: int | None = None,  # W: each query sees its last W positions; None/0: all
) -> torch.Tensor:  # [TQ, H, D], dtype of q
    """Causal attention of variable-length query chunks over their paged contexts."""
    batch, num_heads, num_kv_heads, head_dim, block_size = _validate(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q
    )
    window = _check_window(sliding_window)
    _check_kernel_device("q", q)
    total_q = q.shape[0]
    out = torch.empty((total_q, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if total_q == 0 or batch == 0 or max_seqlen_q == 0 or num_heads == 0:
        return out
    group = num_heads // num_kv_heads
    block_q, block_n, num_warps, num_stages = _prefill_config(head_dim, group, max_seqlen_q)
    grid = (triton.cdiv(int(max_seqlen_q), block_q), num_kv_heads, batch)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out,
        float(scale) * _LOG2E, max(window, 1),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), cu_seqlens_q.stride(0), seq_lens.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group,
        G_PAD=triton.next_power_of_2(group),
        BLOCK_Q=block_q,
        HEAD_DIM=head_dim,
        PAGE_SIZE=block_size,
        BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        HAS_WINDOW=window > 0,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
