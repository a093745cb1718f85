"""Sliding-window (local) attention in the torch reference backend and the Attention layer.

With window W the query at position p sees keys p - W < k <= p (Gemma 3's local layers, HF
transformers' sliding window). The engine frees the KV blocks wholly before every query's
window, so the backend must not read them: the poisoned-table tests point those block-table
entries at -1 (which torch indexing wraps onto an all-NaN last block) or past the cache (an
IndexError if read), fill the blocks themselves with NaN, and the output must still equal a
naive dense computation.
"""

from __future__ import annotations

import math

import pytest
import torch

from nvray.layers.attention import Attention, AttentionMetadata, TorchAttentionBackend

BLOCK_SIZE = 16


def _naive(q, keys, values, seq_lens, qlens, scale, window):
    """Dense reference: positions, the window mask and a float32 softmax per sequence."""
    out, row = torch.zeros(q.shape, dtype=torch.float32), 0
    for k, v, n, qlen in zip(keys, values, seq_lens, qlens):
        group = q.shape[1] // k.shape[1]
        kk, vv = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
        q_pos = torch.arange(n - qlen, n)[:, None]
        k_pos = torch.arange(n)[None, :]
        visible = k_pos <= q_pos
        if window:
            visible &= k_pos > q_pos - window
        s = torch.einsum("thd,nhd->htn", q[row:row + qlen].float(), kk) * scale
        p = torch.softmax(s.masked_fill(~visible[None], float("-inf")), dim=-1)
        out[row:row + qlen] = torch.einsum("htn,nhd->thd", p, vv)
        row += qlen
    return out.to(q.dtype)


def _step(cases, num_heads, num_kv_heads, head_dim, seed, dtype=torch.float32):
    """One engine step over sequences given as (seq_len, query_len): each sequence's cached
    prefix is in a NaN-filled paged cache (blocks in a random order, the last block never
    handed out), this step's K/V are passed to forward with their slots.
    Returns (q, k, v, k_cache, v_cache, meta, dense keys, dense values)."""
    g = torch.Generator().manual_seed(seed)
    nblk = [math.ceil(n / BLOCK_SIZE) for n, _ in cases]
    num_blocks = sum(nblk) + 2
    perm = torch.randperm(num_blocks - 1, generator=g)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    tables = torch.full((len(cases), max(nblk) + 1), -1, dtype=torch.int32)
    keys, values, new_k, new_v, slots = [], [], [], [], []
    used = 0
    for b, (n, qlen) in enumerate(cases):
        blocks = perm[used:used + nblk[b]]
        used += nblk[b]
        tables[b, :nblk[b]] = blocks.to(torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        keys.append(k)
        values.append(v)
        for pos in range(n):
            slot = int(blocks[pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE
            if pos < n - qlen:  # the cached prefix
                k_cache.view(-1, num_kv_heads, head_dim)[slot] = k[pos]
                v_cache.view(-1, num_kv_heads, head_dim)[slot] = v[pos]
            else:  # this step's tokens
                slots.append(slot)
        new_k.append(k[n - qlen:])
        new_v.append(v[n - qlen:])
    qlens = [m for _, m in cases]
    seq_lens = [n for n, _ in cases]
    q = torch.randn(sum(qlens), num_heads, head_dim, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc=cu,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
        max_query_len=max(qlens), max_seq_len=max(seq_lens), query_lens_cpu=qlens,
        seq_lens_cpu=seq_lens)
    return q, torch.cat(new_k), torch.cat(new_v), k_cache, v_cache, meta, keys, values


def _free_before_window(k_cache, v_cache, meta, window):
    """What the engine does once a block is wholly before every query's window of its
    sequence: the block is freed (here: NaN, as if reused) and its table entry is stale: -1
    (which torch indexing wraps onto the last block: all NaN) or an id past the cache.
    Returns how many were freed."""
    freed = 0
    for b, (n, qlen) in enumerate(zip(meta.seq_lens_cpu, meta.query_lens_cpu)):
        lo = max(0, n - qlen - window + 1)
        for j in range(lo // BLOCK_SIZE):
            k_cache[int(meta.block_tables[b, j])] = float("nan")
            v_cache[int(meta.block_tables[b, j])] = float("nan")
            meta.block_tables[b, j] = -1 if j % 2 == 0 else 10**8
            freed += 1
    assert torch.isnan(k_cache[-1]).all()
    return freed


PREFILL_CASES = [(45, 45), (100, 36), (90, 40), (70, 1), (33, 3), (5, 5)]  # (seq_len, query_len)
DECODE_CASES = [(1, 1), (5, 1), (16, 1), (17, 1), (70, 1), (131, 1)]


@pytest.mark.parametrize("window", [5, 40, 1000])  # < a block, several blocks, > every context
@pytest.mark.parametrize("cases", [PREFILL_CASES, DECODE_CASES], ids=["prefill", "decode"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (4, 4)])
def test_torch_backend_sliding_window(window, cases, num_heads, num_kv_heads):
    head_dim, scale = 32, 32**-0.5
    q, k, v, k_cache, v_cache, meta, keys, values = _step(cases, num_heads, num_kv_heads, head_dim, seed=1)
    backend = TorchAttentionBackend()
    out = backend.forward(q, k, v, k_cache, v_cache, meta, scale, window)
    want = _naive(q, keys, values, meta.seq_lens_cpu, meta.query_lens_cpu, scale, window)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    # the same step again with the K/V already stored (k, v None), without a window: full attention
    full = backend.forward(q, None, None, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(full, _naive(q, keys, values, meta.seq_lens_cpu, meta.query_lens_cpu,
                                            scale, None), atol=1e-5, rtol=1e-5)
    if window >= max(meta.seq_lens_cpu):
        torch.testing.assert_close(out, full, atol=1e-6, rtol=1e-6)
    else:
        assert not torch.allclose(out, full, atol=1e-3)


@pytest.mark.parametrize("window", [1, 5, 17, 40])
@pytest.mark.parametrize("cases", [PREFILL_CASES, DECODE_CASES], ids=["prefill", "decode"])
def test_torch_backend_sliding_window_reads_no_freed_block(window, cases):
    head_dim, scale = 32, 0.2
    q, k, v, k_cache, v_cache, meta, keys, values = _step(cases, 6, 2, head_dim, seed=2)
    assert _free_before_window(k_cache, v_cache, meta, window) >= 2
    out = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, scale, window)
    assert not torch.isnan(out).any(), "read a block wholly before the window"
    want = _naive(q, keys, values, meta.seq_lens_cpu, meta.query_lens_cpu, scale, window)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_torch_backend_sliding_window_bf16():
    q, k, v, k_cache, v_cache, meta, keys, values = _step(PREFILL_CASES, 8, 2, 64, seed=3,
                                                          dtype=torch.bfloat16)
    _free_before_window(k_cache, v_cache, meta, 24)
    out = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.125, 24)
    want = _naive(q, keys, values, meta.seq_lens_cpu, meta.query_lens_cpu, 0.125, 24)
    torch.testing.assert_close(out.float(), want.float(), atol=3e-2, rtol=3e-2)


class _Recorder(TorchAttentionBackend):
    def __init__(self) -> None:
        self.windows: list[int | None] = []

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, sliding_window=None):
        self.windows.append(sliding_window)
        return super().forward(q, k, v, k_cache, v_cache, meta, scale, sliding_window)


@pytest.mark.parametrize("window,stored", [(None, None), (0, None), (20, 20)])
def test_attention_layer_passes_its_window_to_the_backend(window, stored):
    q, k, v, k_cache, v_cache, meta, keys, values = _step(PREFILL_CASES, 4, 2, 32, seed=4)
    layer = Attention(4, 2, 32, 0.3, sliding_window=window)
    assert layer.sliding_window == stored
    assert Attention(4, 2, 32, 0.3).sliding_window is None
    layer.k_cache, layer.v_cache = k_cache, v_cache
    layer.backend = _Recorder()
    out = layer(q, k, v, meta)
    assert layer.backend.windows == [stored]
    want = _naive(q, keys, values, meta.seq_lens_cpu, meta.query_lens_cpu, 0.3, stored)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
