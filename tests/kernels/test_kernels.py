"""Kernels vs. their pure-torch references at small shapes.

Runs under ``TRITON_INTERPRET=1`` on CPU (set by conftest.py when there is no
GPU), or compiled on CUDA when a GPU is present. The attention kernels are
tested in fp32 and fp16: Triton 3.6's interpreter computes ``tl.dot`` on
bfloat16 operands as raw uint16 bits, so bf16 attention is covered by
tests/gpu/test_kernels_gpu.py instead; the store kernel (no dot) is tested in
bf16 here too.

Caches are filled with NaN and only positions < seq_len are written, and unused
block-table entries are -1: a kernel that reads a position past a sequence's
length, or an unused block-table entry, produces NaN (or faults).
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("triton")
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import kernel_refs  # noqa: E402
import kernels  # noqa: E402
from kernel_device import kernel_device  # noqa: E402
from kernels import decode_attention as _dec  # noqa: E402

INTERPRET, DEVICE = kernel_device()

TOL = {
    torch.float32: dict(atol=5e-5, rtol=1e-4),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(shape, dtype, g) -> torch.Tensor:
    return torch.randn(shape, generator=g).to(dtype=dtype, device=DEVICE)


def make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=0, extra_blocks=3):
    """NaN-filled caches holding random K/V at each sequence's positions < seq_len.

    Blocks are handed out in a random permutation; unused table entries are -1.
    Returns k_cache, v_cache, block_tables [B, max_blocks + 1] int32.
    """
    g = _gen(seed)
    nblk = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(nblk) + extra_blocks
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(nblk) + 1  # always at least one unused column
    block_tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    used = 0
    for b, n in enumerate(seq_lens):
        blocks = perm[used : used + nblk[b]]
        used += nblk[b]
        block_tables[b, : nblk[b]] = blocks.to(torch.int32)
        for pos in range(n):
            blk, off = int(blocks[pos // block_size]), pos % block_size
            k_cache[blk, off] = torch.randn(num_kv_heads, head_dim, generator=g).to(dtype)
            v_cache[blk, off] = torch.randn(num_kv_heads, head_dim, generator=g).to(dtype)
    return k_cache.to(DEVICE), v_cache.to(DEVICE), block_tables.to(DEVICE)


def _i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _cu(qlens) -> torch.Tensor:
    cu = [0]
    for n in qlens:
        cu.append(cu[-1] + n)
    return _i32(cu)


def _assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == ref.dtype == dtype
    assert out.shape == ref.shape
    assert not torch.isnan(out).any(), "kernel output has NaN (read an invalid cache position?)"
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


# ----------------------------------------------------------------------------
# store_kvcache
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(16, 2, 32), (32, 1, 16), (16, 3, 64)])
def test_store_kvcache(dtype, slot_dtype, block_size, num_kv_heads, head_dim):
    g = _gen(1)
    num_blocks, num_tokens = 6, 11
    # key/value as strided views of a fused qkv-like buffer (non-contiguous in dim 0)
    fused = _randn((num_tokens, (2 + 2 * num_kv_heads) * head_dim), dtype, g)
    key = fused[:, 2 * head_dim : (2 + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = fused[:, (2 + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    assert not key.is_contiguous()
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[0, 4, 7]] = -1  # skipped tokens
    slots[1] = block_size - 1  # last slot of a block
    slots[2] = num_blocks * block_size - 1  # very last slot
    slots = slots.to(dtype=slot_dtype, device=DEVICE)
    k_cache = _randn((num_blocks, block_size, num_kv_heads, head_dim), dtype, g)
    v_cache = _randn((num_blocks, block_size, num_kv_heads, head_dim), dtype, g)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kernels.store_kvcache(key, value, k_cache, v_cache, slots)
    kernel_refs.store_kvcache_ref(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)
    # spot check the contract directly
    s = int(slots[1])
    assert torch.equal(k_cache[s // block_size, s % block_size], key[1])


def test_store_kvcache_all_skipped_and_empty():
    k_cache = torch.zeros(2, 16, 1, 16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    key = torch.ones(3, 1, 16, device=DEVICE)
    kernels.store_kvcache(key, key, k_cache, v_cache, torch.full((3,), -1, dtype=torch.int64, device=DEVICE))
    assert k_cache.abs().sum() == 0 and v_cache.abs().sum() == 0
    kernels.store_kvcache(key[:0], key[:0], k_cache, v_cache, torch.zeros(0, dtype=torch.int32, device=DEVICE))


# ----------------------------------------------------------------------------
# paged_decode_attention
# ----------------------------------------------------------------------------

HEADS = [(4, 4), (4, 2), (8, 2), (4, 1), (6, 2)]  # GQA 1, 2, 4, single kv head (4), group 3


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
def test_decode_gqa_blocks(block_size, num_heads, num_kv_heads):
    head_dim, dtype = 32, torch.float32
    seq_lens = [1, block_size, block_size + 1, 2 * block_size, 3 * block_size - 1, 70]
    k_cache, v_cache, bt = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=2)
    q = _randn((len(seq_lens), num_heads, head_dim), dtype, _gen(3))
    sl = _i32(seq_lens)
    ref = kernel_refs.paged_decode_attention_ref(q, k_cache, v_cache, bt, sl, head_dim**-0.5)
    out = kernels.paged_decode_attention(q, k_cache, v_cache, bt, sl, head_dim**-0.5)
    _assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [None, 1, 2, 5, 64])
def test_decode_splits(dtype, num_splits):
    head_dim, block_size, num_heads, num_kv_heads = 64, 16, 4, 2
    seq_lens = [1, 16, 33, 96, 131]
    k_cache, v_cache, bt = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=4)
    q = _randn((len(seq_lens), num_heads, head_dim), dtype, _gen(5))
    sl = _i32(seq_lens)
    ref = kernel_refs.paged_decode_attention_ref(q, k_cache, v_cache, bt, sl, 0.125)
    out = kernels.paged_decode_attention(q, k_cache, v_cache, bt, sl, 0.125, num_splits=num_splits)
    _assert_close(out, ref, dtype)
    # an explicit, tight max_seq_len gives the same answer
    out2 = kernels.paged_decode_attention(
        q, k_cache, v_cache, bt, sl, 0.125, num_splits=num_splits, max_seq_len=max(seq_lens)
    )
    _assert_close(out2, ref, dtype)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_order_changes_no_result(num_splits):
    # programs taking the sequences in another order still write each sequence's own row
    head_dim, block_size, num_heads, num_kv_heads = 32, 16, 4, 2
    seq_lens = [7, 130, 1, 64, 33]
    k_cache, v_cache, bt = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, torch.float32, seed=21)
    q = _randn((len(seq_lens), num_heads, head_dim), torch.float32, _gen(22))
    sl = _i32(seq_lens)
    ref = kernel_refs.paged_decode_attention_ref(q, k_cache, v_cache, bt, sl, 0.17)
    longest_first = sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i])
    for order in (longest_first, [4, 3, 2, 1, 0]):
        out = kernels.paged_decode_attention(q, k_cache, v_cache, bt, sl, 0.17, num_splits=num_splits,
                                             order=_i32(order))
        _assert_close(out, ref, torch.float32)


class _Allocations(TorchDispatchMode):
    """Bytes of every tensor a call creates with ``torch.empty`` (what the kernels allocate)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.empty.memory_format:
            self.shapes.append((tuple(out.shape), out.dtype))
        return out


@pytest.mark.parametrize("batch,num_kv_heads,max_seq_len,cache_dtype", [
    (b, kvh, n, dtype) for b, kvh, n in ((1, 2, 4096), (3, 2, 160), (3, 2, 1600))
    for dtype in (torch.float16, torch.float8_e4m3fn)
] + [(64, 8, 4096, torch.float16)])  # one split in the interpreter, several on a GPU
def test_decode_scratch_bytes_is_what_a_call_allocates(batch, num_kv_heads, max_seq_len,
                                                       cache_dtype):
    """The CUDA-graph memory estimate picks the graph with the most split scratch by this
    figure, so it must be the kernel's own: one split allocates nothing besides the output,
    more splits their partial outputs (here at least one case splits on any device)."""
    head_dim, block_size, num_heads = 32, 16, 2 * num_kv_heads
    seq_lens = [1 + (7 * i) % 40 for i in range(batch)]
    k_cache, v_cache, bt = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim,
                                         torch.float16, seed=23)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    q = _randn((batch, num_heads, head_dim), torch.float16, _gen(24))
    with _Allocations() as seen:
        out = kernels.paged_decode_attention(q, k_cache, v_cache, bt, _i32(seq_lens), 0.2,
                                             max_seq_len=max_seq_len)
    allocated = [math.prod(shape) * dtype.itemsize for shape, dtype in seen.shapes]
    assert allocated[0] == out.numel() * out.element_size()  # the output comes first
    expected = kernels.decode_scratch_bytes(batch, num_heads, num_kv_heads, head_dim,
                                            k_cache.element_size(), max_seq_len, q.device)
    assert sum(allocated[1:]) == expected, seen.shapes
    if (batch, max_seq_len) == (1, 4096):
        assert expected > 0  # two pairs: fewer than any GPU's (or the interpreter's 4) SMs


@pytest.mark.parametrize("head_dim", [16, 128])
def test_decode_head_dims_and_strided_q(head_dim):
    dtype, block_size, num_heads, num_kv_heads = torch.float16, 32, 4, 2
    seq_lens = [32, 5, 64]
    k_cache, v_cache, bt = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=6)
    # q as a strided view (as sliced out of a fused qkv projection)
    fused = _randn((len(seq_lens), num_heads + 2 * num_kv_heads, head_dim), dtype, _gen(7))
    q = fused[:, :num_heads]
    assert not q.is_contiguous()
    sl = _i32(seq_lens)
    ref = kernel_refs.paged_decode_attention_ref(q, k_cache, v_cache, bt, sl, head_dim**-0.5)
    out = kernels.paged_decode_attention(q, k_cache, v_cache, bt, sl, head_dim**-0.5, num_splits=2)
    _assert_close(out, ref, dtype)


def test_decode_zero_length_padding_rows_are_zero():
    # CUDA-graph style padding: seq_len 0 rows produce zeros, not NaN
    head_dim, block_size = 32, 16
    k_cache, v_cache, bt = make_paged_kv([20, 1], block_size, 2, head_dim, torch.float32, seed=8)
    bt = torch.cat([bt, torch.full_like(bt[:1], -1)])
    sl = _i32([20, 1, 0])
    q = _randn((3, 4, head_dim), torch.float32, _gen(9))
    for ns in (1, 2):
        out = kernels.paged_decode_attention(q, k_cache, v_cache, bt, sl, 0.2, num_splits=ns)
        ref = kernel_refs.paged_decode_attention_ref(q, k_cache, v_cache, bt, sl, 0.2)
        _assert_close(out, ref, torch.float32)
        assert torch.equal(out[2], torch.zeros_like(out[2]))


def test_choose_splits():
    for max_ctx in (1, 15, 16, 17, 100, 1024, 4096, 100000):
        for batch, hkv in ((1, 1), (3, 2), (64, 8), (256, 8)):
            for forced in (None, 1, 3, 1000):
                n, tps = _dec._choose_splits(batch, hkv, max_ctx, 64, 132, forced)
                assert 1 <= n <= max(_dec._MAX_SPLITS, forced or 0)
                assert tps % 64 == 0 and tps > 0
                assert n * tps >= max_ctx and (n - 1) * tps < max_ctx  # covers, no empty split
    assert _dec._choose_splits(256, 8, 1024, 64, 132, None)[0] == 1  # big batch: no split
    assert _dec._choose_splits(1, 8, 32768, 64, 132, None)[0] > 8  # long single sequence: split
    # a small batch under a CUDA graph's bound (max_model_len 4096): a 1,000-token context is
    # still worked on by several programs, not by one split sized for the bound
    for block_n in (32, 64):
        n, tps = _dec._choose_splits(32, 8, 4096, block_n, 132, None)
        assert n >= 4 and tps <= 512
    # Qwen3's own 40,960-token bound: pieces stay small (the 64-split cap sizes them)
    assert _dec._choose_splits(32, 8, 40960, 32, 132, None)[1] <= 640


# ----------------------------------------------------------------------------
# paged_prefill_attention
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
def test_prefill_gqa_blocks(block_size, num_heads, num_kv_heads):
    head_dim, dtype = 32, torch.float32
    # (seq_len, qlen): full prefill, prefix-cache hit with short query, qlen 1,
    # chunk ending exactly on a block boundary, tiny sequence
    cases = [(45, 45), (3 * block_size + 5, 4), (2 * block_size, 1), (2 * block_size, block_size), (1, 1)]
    seq_lens = [n for n, _ in cases]
    qlens = [m for _, m in cases]
    k_cache, v_cache, bt = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=10)
    q = _randn((sum(qlens), num_heads, head_dim), dtype, _gen(11))
    args = (q, k_cache, v_cache, bt, _cu(qlens), _i32(seq_lens), max(qlens), head_dim**-0.5)
    ref = kernel_refs.paged_prefill_attention_ref(*args)
    out = kernels.paged_prefill_attention(*args)
    _assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_chunked_ragged(dtype):
    head_dim, block_size, num_heads, num_kv_heads = 64, 16, 8, 2
    cases = [(64, 64), (100, 36), (17, 1), (48, 16), (33, 0), (5, 5)]  # includes an empty query chunk
    seq_lens = [n for n, _ in cases]
    qlens = [m for _, m in cases]
    k_cache, v_cache, bt = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=12)
    fused = _randn((sum(qlens), num_heads + 2 * num_kv_heads, head_dim), dtype, _gen(13))
    q = fused[:, :num_heads]  # strided view
    cu, sl = _cu(qlens), _i32(seq_lens)
    ref = kernel_refs.paged_prefill_attention_ref(q, k_cache, v_cache, bt, cu, sl, max(qlens), 0.1)
    out = kernels.paged_prefill_attention(q, k_cache, v_cache, bt, cu, sl, max(qlens), 0.1)
    _assert_close(out, ref, dtype)
    # a loose (larger) max_seqlen_q is fine too
    out2 = kernels.paged_prefill_attention(q, k_cache, v_cache, bt, cu, sl, max(qlens) + 40, 0.1)
    _assert_close(out2, ref, dtype)


def test_prefill_prefix_lengths_around_tile_edges():
    # cached-prefix lengths on both sides of every multiple of 16 up to 70, query
    # chunks of 3: exercises the unmasked/diagonal tile split at every offset
    head_dim, block_size = 16, 16
    prefixes = [p for p in range(0, 70)]
    qlens = [3] * len(prefixes)
    seq_lens = [p + 3 for p in prefixes]
    k_cache, v_cache, bt = make_paged_kv(seq_lens, block_size, 1, head_dim, torch.float32, seed=19)
    q = _randn((sum(qlens), 2, head_dim), torch.float32, _gen(20))
    args = (q, k_cache, v_cache, bt, _cu(qlens), _i32(seq_lens), 3, 0.25)
    _assert_close(kernels.paged_prefill_attention(*args), kernel_refs.paged_prefill_attention_ref(*args), torch.float32)


def test_prefill_qlen1_matches_decode():
    head_dim, block_size = 32, 16
    seq_lens = [1, 16, 17, 50]
    k_cache, v_cache, bt = make_paged_kv(seq_lens, block_size, 2, head_dim, torch.float32, seed=14)
    q = _randn((len(seq_lens), 8, head_dim), torch.float32, _gen(15))
    sl = _i32(seq_lens)
    dec = kernels.paged_decode_attention(q, k_cache, v_cache, bt, sl, 0.3, num_splits=2)
    pre = kernels.paged_prefill_attention(q, k_cache, v_cache, bt, _cu([1] * len(seq_lens)), sl, 1, 0.3)
    torch.testing.assert_close(dec, pre, atol=1e-5, rtol=1e-5)


def test_store_then_attend_roundtrip():
    # store this step's K/V with the kernel, then prefill over the cache == dense causal attention
    g = _gen(16)
    block_size, hkv, h, d, n = 16, 2, 4, 32, 40
    num_blocks = 5
    k_cache = torch.zeros(num_blocks, block_size, hkv, d, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    blocks = torch.randperm(num_blocks, generator=g)[:3].to(torch.int32)
    pos = torch.arange(n)
    slots = (blocks[pos // block_size].long() * block_size + pos % block_size).to(DEVICE)
    k, v, q = _randn((n, hkv, d), torch.float32, g), _randn((n, hkv, d), torch.float32, g), _randn((n, h, d), torch.float32, g)
    kernels.store_kvcache(k, v, k_cache, v_cache, slots)
    bt = blocks[None].to(DEVICE)
    out = kernels.paged_prefill_attention(q, k_cache, v_cache, bt, _cu([n]), _i32([n]), n, d**-0.5)
    kk, vv = k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1)
    dense = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, is_causal=True, scale=d**-0.5)
    torch.testing.assert_close(out, dense.transpose(0, 1), atol=5e-5, rtol=1e-4)


# ----------------------------------------------------------------------------
# argument validation
# ----------------------------------------------------------------------------


def _small_decode_args():
    k_cache, v_cache, bt = make_paged_kv([5, 9], 16, 2, 32, torch.float32, seed=17)
    q = _randn((2, 4, 32), torch.float32, _gen(18))
    return [q, k_cache, v_cache, bt, _i32([5, 9]), 0.2]


@pytest.mark.parametrize(
    "index,bad,name",
    [
        (0, lambda a: a[0].half(), "k_cache"),  # q dtype != cache dtype
        (0, lambda a: a[0][:, :3], "q"),  # 3 heads not a multiple of 2 kv heads
        (0, lambda a: a[0][..., ::2], "q"),  # non-contiguous last dim / wrong head_dim
        (1, lambda a: a[1].transpose(0, 1), "k_cache"),  # non-contiguous cache
        (2, lambda a: a[2][:, :, :1], "v_cache"),  # shape mismatch
        (3, lambda a: a[3].long(), "block_tables"),
        (3, lambda a: a[3][:1], "block_tables"),
        (4, lambda a: a[4].long(), "seq_lens"),
        (4, lambda a: a[4][:1], "seq_lens"),
    ],
)
def test_decode_validation(index, bad, name):
    args = _small_decode_args()
    args[index] = bad(args)
    with pytest.raises(ValueError, match=name):
        kernels.paged_decode_attention(*args)


@pytest.mark.parametrize("order", [_i32([0]), _i32([1, 0]).long(), _i32([1, 0, 2, 3])[::2]])
def test_decode_order_validation(order):
    with pytest.raises(ValueError, match="order"):
        kernels.paged_decode_attention(*_small_decode_args(), order=order)


def test_prefill_and_store_validation():
    q, k_cache, v_cache, bt, sl, scale = _small_decode_args()
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        kernels.paged_prefill_attention(q, k_cache, v_cache, bt, _i32([0, 1]), sl, 1, scale)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        kernels.paged_prefill_attention(q, k_cache, v_cache, bt, _i32([0, 1, 2]), sl, -1, scale)
    key = torch.zeros(3, 2, 32, device=DEVICE)
    slots = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        kernels.store_kvcache(key, key, k_cache, v_cache, slots.float())
    with pytest.raises(ValueError, match="key"):
        kernels.store_kvcache(key.half(), key, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="value"):
        kernels.store_kvcache(key, key[:2], k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="key"):
        kernels.store_kvcache(torch.zeros(3, 2, 64, device=DEVICE)[..., ::2], key, k_cache, v_cache, slots)


@pytest.mark.parametrize("prefix,n,padded", [(0, 5, 16), (37, 11, 16), (20, 40, 64)])
def test_prefill_padded_query_leaves_the_real_rows_unchanged(prefix, n, padded):
    """A chunk of n tokens at a cached prefix, run the way the prefill CUDA graphs run it: a
    query of ``padded`` tokens over a context of prefix + padded, the padding rows last and
    their cache positions never written (stale values: huge ones here; the engine's cache only
    ever holds finite values). The real rows must not see them."""
    head_dim, block_size, num_heads, num_kv_heads = 32, 16, 4, 2
    k_cache, v_cache, bt = make_paged_kv([prefix + padded], block_size, num_kv_heads, head_dim,
                                         torch.float32, seed=21)
    for pos in range(prefix + n, prefix + padded):  # the padding's positions: stale values
        blk = int(bt[0, pos // block_size])
        k_cache[blk, pos % block_size] = 1e4
        v_cache[blk, pos % block_size] = -1e4
    q = _randn((padded, num_heads, head_dim), torch.float32, _gen(22))
    real = kernels.paged_prefill_attention(q[:n], k_cache, v_cache, bt, _cu([n]), _i32([prefix + n]),
                                           n, head_dim**-0.5)
    out = kernels.paged_prefill_attention(q, k_cache, v_cache, bt, _cu([padded]),
                                          _i32([prefix + padded]), padded, head_dim**-0.5)
    assert not torch.isnan(out[:n]).any()
    torch.testing.assert_close(out[:n], real, atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------
# FP8 KV caches (kv_cache_dtype="fp8": e4m3, scale 1)
# ----------------------------------------------------------------------------

FP8 = torch.float8_e4m3fn


@pytest.mark.skipif(INTERPRET, reason="Triton 3.6's interpreter does not round to e4m3: compiled only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_store_kvcache_into_fp8_rounds_and_saturates_like_the_reference(dtype):
    g = _gen(40)
    key = (_randn((9, 4, 64), dtype, g) * 200).to(DEVICE)  # some beyond ±448
    value = _randn((9, 4, 64), dtype, g).to(DEVICE)
    slots = _i32([3, -1, 0, 17, 30, 8, 9, 1, 31])
    caches = [torch.zeros((4, 8, 4, 64), dtype=FP8, device=DEVICE) for _ in range(4)]
    kernels.store_kvcache(key, value, caches[0], caches[1], slots)
    kernel_refs.store_kvcache_ref(key, value, caches[2], caches[3], slots)
    assert caches[2].float().abs().max() == 448
    for got, want in zip(caches[:2], caches[2:]):
        assert torch.equal(got.float(), want.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_and_prefill_read_fp8_caches_like_the_reference(dtype):
    """Attention over e4m3 caches: the values are read as they are (scale 1), the math is the
    kernels' own (fp32 scores and sums); fp32/fp16 only here, bf16 in the GPU tier."""
    head_dim, block_size, num_heads, num_kv_heads = 64, 16, 8, 2
    seq_lens, qlens = [45, 3 * block_size + 5, 1], [45, 4, 1]
    k_cache, v_cache, bt = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, FP8, seed=41)
    q = _randn((sum(qlens), num_heads, head_dim), dtype, _gen(42)).to(DEVICE)
    args = (q, k_cache, v_cache, bt, _cu(qlens), _i32(seq_lens), max(qlens), head_dim**-0.5)
    _assert_close(kernels.paged_prefill_attention(*args), kernel_refs.paged_prefill_attention_ref(*args),
                  dtype)
    q_dec = _randn((len(seq_lens), num_heads, head_dim), dtype, _gen(43)).to(DEVICE)
    dec = (q_dec, k_cache, v_cache, bt, _i32(seq_lens), head_dim**-0.5)
    _assert_close(kernels.paged_decode_attention(*dec), kernel_refs.paged_decode_attention_ref(*dec),
                  dtype)


# ----------------------------------------------------------------------------
# sliding-window (local) attention: query at p sees keys p - W < k <= p
# ----------------------------------------------------------------------------


def _dense_kv(k_cache, v_cache, bt, seq_lens):
    """Each sequence's K/V as dense fp32 ``[n, Hkv, D]``, read position by position."""
    bs = k_cache.shape[1]
    out = []
    for b, n in enumerate(seq_lens):
        idx = [(int(bt[b, p // bs]), p % bs) for p in range(n)]
        out.append((torch.stack([k_cache[i, j].float() for i, j in idx] or [k_cache[0, 0, :0].float()]),
                    torch.stack([v_cache[i, j].float() for i, j in idx] or [v_cache[0, 0, :0].float()])))
    return out


def _naive_window_attention(q, dense, seq_lens, qlens, scale, window):
    """Independent dense reference: positions, the window mask and a float32 softmax.
    ``window`` None: full causal attention; a sequence of length 0 (padding) gives zeros."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    row = 0
    for (k, v), n, qlen in zip(dense, seq_lens, qlens):
        if n <= 0:
            row += qlen
            continue
        group = q.shape[1] // k.shape[1]
        kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [n, H, D]
        q_pos = torch.arange(n - qlen, n, device=q.device)[:, None]  # [qlen, 1]
        k_pos = torch.arange(n, device=q.device)[None, :]  # [1, n]
        visible = k_pos <= q_pos
        if window:
            visible &= k_pos > q_pos - window
        s = torch.einsum("thd,nhd->htn", q[row:row + qlen].float(), kk) * scale
        p = torch.softmax(s.masked_fill(~visible[None], float("-inf")), dim=-1)
        out[row:row + qlen] = torch.einsum("htn,nhd->thd", p, vv)
        row += qlen
    return out.to(q.dtype)


def _poison_before_window(k_cache, v_cache, bt, seq_lens, qlens, window):
    """What the engine leaves once it frees the blocks wholly before every query's window:
    their table entries point at one all-NaN block (a reused or stale id) and the blocks
    themselves hold NaN. A kernel that reads any of them (even masked out of the softmax:
    0 * NaN) gives NaN. Returns the poisoned copies and how many entries were poisoned.
    (The references, pure torch, also get a table whose poisoned entries are out of range:
    ``_invalid_ids``.)"""
    bs = k_cache.shape[1]
    nan_block = torch.full((1, *k_cache.shape[1:]), float("nan"), dtype=k_cache.dtype, device=DEVICE)
    k_cache, v_cache = torch.cat([k_cache, nan_block]), torch.cat([v_cache, nan_block])
    bt = bt.clone()
    poisoned = 0
    for b, (n, qlen) in enumerate(zip(seq_lens, qlens)):
        lo = max(0, n - qlen - window + 1)  # first position the sequence's first query sees
        for j in range(lo // bs):  # blocks whose positions are all < lo
            k_cache[int(bt[b, j])] = float("nan")
            v_cache[int(bt[b, j])] = float("nan")
            bt[b, j] = k_cache.shape[0] - 1
            poisoned += 1
    return k_cache, v_cache, bt, poisoned


def _invalid_ids(bt_poisoned, num_blocks):
    """The poisoned table with its poisoned entries (those pointing at the NaN block) set to an
    id past the cache: torch indexing raises if a reference reads one."""
    return torch.where(bt_poisoned == num_blocks, 10**8, bt_poisoned)


SW_DECODE_LENS = [1, 5, 16, 17, 40, 70, 131]


@pytest.mark.parametrize("window", [5, 40, 1000])  # < a block, several blocks, > every context
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode_sliding_window(window, num_splits):
    head_dim, block_size, num_heads, num_kv_heads, dtype = 32, 16, 8, 2, torch.float32
    seq_lens = SW_DECODE_LENS
    k_cache, v_cache, bt = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=50)
    q = _randn((len(seq_lens), num_heads, head_dim), dtype, _gen(51))
    sl, scale = _i32(seq_lens), head_dim**-0.5
    want = _naive_window_attention(q, _dense_kv(k_cache, v_cache, bt, seq_lens), seq_lens,
                                   [1] * len(seq_lens), scale, window)
    out = kernels.paged_decode_attention(q, k_cache, v_cache, bt, sl, scale, num_splits=num_splits,
                                         sliding_window=window)
    _assert_close(out, want, dtype)
    _assert_close(kernel_refs.paged_decode_attention_ref(q, k_cache, v_cache, bt, sl, scale,
                                                     sliding_window=window), want, dtype)
    full = kernels.paged_decode_attention(q, k_cache, v_cache, bt, sl, scale, num_splits=num_splits)
    if window >= max(seq_lens):  # the window holds every context: full attention
        torch.testing.assert_close(out, full, atol=1e-6, rtol=1e-6)
    else:
        assert not torch.allclose(out, full, atol=1e-3)  # the window changed the answer


@pytest.mark.parametrize("window", [1, 5, 40])
@pytest.mark.parametrize("num_splits,max_seq_len", [(None, None), (1, None), (3, None), (None, 4096)])
def test_decode_sliding_window_skips_freed_blocks(window, num_splits, max_seq_len):
    """Blocks wholly before the window are freed: their table entries and contents are
    garbage (NaN here). The output must equal the dense answer on the clean cache."""
    head_dim, block_size, num_heads, num_kv_heads, dtype = 32, 16, 4, 1, torch.float32
    seq_lens = SW_DECODE_LENS
    k_cache, v_cache, bt = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=52)
    q = _randn((len(seq_lens), num_heads, head_dim), dtype, _gen(53))
    scale = head_dim**-0.5
    want = _naive_window_attention(q, _dense_kv(k_cache, v_cache, bt, seq_lens), seq_lens,
                                   [1] * len(seq_lens), scale, window)
    kp, vp, btp, poisoned = _poison_before_window(k_cache, v_cache, bt, seq_lens, [1] * len(seq_lens),
                                                  window)
    assert poisoned >= 5
    args = (q, kp, vp, btp, _i32(seq_lens), scale)
    _assert_close(kernels.paged_decode_attention(*args, num_splits=num_splits, max_seq_len=max_seq_len,
                                                 sliding_window=window), want, dtype)
    _assert_close(kernel_refs.paged_decode_attention_ref(*args, sliding_window=window), want, dtype)
    bad_ids = _invalid_ids(btp, k_cache.shape[0])
    _assert_close(kernel_refs.paged_decode_attention_ref(q, kp, vp, bad_ids, _i32(seq_lens), scale,
                                                     sliding_window=window), want, dtype)


def test_decode_sliding_window_fp16_order_and_padding_rows():
    head_dim, block_size, num_heads, num_kv_heads, dtype = 64, 16, 6, 2, torch.float16
    seq_lens = [50, 3, 0, 100]  # a padding row (seq_len 0) gives zeros
    k_cache, v_cache, bt = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=54)
    q = _randn((len(seq_lens), num_heads, head_dim), dtype, _gen(55))
    want = _naive_window_attention(q, _dense_kv(k_cache, v_cache, bt, seq_lens), seq_lens,
                                   [1] * len(seq_lens), 0.125, 20)
    for ns in (None, 2):
        out = kernels.paged_decode_attention(q, k_cache, v_cache, bt, _i32(seq_lens), 0.125, num_splits=ns,
                                             order=_i32([3, 0, 1, 2]), sliding_window=20)
        _assert_close(out, want, dtype)
        assert torch.equal(out[2], torch.zeros_like(out[2]))


PREFILL_SW_CASES = [  # (seq_len, qlen)
    (45, 45),  # full prefill
    (100, 36),  # chunk whose queries start mid-sequence (position 64)
    (90, 40),  # chunk longer than the window: rows see nothing in some of the tile's key tiles
    (70, 1),  # decode-like query
    (33, 3),  # short chunk across a block boundary
    (5, 5),
]


@pytest.mark.parametrize("window", [5, 40, 1000])  # < a block, several blocks, > every context
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (6, 2)])
def test_prefill_sliding_window(window, num_heads, num_kv_heads):
    head_dim, block_size, dtype = 32, 16, torch.float32
    seq_lens = [n for n, _ in PREFILL_SW_CASES]
    qlens = [m for _, m in PREFILL_SW_CASES]
    k_cache, v_cache, bt = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=56)
    q = _randn((sum(qlens), num_heads, head_dim), dtype, _gen(57))
    scale = head_dim**-0.5
    want = _naive_window_attention(q, _dense_kv(k_cache, v_cache, bt, seq_lens), seq_lens, qlens,
                                   scale, window)
    args = (q, k_cache, v_cache, bt, _cu(qlens), _i32(seq_lens), max(qlens), scale)
    out = kernels.paged_prefill_attention(*args, sliding_window=window)
    _assert_close(out, want, dtype)
    _assert_close(kernel_refs.paged_prefill_attention_ref(*args, sliding_window=window), want, dtype)
    full = kernels.paged_prefill_attention(*args)
    if window >= max(seq_lens):
        torch.testing.assert_close(out, full, atol=1e-6, rtol=1e-6)
    else:
        assert not torch.allclose(out, full, atol=1e-3)


@pytest.mark.parametrize("window", [1, 5, 17, 40])
def test_prefill_sliding_window_skips_freed_blocks(window):
    """Chunked prefill after the blocks wholly before the first query's window were freed:
    their table entries and contents are garbage (NaN). Also cached-prefix lengths on both
    sides of tile edges, so every split of the walk into window-masked, unmasked and
    diagonal tiles is met."""
    head_dim, block_size, num_heads, num_kv_heads, dtype = 16, 16, 4, 2, torch.float32
    cases = PREFILL_SW_CASES + [(p + 3, 3) for p in (31, 32, 33, 47, 63, 64, 65)]
    seq_lens = [n for n, _ in cases]
    qlens = [m for _, m in cases]
    k_cache, v_cache, bt = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=58)
    q = _randn((sum(qlens), num_heads, head_dim), dtype, _gen(59))
    want = _naive_window_attention(q, _dense_kv(k_cache, v_cache, bt, seq_lens), seq_lens, qlens,
                                   0.25, window)
    kp, vp, btp, poisoned = _poison_before_window(k_cache, v_cache, bt, seq_lens, qlens, window)
    assert poisoned >= 5
    args = (q, kp, vp, btp, _cu(qlens), _i32(seq_lens), max(qlens), 0.25)
    _assert_close(kernels.paged_prefill_attention(*args, sliding_window=window), want, dtype)
    _assert_close(kernel_refs.paged_prefill_attention_ref(*args, sliding_window=window), want, dtype)
    bad_ids = _invalid_ids(btp, k_cache.shape[0])
    _assert_close(kernel_refs.paged_prefill_attention_ref(q, kp, vp, bad_ids, *args[4:], sliding_window=window),
                  want, dtype)


def test_prefill_sliding_window_fp16_and_qlen1_matches_decode():
    head_dim, block_size, num_heads, num_kv_heads, dtype = 64, 32, 4, 4, torch.float16
    seq_lens, qlens = [80, 33, 64], [50, 33, 1]
    k_cache, v_cache, bt = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=60)
    q = _randn((sum(qlens), num_heads, head_dim), dtype, _gen(61))
    want = _naive_window_attention(q, _dense_kv(k_cache, v_cache, bt, seq_lens), seq_lens, qlens,
                                   0.125, 24)
    out = kernels.paged_prefill_attention(q, k_cache, v_cache, bt, _cu(qlens), _i32(seq_lens), 50, 0.125,
                                          sliding_window=24)
    _assert_close(out, want, dtype)
    # one query per sequence: prefill and decode agree
    qd = q[[49, 82, 83]]
    dec = kernels.paged_decode_attention(qd, k_cache, v_cache, bt, _i32(seq_lens), 0.125, num_splits=2,
                                         sliding_window=24)
    pre = kernels.paged_prefill_attention(qd, k_cache, v_cache, bt, _cu([1, 1, 1]), _i32(seq_lens), 1,
                                          0.125, sliding_window=24)
    torch.testing.assert_close(dec, pre, atol=2e-3, rtol=2e-3)


def test_sliding_window_zero_is_full_attention_and_bad_windows_are_rejected():
    q, k_cache, v_cache, bt, sl, scale = _small_decode_args()
    full = kernels.paged_decode_attention(q, k_cache, v_cache, bt, sl, scale)
    assert torch.equal(kernels.paged_decode_attention(q, k_cache, v_cache, bt, sl, scale, sliding_window=0), full)
    pre_args = (q, k_cache, v_cache, bt, _i32([0, 1, 2]), sl, 1, scale)
    assert torch.equal(kernels.paged_prefill_attention(*pre_args, sliding_window=0),
                       kernels.paged_prefill_attention(*pre_args))
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="sliding_window"):
            kernels.paged_decode_attention(q, k_cache, v_cache, bt, sl, scale, sliding_window=bad)
        with pytest.raises(ValueError, match="sliding_window"):
            kernels.paged_prefill_attention(*pre_args, sliding_window=bad)


@pytest.mark.parametrize("batch,max_seq_len,window", [(1, 4096, 100), (3, 1600, 40), (1, 4096, 5000)])
def test_decode_sliding_window_scratch_bytes(batch, max_seq_len, window):
    """A window splits only its own walk: the scratch a call allocates is what
    decode_scratch_bytes says for that window, and never more than without it."""
    head_dim, block_size, num_kv_heads, num_heads = 32, 16, 2, 4
    seq_lens = [1 + (37 * i + 150) % 300 for i in range(batch)]
    k_cache, v_cache, bt = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, torch.float16, seed=62)
    q = _randn((batch, num_heads, head_dim), torch.float16, _gen(63))
    with _Allocations() as seen:
        out = kernels.paged_decode_attention(q, k_cache, v_cache, bt, _i32(seq_lens), 0.2,
                                             max_seq_len=max_seq_len, sliding_window=window)
    allocated = [math.prod(shape) * dtype.itemsize for shape, dtype in seen.shapes]
    expected = kernels.decode_scratch_bytes(batch, num_heads, num_kv_heads, head_dim, 2, max_seq_len,
                                            q.device, sliding_window=window)
    assert sum(allocated[1:]) == expected
    full = kernels.decode_scratch_bytes(batch, num_heads, num_kv_heads, head_dim, 2, max_seq_len, q.device)
    assert expected <= full
    if window < max_seq_len:
        assert expected < full
    want = _naive_window_attention(q, _dense_kv(k_cache, v_cache, bt, seq_lens), seq_lens,
                                   [1] * batch, 0.2, window)
    _assert_close(out, want, torch.float16)


@pytest.mark.parametrize("num_k_heads,num_v_heads,dk,dv,kernel", [(2, 4, 16, 8, 4), (1, 1, 32, 40, 3)])
def test_gdn_decode_matches_reference(num_k_heads, num_v_heads, dk, dv, kernel):
    """States in and out of their slots in place: rows chosen by slot (-1: the last, the scratch
    row), a sequence at position 0 starting from zero state whatever its row holds, grouped
    value heads, a value dim that is no power of two, and every other row untouched."""
    gen = torch.Generator().manual_seed(0)
    batch, rows, conv_dim = 4, 6, 2 * num_k_heads * dk + num_v_heads * dv
    dtype = torch.float32

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE)

    mixed = rand(batch, conv_dim).to(dtype)
    conv_state, weight = rand(rows, conv_dim, kernel - 1).to(dtype), rand(conv_dim, kernel)
    g = -rand(batch, num_v_heads).abs()
    beta = torch.sigmoid(rand(batch, num_v_heads))
    ssm = rand(rows, num_v_heads, dk, dv)
    slots = torch.tensor([3, 0, -1, 4], dtype=torch.int32, device=DEVICE)  # -1: row 5
    positions = torch.tensor([7, 0, 2, 9], dtype=torch.int32, device=DEVICE)
    states = [(conv_state.clone(), ssm.clone()) for _ in range(2)]
    outs = [fn(mixed, c, weight, g, beta, s, slots, positions, num_k_heads, dk, dv)
            for fn, (c, s) in zip((kernels.gdn_decode, kernel_refs.gdn_decode_ref), states)]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
    for ours, ref in zip(states[0], states[1]):
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    untouched = [1, 2]
    torch.testing.assert_close(states[0][1][untouched], ssm[untouched])


@pytest.mark.parametrize("num_k_heads,num_v_heads,dk,dv", [(2, 4, 16, 8), (1, 1, 32, 40)])
def test_gdn_rows_match_reference_and_the_chunked_form(num_k_heads, num_v_heads, dk, dv):
    """Short chunks token by token: the kernel equals the torch reference, which equals the
    chunked form sequence by sequence (outputs and final states); a chunk from zero state, a
    chunk whose final state goes to another row (held: the scratch row), rows not named
    untouched."""
    from nvray.layers.gated_delta_rule import chunked_gated_delta, split_heads

    gen = torch.Generator().manual_seed(2)
    rows, conv_dim, lens = 6, 2 * num_k_heads * dk + num_v_heads * dv, [3, 1, 5]

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE)

    tokens = sum(lens)
    conv = rand(tokens, conv_dim)
    g, beta = -rand(tokens, num_v_heads).abs(), torch.sigmoid(rand(tokens, num_v_heads))
    ssm = rand(rows, num_v_heads, dk, dv)
    read = torch.tensor([4, 0, 2], device=DEVICE)
    write = torch.tensor([4, 0, 5], device=DEVICE)  # the third: held, to the scratch row
    resumes = torch.tensor([True, False, True], device=DEVICE)
    qsl = torch.tensor([0, 3, 4, 9], dtype=torch.int32, device=DEVICE)
    states = [ssm.clone() for _ in range(2)]
    outs = [fn(conv, g, beta, s, read, write, resumes, qsl, num_k_heads, dk, dv)
            for fn, s in zip((kernels.gdn_rows, kernel_refs.gdn_rows_ref), states)]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(states[0], states[1], atol=1e-4, rtol=1e-4)
    q, k, v = split_heads(conv.cpu(), num_k_heads, num_v_heads, dk, dv)
    for i, (start, n) in enumerate(zip([0, 3, 4], lens)):
        initial = ssm[read[i]].cpu() * resumes[i].item()
        out, final = chunked_gated_delta(q[start:start + n], k[start:start + n],
                                         v[start:start + n], g[start:start + n].cpu(),
                                         beta[start:start + n].cpu(), initial)
        torch.testing.assert_close(outs[1][start:start + n].cpu(), out, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(states[1][write[i]].cpu(), final, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(states[0][[1, 3]], ssm[[1, 3]])


@pytest.mark.parametrize("channels,kernel,dtype", [(96, 4, torch.float32), (300, 3, torch.float32),
                                                   (96, 4, torch.bfloat16)])
@pytest.mark.parametrize("held", [False, True])
def test_gdn_short_conv_matches_reference_and_the_conv_by_definition(channels, kernel, dtype,
                                                                     held):
    """Short chunks' causal conv: the kernel equals the torch reference, and both equal the
    contract's sum over each chunk's window and rows; a chunk from a zero window, one whose
    new window keeps entries of its old one (one token), one with padding rows (its new window
    ends before them), a held chunk's new window to another row, the held rows' inputs and
    outputs kept, rows not named untouched. In bf16 with int32 lists (the wrapper widens the
    row offsets); the kernel sums in float32, torch in bf16."""
    gen = torch.Generator().manual_seed(3)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    rows, lens, real = 7, [3, 1, 5], [3, 1, 2]
    index = torch.int32 if dtype == torch.bfloat16 else torch.int64
    qsl = torch.tensor([0, 3, 4, 9], dtype=torch.int32, device=DEVICE)
    mixed, weight = rand(9, channels), rand(channels, kernel)
    conv_state = rand(rows, channels, kernel - 1)
    read = torch.tensor([4, 0, 2], dtype=index, device=DEVICE)
    write = torch.tensor([4, 0, 6], dtype=index, device=DEVICE)  # the third: held, to scratch
    resumes = torch.tensor([True, False, True], device=DEVICE)
    held_at = torch.arange(9, dtype=index, device=DEVICE) * 2 if held else None
    results = []
    for fn in (kernels.gdn_short_conv, kernel_refs.gdn_short_conv_ref):
        state = conv_state.clone()
        held_x, held_out = (torch.zeros(20, channels, dtype=dtype, device=DEVICE) for _ in "xo")
        out = fn(mixed, state, weight, read, write, resumes, qsl,
                 torch.tensor(real, dtype=index, device=DEVICE), held_at, held_x, held_out)
        results.append((out, state, held_x, held_out))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for ours, ref in zip(*results):
        torch.testing.assert_close(ours, ref, atol=tol, rtol=tol)
    if dtype != torch.float32:
        return
    out, state, held_x, held_out = results[1]
    for i, (start, n) in enumerate(zip([0, 3, 4], lens)):
        line = torch.cat([conv_state[read[i]] * resumes[i], mixed[start:start + n].t()], -1)
        for t in range(n):
            want = torch.nn.functional.silu((line[:, t:t + kernel] * weight).sum(-1))
            torch.testing.assert_close(out[start + t], want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(state[write[i]], line[:, real[i]:real[i] + kernel - 1])
    torch.testing.assert_close(state[[1, 3, 5]], conv_state[[1, 3, 5]])
    if held:
        torch.testing.assert_close(held_x[::2][:9], mixed)
        torch.testing.assert_close(held_out[::2][:9], out)
        assert not held_x[1::2].any()


@pytest.mark.parametrize("num_k_heads,num_v_heads,dk,dv,kernel", [(2, 4, 16, 8, 4), (1, 1, 32, 40, 3)])
def test_gdn_commit_matches_reference_and_decode_steps(num_k_heads, num_v_heads, dk, dv, kernel):
    """Held rows committed: the kernel equals the torch reference, which equals ``count``
    decode steps of the same tokens (the reference's own oracle); counts 1..R, a chunk that
    started at position 0 (zero state whatever its row held), rows not named untouched, nor
    those of entries that keep nothing (count 0: a CUDA graph's padding)."""
    gen = torch.Generator().manual_seed(1)
    rows, r, conv_dim = 6, 3, 2 * num_k_heads * dk + num_v_heads * dv
    dtype = torch.float32

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE)

    weight = rand(conv_dim, kernel)
    mixed = rand(rows * r, conv_dim).to(dtype)
    conv_state, ssm = rand(rows, conv_dim, kernel - 1).to(dtype), rand(rows, num_v_heads, dk, dv)
    g = -rand(rows * r, num_v_heads).abs()
    beta = torch.sigmoid(rand(rows * r, num_v_heads))
    slots = torch.tensor([4, 0, 2, 1, 3], dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([9, 0, 5, 0, 7], dtype=torch.int32, device=DEVICE)
    counts = torch.tensor([3, 2, 1, 0, 0], dtype=torch.int32, device=DEVICE)
    # the held conv outputs: each slot's rows run through the conv from its window; the
    # first ``count`` of them as decode steps too
    decoded = (conv_state.clone(), ssm.clone())
    conv_out = torch.zeros_like(mixed)
    for i, (slot, start, count) in enumerate(zip(slots.tolist(), starts.tolist(), counts.tolist())):
        window = conv_state[slot] * (start > 0)
        for j in range(r):
            at = slot * r + j
            line = torch.cat([window, mixed[at, :, None]], -1)
            conv_out[at] = torch.nn.functional.silu((line * weight).sum(-1))
            window = line[:, 1:]
            if j < count:
                kernel_refs.gdn_decode_ref(mixed[at:at + 1], decoded[0], weight, g[at:at + 1],
                                       beta[at:at + 1], decoded[1], slots[i:i + 1],
                                       starts[i:i + 1] + j, num_k_heads, dk, dv)
    states = [(conv_state.clone(), ssm.clone()) for _ in range(2)]
    for fn, (c, s) in zip((kernels.gdn_commit, kernel_refs.gdn_commit_ref), states):
        fn(mixed, conv_out, g, beta, c, s, slots, starts, counts, r, num_k_heads, dk, dv)
    for ours, ref, want in zip(states[0], states[1], decoded):
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ref, want, atol=1e-4, rtol=1e-4)
    untouched = [1, 3, 5]
    torch.testing.assert_close(states[0][1][untouched], ssm[untouched])
    torch.testing.assert_close(states[0][0][untouched], conv_state[untouched])
