"""Bandwidth benchmark of the nvray Triton kernels (CUDA only).

``measure_bandwidth(device="cuda") -> list[dict]`` times each kernel at a
decode-heavy Qwen3-0.6B attention shape (16 q heads, 8 kv heads, head_dim 128,
bf16, batch 256, context 1024, cache block size 16) with CUDA events: median of
``iters`` timed CUDA-graph replays after warmup, L2 flushed before each. Each
row holds ``name``, ``shape``, ``bytes`` (bytes that must cross DRAM: KV read +
q read + out written for attention, key/value read + cache written for the
store), ``ms`` (median GPU time), ``gb_per_s`` and ``eager_ms`` (wall time per
call of back-to-back eager calls: shows the host launch cost where it exceeds
the GPU time). A ``torch_copy`` row (a device-to-device copy of the decode
kernel's byte count, bytes read + written) gives the achievable bandwidth for
comparison.

Run ``python -m nvray.bench.kernel_bandwidth`` to print the table.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128
BATCH, CONTEXT, BLOCK_SIZE = 256, 1024, 16
DTYPE = torch.bfloat16


def _time_ms(fn: Callable[[], object], warmup: int, iters: int) -> tuple[float, float]:
    """(median GPU ms, eager wall ms per call).

    GPU time: ``fn`` is captured in a CUDA graph and each timed replay follows a
    256 MiB memset, which flushes L2 (50-60 MB on H100/H200) and keeps the GPU
    busy while the host records the events, so host launch cost is excluded.
    Eager wall time: back-to-back eager calls, i.e. max(host launch cost, GPU time).
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    eager_ms = (time.perf_counter() - t0) / iters * 1e3

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    scratch = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    events = []
    for _ in range(iters):
        scratch.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    ms = statistics.median(s.elapsed_time(e) for s, e in events)
    del graph
    return ms, eager_ms


def _row(name: str, shape: str, nbytes: int, timing: tuple[float, float]) -> dict:
    ms, eager_ms = timing
    return {
        "name": name,
        "shape": shape,
        "bytes": int(nbytes),
        "ms": ms,
        "gb_per_s": nbytes / (ms * 1e-3) / 1e9,
        "eager_ms": eager_ms,
    }


class _Cache(NamedTuple):
    """The paged KV cache every kernel here reads, at the decode-heavy shape."""
    k: torch.Tensor
    v: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    num_blocks: int
    kv_bytes: int  # what a decode step over every sequence reads


def measure_bandwidth(device: str | torch.device = "cuda", warmup: int = 10, iters: int = 50) -> list[dict]:
    """Median time and effective DRAM bandwidth of each kernel at a decode-heavy shape."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"measure_bandwidth needs a CUDA device (got {device}, cuda available: {torch.cuda.is_available()})")
    import kernels

    if kernels.decode_attention._INTERPRET:
        raise RuntimeError("kernels were imported under TRITON_INTERPRET=1; unset it to benchmark")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    g = torch.Generator(device=device).manual_seed(0)
    cache = _paged_cache(g, device)

    def timed(fn: Callable[[], Any]) -> float:
        return _time_ms(fn, warmup, iters)

    rows = _store_rows(kernels, cache, g, device, timed)
    rows += _decode_rows(kernels, cache, g, device, timed)
    rows += _prefill_rows(kernels, cache, g, device, timed)
    # achievable bandwidth: copy as many bytes as the decode kernel moves
    qo_bytes = 2 * BATCH * NUM_HEADS * HEAD_DIM * _ES
    src = torch.empty((cache.kv_bytes + qo_bytes) // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    rows.append(_row("torch_copy (read+write)", f"{src.numel() >> 20} MiB", 2 * src.numel(),
                     timed(lambda: dst.copy_(src))))
    return rows


_ES = torch.tensor([], dtype=DTYPE).element_size()


def _paged_cache(g: torch.Generator, device: torch.device) -> _Cache:
    blocks_per_seq = CONTEXT // BLOCK_SIZE
    num_blocks = BATCH * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=g, device=device).to(DTYPE)
    v_cache = torch.randn(shape, generator=g, device=device).to(DTYPE)
    block_tables = torch.randperm(num_blocks, generator=g, device=device).to(torch.int32).view(BATCH, blocks_per_seq)
    seq_lens = torch.full((BATCH,), CONTEXT, dtype=torch.int32, device=device)
    kv_bytes = 2 * BATCH * CONTEXT * NUM_KV_HEADS * HEAD_DIM * _ES
    return _Cache(k_cache, v_cache, block_tables, seq_lens, num_blocks, kv_bytes)


def _store_rows(kernels: Any, c: _Cache, g: torch.Generator, device: torch.device,
                timed: Callable[[Callable[[], Any]], float]) -> list[dict]:
    """store_kvcache: one decode step (one new token per sequence), then a prefill-sized
    write (16 x 1024 tokens)."""
    key = torch.randn(BATCH, NUM_KV_HEADS, HEAD_DIM, generator=g, device=device).to(DTYPE)
    value = torch.randn_like(key)
    slots = (c.block_tables[:, -1].long() * BLOCK_SIZE + BLOCK_SIZE - 1).contiguous()
    t = timed(lambda: kernels.store_kvcache(key, value, c.k, c.v, slots))
    rows = [_row("store_kvcache", f"{BATCH} tok", 2 * 2 * key.numel() * _ES + slots.numel() * 8, t)]
    n = 16 * CONTEXT
    key_p = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=g, device=device).to(DTYPE)
    value_p = torch.randn_like(key_p)
    slots_p = torch.randperm(c.num_blocks * BLOCK_SIZE, generator=g, device=device)[:n]
    t = timed(lambda: kernels.store_kvcache(key_p, value_p, c.k, c.v, slots_p))
    rows.append(_row("store_kvcache", f"{n} tok", 2 * 2 * key_p.numel() * _ES + n * 8, t))
    return rows


def _decode_rows(kernels: Any, c: _Cache, g: torch.Generator, device: torch.device,
                 timed: Callable[[Callable[[], Any]], float]) -> list[dict]:
    """paged_decode_attention: batch 256 x context 1024, then batch 8 (the context split
    across programs: flash-decoding)."""
    scale = HEAD_DIM**-0.5
    q = torch.randn(BATCH, NUM_HEADS, HEAD_DIM, generator=g, device=device).to(DTYPE)
    qo_bytes = 2 * q.numel() * _ES
    t = timed(lambda: kernels.paged_decode_attention(q, c.k, c.v, c.block_tables, c.seq_lens, scale))
    rows = [_row("paged_decode_attention", f"b{BATCH} ctx{CONTEXT}", c.kv_bytes + qo_bytes, t)]
    b8 = 8
    t = timed(lambda: kernels.paged_decode_attention(q[:b8], c.k, c.v, c.block_tables[:b8],
                                                     c.seq_lens[:b8], scale))
    rows.append(_row("paged_decode_attention", f"b{b8} ctx{CONTEXT} (split)",
                     c.kv_bytes * b8 // BATCH + qo_bytes * b8 // BATCH, t))
    return rows


def _prefill_rows(kernels: Any, c: _Cache, g: torch.Generator, device: torch.device,
                  timed: Callable[[Callable[[], Any]], float]) -> list[dict]:
    """paged_prefill_attention, decode-heavy (8 new tokens per sequence over a 1024 context),
    then a full prefill 16 x 1024 (compute-bound: TFLOP/s too)."""
    scale, qlen = HEAD_DIM**-0.5, 8
    qp = torch.randn(BATCH * qlen, NUM_HEADS, HEAD_DIM, generator=g, device=device).to(DTYPE)
    cu = torch.arange(0, (BATCH + 1) * qlen, qlen, dtype=torch.int32, device=device)
    t = timed(lambda: kernels.paged_prefill_attention(qp, c.k, c.v, c.block_tables, cu,
                                                      c.seq_lens, qlen, scale))
    rows = [_row("paged_prefill_attention", f"b{BATCH} q{qlen} ctx{CONTEXT}",
                 c.kv_bytes + 2 * qp.numel() * _ES, t)]
    bp = 16
    qf = torch.randn(bp * CONTEXT, NUM_HEADS, HEAD_DIM, generator=g, device=device).to(DTYPE)
    cuf = torch.arange(0, (bp + 1) * CONTEXT, CONTEXT, dtype=torch.int32, device=device)
    t = timed(lambda: kernels.paged_prefill_attention(qf, c.k, c.v, c.block_tables[:bp], cuf,
                                                      c.seq_lens[:bp], CONTEXT, scale))
    row = _row("paged_prefill_attention", f"b{bp} q{CONTEXT} ctx{CONTEXT}",
               c.kv_bytes * bp // BATCH + 2 * qf.numel() * _ES, t)
    causal_flops = 4 * bp * NUM_HEADS * HEAD_DIM * CONTEXT * (CONTEXT + 1) / 2
    row["tflop_per_s"] = causal_flops / (row["ms"] * 1e-3) / 1e12
    rows.append(row)
    return rows


def _print_table(rows: list[dict]) -> None:
    print(f"{torch.cuda.get_device_name()}  bf16  heads {NUM_HEADS}/{NUM_KV_HEADS}  head_dim {HEAD_DIM}  block_size {BLOCK_SIZE}")
    print(f"{'kernel':<26} {'shape':<24} {'MB':>9} {'ms':>9} {'GB/s':>8} {'eager ms':>9} {'TFLOP/s':>8}")
    for r in rows:
        tf = f"{r['tflop_per_s']:8.1f}" if "tflop_per_s" in r else ""
        print(f"{r['name']:<26} {r['shape']:<24} {r['bytes'] / 1e6:9.2f} {r['ms']:9.4f} {r['gb_per_s']:8.0f} {r['eager_ms']:9.4f} {tf}")


if __name__ == "__main__":
    _print_table(measure_bandwidth())
