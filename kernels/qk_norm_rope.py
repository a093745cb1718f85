"""Per-head RMSNorm of q and k, then rotary embedding, in one kernel: the attention prologue.

Contract
--------
``qk_norm_rope(qkv, positions, cos_sin, num_heads, num_kv_heads, q_weight, k_weight, eps)
-> (q, k)``

* ``qkv``: ``[num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]``, the fused projection
  output ``[q | k | v]``; rows may have any stride, the last dim must be contiguous.
* ``positions``: ``[num_tokens]`` int32 or int64, each token's position.
* ``cos_sin``: ``[max_position, head_dim]`` float32, ``[cos | sin]`` of each position's
  ``head_dim / 2`` frequencies (NeoX-style rotary, as Qwen uses).
* ``q_weight``, ``k_weight``: ``[head_dim]`` RMSNorm weights in qkv's dtype, or both None for
  a model without q/k norms (Qwen2: rotary only).
* returns ``q`` ``[num_tokens, num_heads, head_dim]`` and ``k`` ``[num_tokens, num_kv_heads,
  head_dim]``, new contiguous tensors in qkv's dtype; ``v`` is simply a view of ``qkv``.

``qk_norm_rope_store(..., eps, k_cache, v_cache, slot_mapping) -> q`` is the same prologue fused
with the KV-cache store: k and v of token ``t`` go straight to slot ``slot_mapping[t]`` of the
caches (the contract of ``store_kv.py``; negative: skipped) and only q is returned. The model
uses this one: a kernel and a round trip of k through memory fewer per layer.

Numerics: norm, weight and rotation all in float32, rounded to the dtype once, at the end. The
model's eager layers (``nvray/layers``) also round after the norm and after the weight; with
those two extra roundings, a bf16 Qwen3-0.6B-shaped model's log-probabilities drifted past the
GPU tier's bf16-noise bound at one position, so the kernel keeps them out. On a decode step of
a small model this replaces four kernels per layer (q norm, k norm, q rotary, k rotary) that
each cost more in launch latency than in bytes moved. One program per token covers all of its q and k heads.
``qk_norm_rope_ref`` is the pure-torch reference with the same signature.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.store_kv import saturate_for_cache

__all__ = ["qk_norm_rope", "qk_norm_rope_store"]


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr,  # [T, (H + 2 KVH) * D]
    pos_ptr,  # [T]
    cos_sin_ptr,  # [P, D] float32
    qw_ptr,  # [D]
    kw_ptr,  # [D]
    q_out_ptr,  # [T, H, D] contiguous
    k_out_ptr,  # [T, KVH, D] contiguous; with STORE: the K cache [NB, BS, KVH, D]
    v_cache_ptr,  # with STORE: the V cache [NB, BS, KVH, D]
    slot_ptr,  # with STORE: [T] cache slot of each token (negative: skip)
    stride_t,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next_power_of_2(NUM_HEADS + NUM_KV_HEADS)
    HAS_NORM: tl.constexpr,
    STORE: tl.constexpr,  # k (and v, copied from qkv) go to their cache slot, not to k_out
    FP8_CACHE: tl.constexpr,  # with STORE: the caches are e4m3 (saturate, then cast)
):
    t = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    heads = tl.arange(0, BLOCK_H)
    offs = tl.arange(0, half)
    is_q = heads < NUM_HEADS
    mask = (heads < NUM_HEADS + NUM_KV_HEADS)[:, None]
    src = qkv_ptr + t * stride_t + heads[:, None] * HEAD_DIM + offs[None, :]  # q and k heads
    x1 = tl.load(src, mask=mask, other=0.0)  # [BLOCK_H, D/2] first halves
    x2 = tl.load(src + half, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if HAS_NORM:
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)  # [BLOCK_H]
        r = tl.rsqrt(ss / HEAD_DIM + eps)[:, None]
        qw1 = tl.load(qw_ptr + offs).to(tl.float32)[None, :]
        qw2 = tl.load(qw_ptr + half + offs).to(tl.float32)[None, :]
        kw1 = tl.load(kw_ptr + offs).to(tl.float32)[None, :]
        kw2 = tl.load(kw_ptr + half + offs).to(tl.float32)[None, :]
        w1 = tl.where(is_q[:, None], qw1, kw1)
        w2 = tl.where(is_q[:, None], qw2, kw2)
        x1 = x1 * r * w1  # float32 throughout: one rounding, at the end
        x2 = x2 * r * w2
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * HEAD_DIM + offs)[None, :]
    sin = tl.load(cos_sin_ptr + pos * HEAD_DIM + half + offs)[None, :]
    o1 = (x1 * cos - x2 * sin).to(dtype)
    o2 = (x2 * cos + x1 * sin).to(dtype)
    q_dst = q_out_ptr + t * (NUM_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + offs[None, :]
    q_mask = is_q[:, None]
    tl.store(q_dst, o1, mask=q_mask)
    tl.store(q_dst + half, o2, mask=q_mask)
    k_heads = heads - NUM_HEADS
    k_mask = mask & (heads >= NUM_HEADS)[:, None]
    if STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot < 0:  # no cache slot: q is stored, k and v are not (as in store_kv.py)
            return
        row = slot * (NUM_KV_HEADS * HEAD_DIM)  # contiguous cache: slot s starts at s * KVH * D
    else:
        row = t * (NUM_KV_HEADS * HEAD_DIM)
    k_off = row + k_heads[:, None] * HEAD_DIM + offs[None, :]
    out_ty = k_out_ptr.dtype.element_ty
    tl.store(k_out_ptr + k_off, saturate_for_cache(o1, FP8_CACHE).to(out_ty), mask=k_mask)
    tl.store(k_out_ptr + k_off + half, saturate_for_cache(o2, FP8_CACHE).to(out_ty), mask=k_mask)
    if STORE:  # v: copied as it is from the projection
        v_src = src + NUM_KV_HEADS * HEAD_DIM  # a k head's row, one KV width further on
        v1 = saturate_for_cache(tl.load(v_src, mask=k_mask), FP8_CACHE)
        v2 = saturate_for_cache(tl.load(v_src + half, mask=k_mask), FP8_CACHE)
        tl.store(v_cache_ptr + k_off, v1.to(out_ty), mask=k_mask)
        tl.store(v_cache_ptr + k_off + half, v2.to(out_ty), mask=k_mask)



_INTERPRET = not isinstance(_qk_norm_rope_kernel, triton.runtime.jit.JITFunction)


def _validate(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
              num_kv_heads: int, q_weight: torch.Tensor | None,
              k_weight: torch.Tensor | None) -> int:
    """Check the arguments; returns head_dim."""
    if cos_sin.dim() != 2 or cos_sin.dtype != torch.float32 or not cos_sin.is_contiguous():
        raise ValueError(f"cos_sin: expected a contiguous float32 [max_position, head_dim] tensor, "
                         f"got {cos_sin.dtype} of shape {tuple(cos_sin.shape)}")
    head_dim = cos_sin.shape[1]
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise ValueError(f"cos_sin: expected head_dim (dim 1) a power of two >= 2, got {head_dim}")
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        raise ValueError(f"qkv: expected shape [num_tokens, {width}] with a contiguous last dim, "
                         f"got shape {tuple(qkv.shape)} strides {qkv.stride()}")
    if positions.dim() != 1 or positions.shape[0] != qkv.shape[0] or positions.dtype not in (
            torch.int32, torch.int64):
        raise ValueError(f"positions: expected int32/int64 of shape [{qkv.shape[0]}], got "
                         f"{positions.dtype} of shape {tuple(positions.shape)}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight, k_weight: give both (q/k norms) or neither (rotary only)")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None and (w.shape != (head_dim,) or w.dtype != qkv.dtype or not w.is_contiguous()):
            raise ValueError(f"{name}: expected a contiguous [{head_dim}] {qkv.dtype} tensor, got "
                             f"{w.dtype} of shape {tuple(w.shape)}")
    for name, x in (("positions", positions), ("cos_sin", cos_sin), ("q_weight", q_weight),
                    ("k_weight", k_weight)):
        if x is not None and x.device != qkv.device:
            raise ValueError(f"{name}: expected device {qkv.device}, got {x.device}")
    return head_dim


def qk_norm_rope(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                 num_heads: int, num_kv_heads: int, q_weight: torch.Tensor | None,
                 k_weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalized, rotated q [T, H, D] and k [T, KVH, D] from the fused projection ``qkv``."""
    head_dim = _validate(qkv, positions, cos_sin, num_heads, num_kv_heads, q_weight, k_weight)
    k = torch.empty(qkv.shape[0], num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    q = _launch(qkv, positions, cos_sin, num_heads, num_kv_heads, head_dim, q_weight, k_weight,
                eps, k, None, None)
    return q, k


def qk_norm_rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                       num_heads: int, num_kv_heads: int, q_weight: torch.Tensor | None,
                       k_weight: torch.Tensor | None, eps: float, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """The prologue that also stores this step's K/V: returns q [T, H, D]; the normalized,
    rotated k and the projection's v of token ``t`` go to cache slot ``slot_mapping[t]``
    (negative: skipped) of ``k_cache``/``v_cache`` ``[num_blocks, block_size, KVH, D]``,
    contiguous, in qkv's dtype or FP8 (e4m3, saturated) — what ``store_kvcache`` would write, without k ever being
    materialized (one kernel and one round trip of k through memory fewer per layer)."""
    head_dim = _validate(qkv, positions, cos_sin, num_heads, num_kv_heads, q_weight, k_weight)
    want = (num_kv_heads, head_dim)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if (c.dim() != 4 or tuple(c.shape[2:]) != want or c.shape != k_cache.shape
                or c.dtype not in (qkv.dtype, torch.float8_e4m3fn) or c.dtype != k_cache.dtype
                or not c.is_contiguous() or c.device != qkv.device):
            raise ValueError(f"{name}: expected a contiguous [num_blocks, block_size, "
                             f"{num_kv_heads}, {head_dim}] {qkv.dtype} or float8_e4m3fn tensor on {qkv.device} "
                             f"(both caches alike), got {c.dtype} of shape {tuple(c.shape)}")
    if (slot_mapping.shape != (qkv.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64)
            or not slot_mapping.is_contiguous() or slot_mapping.device != qkv.device):
        raise ValueError(f"slot_mapping: expected contiguous int32/int64 of shape "
                         f"[{qkv.shape[0]}] on {qkv.device}, got {slot_mapping.dtype} of shape "
                         f"{tuple(slot_mapping.shape)}")
    return _launch(qkv, positions, cos_sin, num_heads, num_kv_heads, head_dim, q_weight, k_weight,
                   eps, k_cache, v_cache, slot_mapping)


def _launch(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
            num_kv_heads: int, head_dim: int, q_weight: torch.Tensor | None,
            k_weight: torch.Tensor | None, eps: float, k_out: torch.Tensor,
            v_cache: torch.Tensor | None, slot_mapping: torch.Tensor | None) -> torch.Tensor:
    """Run the kernel (k to ``k_out``, or with ``v_cache`` to the caches); returns q."""
    if qkv.device.type != "cuda" and not _INTERPRET:
        raise ValueError(f"qkv: expected a CUDA tensor, got device {qkv.device} (CPU tensors "
                         "need TRITON_INTERPRET=1 set before triton kernels are imported)")
    num_tokens = qkv.shape[0]
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    has_norm, store = q_weight is not None, v_cache is not None
    block_h = triton.next_power_of_2(num_heads + num_kv_heads)
    _qk_norm_rope_kernel[(num_tokens,)](
        qkv, positions, cos_sin, q_weight if has_norm else q, k_weight if has_norm else q,
        q, k_out, v_cache if store else q, slot_mapping if store else positions,
        qkv.stride(0), eps,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=block_h,
        HAS_NORM=has_norm, STORE=store, FP8_CACHE=k_out.dtype == torch.float8_e4m3fn,
        num_warps=4 if block_h * head_dim >= 4096 else 2)
    return q
