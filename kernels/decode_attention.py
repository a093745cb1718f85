"""Paged decode attention (one query token per sequence), flash-decoding style.

Contract
--------
``paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale,
*, num_splits=None, max_seq_len=None, order=None, sliding_window=None) -> out``

* ``q``: ``[batch, num_heads, head_dim]`` fp16 / bf16 / fp32; dims 0/1 may be
  strided, the last dim must be contiguous. It is the newest token of each
  sequence; its K/V must already be in the cache (see ``store_kvcache``).
* ``k_cache``, ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``,
  contiguous, the dtype of ``q`` or ``float8_e4m3fn`` (an FP8 cache, scale 1: values are
  read as they are; with a 16-bit q both dots take fp16 operands, the cache values exactly,
  q and the softmax weights rounded to fp16; scores and sums stay fp32). ``head_dim`` is a power of two in [16, 256];
  ``num_heads`` is a multiple of ``num_kv_heads`` (GQA; q head ``h`` reads KV
  head ``h // (num_heads // num_kv_heads)``).
* ``block_tables``: ``[batch, max_num_blocks]`` int32, last dim contiguous.
  Only the first ``ceil(seq_lens[b] / block_size)`` entries of row ``b`` are
  read; the rest may hold anything (-1, 0, ...). With a sliding window, the
  entries of the blocks wholly before the window (every position
  ``< seq_lens[b] - sliding_window``) are not read either: they may hold anything
  too (the engine frees those blocks).
* ``seq_lens``: ``[batch]`` int32, context length including the new token.
  A sequence with ``seq_len <= 0`` (e.g. CUDA-graph padding) gets zeros.
* ``scale``: softmax scale (usually ``head_dim ** -0.5``).
* ``order``: optional ``[batch]`` int32 on q's device, a permutation of
  ``range(batch)`` (not checked on the device: a repeated or missing row leaves
  rows of ``out`` unwritten): the order in which programs take the sequences. Longest
  first (nvray's ``AttentionMetadata.decode_order``) keeps a ragged batch's long sequences from finishing
  alone at the end of the grid. It changes no result; None takes row order.
* ``sliding_window``: None or 0 for full causal attention; ``W >= 1``: local
  attention as Gemma 3's local layers / Mistral (HF transformers): the query at
  position ``p = seq_lens[b] - 1`` attends to positions ``p - W < k <= p``
  only (the last ``W`` positions, itself included).
* returns ``[batch, num_heads, head_dim]`` contiguous, dtype of ``q``; softmax
  and accumulation in fp32.

Algorithm: grid ``(num_kv_heads, batch, num_splits)`` (the hardware starts
programs with dim 0 fastest in practice, so the sequences start in ``order``). Each program owns one KV
head of one sequence and one contiguous range of ``tokens_per_split`` context
positions, counted from the sequence's walk start ``base`` (0 without a window;
with window ``W``: ``max(0, seq_len - W)`` rounded down to ``BLOCK_N``, so the
walk never touches a cache block, nor its block-table entry, that lies wholly
before the window; positions of the first tile below the window are masked out
of the loads); it loads the ``group = num_heads // num_kv_heads`` q heads that share
that KV head as the rows of one ``tl.dot`` tile (padded to >= 16 rows), so each
K/V tile is read once per group. It walks its range in tiles of ``BLOCK_N``
tokens, translating each position through the block table (a tile may span
several cache blocks, or lie inside one), with an online softmax in fp32. With
one split the program normalises and writes ``out`` directly; otherwise it
writes the un-normalised partial output plus its running max / sum, and a
second kernel (grid ``(batch, num_heads)``) merges the splits.

Split heuristic (no host sync, CUDA-graph friendly): the longest possible
context is taken as ``max_seq_len`` if given, else
``block_tables.shape[1] * block_size`` (in a CUDA graph: ``max_model_len``, far
above most contexts); with a window ``W`` the longest walk is
``min(that, W + BLOCK_N - 1)`` positions, and the splits cut that walk, not the
whole context. With at least ``_SPLIT_BELOW_PAIRS_PER_SM * SM count``
(sequence, KV head) pairs there is one split. With fewer, every sequence is cut
into pieces of ``_SPLIT_TOKENS`` tokens (``_SPLIT_TOKENS_FEW`` below one pair
per SM), so a sequence's actual context, not the bound, sets how many programs
work on it; above ``_MAX_SPLITS`` pieces of the bound (32,768 tokens, 16,384
for the smaller pieces) the pieces grow to ``bound / _MAX_SPLITS``. A split never covers fewer than
``_MIN_TILES_PER_SPLIT * BLOCK_N`` tokens and there are at most
``_MAX_SPLITS``. ``num_splits`` overrides the heuristic (still rounded so that
every split covers a whole number of tiles). Splits that start past a
sequence's walk exit at once and are ignored by the merge.

``paged_decode_attention_ref`` is the pure-torch reference, same signature.
``decode_scratch_bytes`` says how much split scratch a call of given shapes allocates (for the
CUDA-graph memory estimate).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = ["decode_scratch_bytes", "paged_decode_attention"]

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 64
_MIN_TILES_PER_SPLIT = 4
# Below this many (sequence, KV head) pairs per SM, sequences are split into fixed-size pieces.
# Swept on an H100 with ragged contexts of 800-2,048 tokens (900-2,048 at 32 sequences) under a 4,096-token bound: 32
# sequences of 8 KV heads read an e4m3 cache at 1.43 TB/s in 512-token pieces against 0.85
# with the bound-sized split of before, 12 sequences at 1.14 against 0.55 in 256-token
# pieces (bf16: 2.04 against 1.81, 1.54-1.66 against 1.26); from 64 sequences up one
# split was as fast as any.
_SPLIT_BELOW_PAIRS_PER_SM = 4
_SPLIT_TOKENS = 512
_SPLIT_TOKENS_FEW = 256  # fewer pairs than SMs
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _decode_split_kernel(
    q_ptr,  # [B, H, D]
    k_cache_ptr,  # [NB, BS, Hkv, D] contiguous
    v_cache_ptr,  # [NB, BS, Hkv, D] contiguous
    block_tables_ptr,  # [B, MAXB] int32
    seq_lens_ptr,  # [B] int32
    order_ptr,  # [B] int32, sequence of each program row (when ORDERED)
    out_ptr,  # [B, H, D]              (written when SINGLE_SPLIT)
    part_o_ptr,  # [B, H, S, D] fp32    (written otherwise)
    part_ml_ptr,  # [B, H, S, 2] fp32   (running max (log2 domain), running sum)
    scale_log2,  # softmax scale * log2(e)
    tokens_per_split,  # multiple of BLOCK_N
    num_splits,  # S
    window,  # sliding window W (> 0; read only when HAS_WINDOW)
    stride_qb,
    stride_qh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_btb,
    stride_sl,
    stride_ob,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # q heads per kv head
    BLOCK_G: tl.constexpr,  # max(16, next_pow2(GROUP))
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,  # cache block_size
    BLOCK_N: tl.constexpr,  # context tokens per inner tile
    SINGLE_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs
    FP8_AS_F16: tl.constexpr,  # an e4m3 cache with 16-bit q: both dots in fp16 (one cvt a pair)
    ORDERED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,  # attend to the last `window` positions only
):
    kvh = tl.program_id(0)
    b = tl.program_id(1)
    if ORDERED:
        b = tl.load(order_ptr + b)
    sp = tl.program_id(2)
    b64 = b.to(tl.int64)

    seq_len = tl.load(seq_lens_ptr + b64 * stride_sl)
    if HAS_WINDOW:
        # first visible position, and the walk start: a tile boundary at or below it. Blocks
        # (and block-table entries) wholly below `lo` may be freed: never read them.
        lo = tl.maximum(seq_len - window, 0)
        base = (lo // BLOCK_N) * BLOCK_N
    else:
        lo = 0
        base = 0
    start = base + sp * tokens_per_split
    if not SINGLE_SPLIT:
        if start >= seq_len:
            return  # empty split: the merge kernel ignores it
    end = tl.minimum(start + tokens_per_split, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    g_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g  # [BLOCK_G]
    q = tl.load(
        q_ptr + b64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None],
        other=0.0,
    )  # [BLOCK_G, D]
    if FP8_AS_F16:
        q = q.to(tl.float16)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)

    bt_row = block_tables_ptr + b64 * stride_btb
    head_off = kvh.to(tl.int64) * stride_ch
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)  # context positions [BLOCK_N]
        n_mask = offs_n < end
        if HAS_WINDOW:
            n_mask = n_mask & (offs_n >= lo)  # only the walk's first tile holds such positions
        blk = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_off = blk * stride_cb + (offs_n % PAGE_SIZE) * stride_ct + head_off  # [BLOCK_N]
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=n_mask[:, None],
                    other=0.0).to(q.dtype)  # e4m3 -> fp16: exact, one instruction per pair
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_G, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        # every tile holds >= 1 valid position (the first one `lo`), so m_new is finite
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=n_mask[:, None],
                    other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if SINGLE_SPLIT:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # seq_len <= 0 -> zeros
        o = acc / l_safe[:, None]
        tl.store(
            out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None],
        )
    else:
        row = (b64 * NUM_HEADS + heads) * num_splits + sp  # [BLOCK_G]
        tl.store(part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=g_mask)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_mask)


@triton.jit
def _decode_merge_kernel(
    part_o_ptr,  # [B, H, S, D] fp32
    part_ml_ptr,  # [B, H, S, 2] fp32
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [B, H, D]
    tokens_per_split,
    num_splits,
    window,  # read only when HAS_WINDOW
    stride_sl,
    stride_ob,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,  # next_pow2(num_splits)
    BLOCK_N: tl.constexpr,  # the split kernel's tile (its walk starts on one)
    HAS_WINDOW: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    b64 = b.to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b64 * stride_sl)
    if HAS_WINDOW:
        base = (tl.maximum(seq_len - window, 0) // BLOCK_N) * BLOCK_N  # as the split kernel's
    else:
        base = 0
    n_valid = tl.cdiv(seq_len - base, tokens_per_split)  # splits that hold >= 1 position
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = (offs_s < n_valid) & (offs_s < num_splits)
    row = (b64 * NUM_HEADS + h) * num_splits + offs_s  # [BLOCK_S]
    m = tl.load(part_ml_ptr + row * 2, mask=s_mask, other=float("-inf"))
    l = tl.load(part_ml_ptr + row * 2 + 1, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # no valid split (seq_len <= 0)
    w = tl.where(s_mask, tl.exp2(m - m_max), 0.0)  # [BLOCK_S]
    l_tot = tl.sum(w * l, 0)
    o = tl.load(part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    acc = tl.sum(o * w[:, None], 0)  # [D]
    acc = acc / tl.where(l_tot > 0.0, l_tot, 1.0)
    tl.store(out_ptr + b64 * stride_ob + h * stride_oh + offs_d, acc.to(out_ptr.dtype.element_ty))


_INTERPRET = not isinstance(_decode_split_kernel, triton.runtime.jit.JITFunction)


# ----------------------------------------------------------------------------
# validation helpers (shared with prefill_attention)
# ----------------------------------------------------------------------------


def _check_kernel_device(name: str, t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not _INTERPRET:
        raise ValueError(
            f"{name}: expected a CUDA tensor, got device {t.device} "
            f"(CPU tensors need TRITON_INTERPRET=1 set before the kernels are imported)"
        )


def _check_int_vector(name: str, t: torch.Tensor, length: int, device: torch.device) -> None:
    if t.dim() != 1 or t.shape[0] != length:
        raise ValueError(f"{name}: expected shape [{length}], got {tuple(t.shape)}")
    if t.dtype != torch.int32:
        raise ValueError(f"{name}: expected dtype torch.int32, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device} (same as q), got {t.device}")


def _validate_q_cache_tables(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    batch: int,
) -> tuple[int, int, int, int]:
    """Checks shared by decode and prefill. Returns (num_heads, num_kv_heads, head_dim, block_size)."""
    if q.dim() != 3:
        raise ValueError(f"q: expected 3 dims [tokens, num_heads, head_dim], got shape {tuple(q.shape)}")
    if q.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"q: expected dtype float16, bfloat16 or float32, got {q.dtype}")
    if q.shape[2] > 1 and q.stride(2) != 1:
        raise ValueError(f"q: expected a contiguous last dim (stride 1), got strides {q.stride()}")
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache: expected 4 dims [num_blocks, block_size, num_kv_heads, head_dim], got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: expected shape {tuple(k_cache.shape)} (same as k_cache), got {tuple(v_cache.shape)}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dtype not in (q.dtype, torch.float8_e4m3fn):
            raise ValueError(f"{name}: expected dtype {q.dtype} (same as q) or "
                             f"torch.float8_e4m3fn, got {c.dtype}")
        if not c.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {c.stride()}")
        if c.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (same as q), got {c.device}")
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    if q.shape[2] != head_dim:
        raise ValueError(f"q: expected head_dim {head_dim} (k_cache dim 3), got {q.shape[2]}")
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"k_cache: expected head_dim to be a power of two in [16, 256], got {head_dim}")
    if block_size < 1:
        raise ValueError(f"k_cache: expected block_size (dim 1) >= 1, got {block_size}")
    if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
        raise ValueError(f"q: expected num_heads (dim 1) to be a multiple of num_kv_heads={num_kv_heads}, got {num_heads}")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables: expected shape [{batch}, max_num_blocks], got {tuple(block_tables.shape)}")
    if block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables: expected dtype torch.int32, got {block_tables.dtype}")
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
        raise ValueError(f"block_tables: expected a contiguous last dim (stride 1), got strides {block_tables.stride()}")
    if block_tables.device != q.device:
        raise ValueError(f"block_tables: expected device {q.device} (same as q), got {block_tables.device}")
    _check_int_vector("seq_lens", seq_lens, batch, q.device)
    return num_heads, num_kv_heads, head_dim, block_size


def _check_window(sliding_window: int | None) -> int:
    """The window as an int, 0 for none (None or 0: full causal attention)."""
    if sliding_window is None:
        return 0
    if isinstance(sliding_window, bool) or int(sliding_window) != sliding_window or sliding_window < 0:
        raise ValueError(f"sliding_window: expected None or an int >= 0, got {sliding_window!r}")
    return int(sliding_window)


def _window_walk(max_ctx: int, window: int, block_n: int) -> int:
    """The longest walk of a decode program's sequence: its whole context without a window,
    else the window plus the part of its first tile below it."""
    return min(max_ctx, window + block_n - 1) if window else max_ctx


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: small, so that tests exercise several splits
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _decode_config(head_dim: int, kv_itemsize: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the split kernel.

    An e4m3 cache moves half the bytes a tile, so it needs deeper pipelines to keep as many
    bytes in flight: one warp on 32-token tiles, six stages. Swept on both GPUs (Qwen3-0.6B and
    8B heads, batch 32-256, 512-1500 tokens): on an H200 2.92-3.41 TB/s at batch 256 against
    2.56-2.75 with three stages, and 3.2 against 2.26 at batch 128; on an H100 the same as three
    stages at batch 128-256 (2.2-2.6 TB/s) and better below (1.12 against 0.65 at batch 32).
    Eight or ten stages, two warps or 64-token tiles were no better on either. bf16 keeps
    64-token tiles on four warps (2.7-2.9 TB/s on an H100, 3.8-4.3 on an H200)."""
    if _INTERPRET:
        return 32, 4, 1
    if kv_itemsize == 1:
        return 32, 1, 6
    return (64 if head_dim <= 128 else 32), 4, 3


def _choose_splits(
    batch: int, num_kv_heads: int, max_ctx: int, block_n: int, n_sm: int, num_splits: int | None
) -> tuple[int, int]:
    """Returns (num_splits, tokens_per_split); tokens_per_split is a multiple of block_n."""
    max_ctx = max(int(max_ctx), 1)
    n_tiles = triton.cdiv(max_ctx, block_n)
    if num_splits is None:
        pairs = batch * num_kv_heads
        if pairs >= _SPLIT_BELOW_PAIRS_PER_SM * n_sm:
            num_splits = 1
        else:
            piece = _SPLIT_TOKENS_FEW if pairs < n_sm else _SPLIT_TOKENS
            piece = max(piece, _MIN_TILES_PER_SPLIT * block_n)
            num_splits = min(triton.cdiv(max_ctx, piece), _MAX_SPLITS)
    num_splits = max(1, min(int(num_splits), n_tiles))
    tokens_per_split = triton.cdiv(n_tiles, num_splits) * block_n
    num_splits = triton.cdiv(max_ctx, tokens_per_split)
    return num_splits, tokens_per_split


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    block_tables: torch.Tensor,  # [B, MAXB] int32
    seq_lens: torch.Tensor,  # [B] int32, includes the new token
    scale: float,
    *,
    num_splits: int | None = None,  # override the split heuristic
    max_seq_len: int | None = None,  # host-side bound on max(seq_lens); default MAXB * BS
    order: torch.Tensor | None = None,  # [B] int32 permutation: programs take sequences in it
    sliding_window: int | None = None,  # W: attend to the last W positions; None/0: all
) -> torch.Tensor:  # [B, H, D], dtype of q
    """Attention of one new query token per sequence over its paged KV cache."""
    batch = q.shape[0] if q.dim() == 3 else -1
    num_heads, num_kv_heads, head_dim, block_size = _validate_q_cache_tables(
        q, k_cache, v_cache, block_tables, seq_lens, batch
    )
    if order is not None:
        _check_int_vector("order", order, batch, q.device)
        if batch > 1 and order.stride(0) != 1:
            raise ValueError(f"order: expected a contiguous tensor, got stride {order.stride(0)}")
    _check_kernel_device("q", q)
    if num_splits is not None and int(num_splits) < 1:
        raise ValueError(f"num_splits: expected None or an int >= 1, got {num_splits}")
    if max_seq_len is not None and int(max_seq_len) < 0:
        raise ValueError(f"max_seq_len: expected None or an int >= 0, got {max_seq_len}")
    window = _check_window(sliding_window)
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0 or num_heads == 0:
        return out

    group = num_heads // num_kv_heads
    block_g = max(16, triton.next_power_of_2(group))
    block_n, num_warps, num_stages = _decode_config(head_dim, k_cache.element_size())
    max_ctx = max_seq_len if max_seq_len is not None else block_tables.shape[1] * block_size
    n_splits, tokens_per_split = _choose_splits(
        batch, num_kv_heads, _window_walk(max_ctx, window, block_n), block_n, _num_sms(q.device),
        num_splits,
    )
    single = n_splits == 1
    if single:
        part_o = part_ml = out  # unused
    else:
        part_o = torch.empty((batch, num_heads, n_splits, head_dim), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((batch, num_heads, n_splits, 2), dtype=torch.float32, device=q.device)
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _decode_split_kernel[(num_kv_heads, batch, n_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, seq_lens if order is None else order,
        out, part_o, part_ml,
        float(scale) * _LOG2E, tokens_per_split, n_splits, max(window, 1),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), seq_lens.stride(0),
        out.stride(0), out.stride(1),
        NUM_HEADS=num_heads,
        GROUP=group,
        BLOCK_G=block_g,
        HEAD_DIM=head_dim,
        PAGE_SIZE=block_size,
        BLOCK_N=block_n,
        SINGLE_SPLIT=single,
        DOT_PRECISION=dot_precision,
        FP8_AS_F16=k_cache.dtype == torch.float8_e4m3fn and q.dtype != torch.float32,
        ORDERED=order is not None,
        HAS_WINDOW=window > 0,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if not single:
        _decode_merge_kernel[(batch, num_heads)](
            part_o, part_ml, seq_lens, out,
            tokens_per_split, n_splits, max(window, 1),
            seq_lens.stride(0), out.stride(0), out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_S=triton.next_power_of_2(n_splits),
            BLOCK_N=block_n,
            HAS_WINDOW=window > 0,
            num_warps=4 if head_dim >= 128 else 2,
        )
    return out


def decode_scratch_bytes(batch: int, num_heads: int, num_kv_heads: int, head_dim: int,
                         kv_itemsize: int, max_seq_len: int, device: torch.device,
                         sliding_window: int | None = None) -> int:
    """Bytes of the partial outputs that :func:`paged_decode_attention` allocates for these
    shapes (0 with one split): what a CUDA graph of a decode step holds besides activations.
    Below the split threshold the split count grows as the batch shrinks (up to
    ``_MAX_SPLITS``), so the total is largest just below the threshold. A sliding window
    splits only the window's walk (never more bytes than without it)."""
    block_n = _decode_config(head_dim, kv_itemsize)[0]
    walk = _window_walk(max_seq_len, _check_window(sliding_window), block_n)
    n_splits, _ = _choose_splits(batch, num_kv_heads, walk, block_n, _num_sms(device), None)
    return 0 if n_splits == 1 else batch * num_heads * n_splits * (head_dim + 2) * 4
