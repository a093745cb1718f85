"""Triton kernels vs. references at real Qwen3-0.6B shapes, bf16, on CUDA.

Qwen3-0.6B attention: 16 q heads, 8 kv heads, head_dim 128. Cache block sizes
16 and 256; batch 64, contexts up to 4096. Run with ``pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.xdist_group("kernels"),  # its module fixture, built once
]

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128
SCALE = HEAD_DIM**-0.5
DTYPE = torch.bfloat16
TOL = dict(atol=2e-2, rtol=2e-2)


@pytest.fixture(scope="module")
def kernels():
    pytest.importorskip("triton")
    import kernels as k

    if k.decode_attention._INTERPRET:
        pytest.skip("kernels were imported under TRITON_INTERPRET=1")
    return k


@pytest.fixture(scope="module")
def kernel_refs(kernels):
    """The kernels' torch references (imported after the kernels' own check)."""
    import kernel_refs as refs

    return refs


def make_paged_kv(seq_lens, block_size, seed=0, extra_blocks=7, num_kv_heads=NUM_KV_HEADS):
    """Random bf16 caches; each sequence gets blocks from a random permutation.

    Positions past each seq_len hold NaN, unused block-table entries are -1.
    """
    g = torch.Generator(device="cuda").manual_seed(seed)
    nblk = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(nblk) + extra_blocks
    shape = (num_blocks, block_size, num_kv_heads, HEAD_DIM)
    k_cache = torch.randn(shape, generator=g, device="cuda").to(DTYPE)
    v_cache = torch.randn(shape, generator=g, device="cuda").to(DTYPE)
    perm = torch.randperm(num_blocks, generator=g, device="cuda").to(torch.int32)
    block_tables = torch.full((len(seq_lens), max(nblk) + 2), -1, dtype=torch.int32, device="cuda")
    used = 0
    for b, n in enumerate(seq_lens):
        blocks = perm[used : used + nblk[b]]
        used += nblk[b]
        block_tables[b, : nblk[b]] = blocks
        tail = nblk[b] * block_size - n  # poison the unused tail of the last block
        if tail:
            k_cache[blocks[-1], block_size - tail :] = float("nan")
            v_cache[blocks[-1], block_size - tail :] = float("nan")
    for blk in perm[used:].tolist():  # and every unused block
        k_cache[blk] = float("nan")
        v_cache[blk] = float("nan")
    return k_cache, v_cache, block_tables


def _ragged_lens(batch, max_len, block_size, seed):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (batch,), generator=g).tolist()
    lens[:6] = [1, block_size, block_size + 1, 2 * block_size, max_len, max_len - 1]
    return lens


def _check(out, ref):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all(), "non-finite output: an invalid cache position was read"
    torch.testing.assert_close(out.float(), ref.float(), **TOL)


@pytest.mark.parametrize("block_size", [16, 256])
def test_store_kvcache_gpu(kernels, block_size):
    num_tokens, num_blocks = 4096, 4096 * 2 // block_size + 3
    fused = torch.randn(num_tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, device="cuda").to(DTYPE)
    key = fused[:, NUM_HEADS * HEAD_DIM : (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    value = fused[:, (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM :].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:num_tokens]
    slots[::7] = -1
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device="cuda").to(DTYPE)
    v_cache = torch.randn(shape, device="cuda").to(DTYPE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    for slot_dtype in (torch.int64, torch.int32):
        kernels.store_kvcache(key, value, k_cache, v_cache, slots.to(slot_dtype))
    valid = slots >= 0  # vectorised reference (the loop reference is slow at this size)
    k_ref.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots[valid]] = key[valid]
    v_ref.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots[valid]] = value[valid]
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_store_kvcache_ref_matches_gpu(kernels, kernel_refs):
    key = torch.randn(64, NUM_KV_HEADS, HEAD_DIM, device="cuda").to(DTYPE)
    slots = torch.randperm(16 * 16, device="cuda")[:64]
    slots[::5] = -1
    k1 = torch.zeros(16, 16, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    v1, k2, v2 = k1.clone(), k1.clone(), k1.clone()
    kernels.store_kvcache(key, key, k1, v1, slots)
    kernel_refs.store_kvcache_ref(key, key, k2, v2, slots)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_decode_gpu(kernels, kernel_refs, block_size, num_splits):
    seq_lens = _ragged_lens(64, 4096, block_size, seed=block_size)
    k_cache, v_cache, bt = make_paged_kv(seq_lens, block_size, seed=1)
    q = torch.randn(64, NUM_HEADS, HEAD_DIM, device="cuda").to(DTYPE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    ref = kernel_refs.paged_decode_attention_ref(q, k_cache, v_cache, bt, sl, SCALE)
    out = kernels.paged_decode_attention(q, k_cache, v_cache, bt, sl, SCALE, num_splits=num_splits)
    _check(out, ref)


def test_decode_gpu_long_single_sequence(kernels, kernel_refs):
    # batch 1: the heuristic splits the context across many programs
    seq_lens = [32768 - 5]
    k_cache, v_cache, bt = make_paged_kv(seq_lens, 16, seed=2)
    q = torch.randn(1, NUM_HEADS, HEAD_DIM, device="cuda").to(DTYPE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    ref = kernel_refs.paged_decode_attention_ref(q, k_cache, v_cache, bt, sl, SCALE)
    _check(kernels.paged_decode_attention(q, k_cache, v_cache, bt, sl, SCALE), ref)


def test_decode_gpu_cuda_graph(kernels, kernel_refs):
    # no host sync inside: capturable; replay with new lengths and new q
    block_size, batch = 16, 64
    seq_lens = _ragged_lens(batch, 2048, block_size, seed=3)
    k_cache, v_cache, bt = make_paged_kv(seq_lens, block_size, seed=3)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device="cuda").to(DTYPE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    kernels.paged_decode_attention(q, k_cache, v_cache, bt, sl, SCALE)  # compile outside capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernels.paged_decode_attention(q, k_cache, v_cache, bt, sl, SCALE)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.paged_decode_attention(q, k_cache, v_cache, bt, sl, SCALE)
    new_lens = [max(1, n - 37) for n in seq_lens]
    sl.copy_(torch.tensor(new_lens, dtype=torch.int32))
    q.copy_(torch.randn_like(q, dtype=torch.float32).to(DTYPE))
    graph.replay()
    torch.cuda.synchronize()
    _check(out, kernel_refs.paged_decode_attention_ref(q, k_cache, v_cache, bt, sl, SCALE))


@pytest.mark.parametrize("block_size", [16, 256])
def test_prefill_gpu(kernels, kernel_refs, block_size):
    g = torch.Generator().manual_seed(block_size)
    cases = [(1, 1), (4096, 17), (4096, 1), (2048, 2048), (1500, 1500), (3 * block_size, block_size),
             (777, 300), (4000, 64)]
    for _ in range(16):  # more ragged chunked-prefill sequences
        n = int(torch.randint(1, 4097, (1,), generator=g))
        cases.append((n, int(torch.randint(1, min(n, 512) + 1, (1,), generator=g))))
    seq_lens = [n for n, _ in cases]
    qlens = [m for _, m in cases]
    k_cache, v_cache, bt = make_paged_kv(seq_lens, block_size, seed=4)
    total = sum(qlens)
    fused = torch.randn(total, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, device="cuda").to(DTYPE)
    q = fused[:, : NUM_HEADS * HEAD_DIM].view(total, NUM_HEADS, HEAD_DIM)  # strided view
    cu = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    sl = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    args = (q, k_cache, v_cache, bt, cu, sl, max(qlens), SCALE)
    _check(kernels.paged_prefill_attention(*args), kernel_refs.paged_prefill_attention_ref(*args))


def test_prefill_gpu_full_batch_causal(kernels):
    # plain prefill of 4 x 1024 tokens == torch SDPA causal
    block_size, n, b = 16, 1024, 4
    k_cache, v_cache, bt = make_paged_kv([n] * b, block_size, seed=5)
    q = torch.randn(b * n, NUM_HEADS, HEAD_DIM, device="cuda").to(DTYPE)
    cu = torch.arange(0, (b + 1) * n, n, dtype=torch.int32, device="cuda")
    sl = torch.full((b,), n, dtype=torch.int32, device="cuda")
    out = kernels.paged_prefill_attention(q, k_cache, v_cache, bt, cu, sl, n, SCALE)
    for i in range(b):
        blocks = bt[i, : n // block_size].long()
        k = k_cache[blocks].flatten(0, 1).repeat_interleave(2, 1).transpose(0, 1)
        v = v_cache[blocks].flatten(0, 1).repeat_interleave(2, 1).transpose(0, 1)
        dense = torch.nn.functional.scaled_dot_product_attention(
            q[i * n : (i + 1) * n].transpose(0, 1), k, v, is_causal=True, scale=SCALE
        )
        _check(out[i * n : (i + 1) * n], dense.transpose(0, 1))


def test_int64_addressing_large_cache(kernels, kernel_refs):
    # a cache of > 2**31 elements: block ids near the end need 64-bit offsets
    block_size = 256
    num_blocks = (2**31) // (block_size * NUM_KV_HEADS * HEAD_DIM) + 64
    free = torch.cuda.mem_get_info()[0]
    if 2 * num_blocks * block_size * NUM_KV_HEADS * HEAD_DIM * 2 > free * 0.8:
        pytest.skip("not enough GPU memory for a > 2**31-element cache")
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.empty(shape, dtype=DTYPE, device="cuda")
    v_cache = torch.empty(shape, dtype=DTYPE, device="cuda")
    blocks = torch.tensor([[num_blocks - 1, num_blocks - 40, 3]], dtype=torch.int32, device="cuda")
    n = 3 * block_size - 10
    pos = torch.arange(n, device="cuda")
    slots = blocks[0, pos // block_size].long() * block_size + pos % block_size
    key = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, device="cuda").to(DTYPE)
    value = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, device="cuda").to(DTYPE)
    kernels.store_kvcache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache[num_blocks - 1, 5], key[5])
    q = torch.randn(1, NUM_HEADS, HEAD_DIM, device="cuda").to(DTYPE)
    sl = torch.tensor([n], dtype=torch.int32, device="cuda")
    ref = kernel_refs.paged_decode_attention_ref(q, k_cache, v_cache, blocks, sl, SCALE)
    _check(kernels.paged_decode_attention(q, k_cache, v_cache, blocks, sl, SCALE), ref)
    cu = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    _check(kernels.paged_prefill_attention(q, k_cache, v_cache, blocks, cu, sl, 1, SCALE), ref)
    del k_cache, v_cache
    torch.cuda.empty_cache()


@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(64, 8, 2), (256, 8, 1), (128, 32, 8)])
def test_other_head_dims_gpu(kernels, kernel_refs, head_dim, num_heads, num_kv_heads):
    # other Qwen3-like geometries: the launchers pick per-head_dim tile configs
    block_size = 16
    seq_lens = [1, 16, 17, 1000, 2500, 333]
    qlens = [1, 16, 1, 1000, 40, 7]
    g = torch.Generator(device="cuda").manual_seed(head_dim)
    nblk = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(nblk) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g, device="cuda").to(DTYPE)
    v_cache = torch.randn(shape, generator=g, device="cuda").to(DTYPE)
    perm = torch.randperm(num_blocks, generator=g, device="cuda").to(torch.int32)
    bt = torch.full((len(seq_lens), max(nblk) + 1), -1, dtype=torch.int32, device="cuda")
    used = 0
    for b, nb in enumerate(nblk):
        bt[b, :nb] = perm[used : used + nb]
        used += nb
    sl = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    scale = head_dim**-0.5
    qd = torch.randn(len(seq_lens), num_heads, head_dim, device="cuda").to(DTYPE)
    for ns in (None, 3):
        out = kernels.paged_decode_attention(qd, k_cache, v_cache, bt, sl, scale, num_splits=ns)
        _check(out, kernel_refs.paged_decode_attention_ref(qd, k_cache, v_cache, bt, sl, scale))
    qp = torch.randn(sum(qlens), num_heads, head_dim, device="cuda").to(DTYPE)
    cu = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    args = (qp, k_cache, v_cache, bt, cu, sl, max(qlens), scale)
    _check(kernels.paged_prefill_attention(*args), kernel_refs.paged_prefill_attention_ref(*args))
