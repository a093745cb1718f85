"""Write new K/V vectors into the paged KV cache.

Contract
--------
``store_kvcache(key, value, k_cache, v_cache, slot_mapping) -> None``

* ``key``, ``value``: ``[num_tokens, num_kv_heads, head_dim]``, same dtype as the
  caches, or any float dtype when the caches are ``float8_e4m3fn`` (an FP8 cache, scale 1:
  values are clamped to ±448 and rounded to nearest). Dims 0 and 1 may have any stride (e.g. slices of a fused qkv
  projection output); the last dim must be contiguous (stride 1).
* ``k_cache``, ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``,
  contiguous, identical shape/dtype/device.
* ``slot_mapping``: ``[num_tokens]`` int32 or int64. Token ``t`` is written to
  slot ``s = slot_mapping[t]``: block ``s // block_size``, offset
  ``s % block_size``. ``s == -1`` (any negative value) means "skip this token".
  Slots must be ``< num_blocks * block_size`` (not checked on device: that
  would need a host sync).

Writes in place; one Triton program per token, covering all KV heads.
``store_kvcache_ref`` is the pure-torch reference with the same signature.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nvray.quantization.fp8_math import FP8_MAX

__all__ = ["store_kvcache"]

_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def saturate_for_cache(x, FP8_CACHE: tl.constexpr):
    """What a KV cache keeps of ``x``: with an e4m3 cache, values saturated at ±448 in fp32
    (the store's cast rounds them); else ``x`` as it is. The fused prologue
    (``qk_norm_rope.py``) stores through it too."""
    if FP8_CACHE:
        x = tl.clamp(x.to(tl.float32), -_FP8_MAX, _FP8_MAX)
    return x


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [T, H, D]
    value_ptr,  # [T, H, D]
    k_cache_ptr,  # [NB, BS, H, D] contiguous
    v_cache_ptr,  # [NB, BS, H, D] contiguous
    slot_ptr,  # [T] int32/int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_slot,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next_power_of_2(NUM_KV_HEADS)
    FP8_CACHE: tl.constexpr,  # the caches are e4m3: saturate before the cast
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t * stride_slot).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h < NUM_KV_HEADS)[:, None]  # [BLOCK_H, 1]
    t64 = t.to(tl.int64)
    k = tl.load(key_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    # The cache is contiguous, so slot s starts at element s * H * D
    # (block b, offset o  ->  (b * BS + o) * H * D  ==  s * H * D).
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    k, v = saturate_for_cache(k, FP8_CACHE), saturate_for_cache(v, FP8_CACHE)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


_INTERPRET = not isinstance(_store_kv_kernel, triton.runtime.jit.JITFunction)


def _check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")


def _check_kernel_device(name: str, t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not _INTERPRET:
        raise ValueError(
            f"{name}: expected a CUDA tensor, got device {t.device} "
            f"(CPU tensors need TRITON_INTERPRET=1 set before triton kernels are imported)"
        )


def _validate(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache: expected 4 dims [num_blocks, block_size, num_kv_heads, head_dim], got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: expected shape {tuple(k_cache.shape)} (same as k_cache), got {tuple(v_cache.shape)}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache: expected dtype {k_cache.dtype} (same as k_cache), got {v_cache.dtype}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not c.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {c.stride()}")
    _, _, num_kv_heads, head_dim = k_cache.shape
    if head_dim < 1 or head_dim & (head_dim - 1):
        raise ValueError(f"k_cache: expected head_dim (dim 3) to be a power of two, got {head_dim}")
    for name, x in (("key", key), ("value", value)):
        if x.dim() != 3 or x.shape[1] != num_kv_heads or x.shape[2] != head_dim:
            raise ValueError(
                f"{name}: expected shape [num_tokens, {num_kv_heads}, {head_dim}], got {tuple(x.shape)}"
            )
        if x.dtype != k_cache.dtype and k_cache.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{name}: expected dtype {k_cache.dtype} (the cache dtype), got {x.dtype}")
        if head_dim > 1 and x.stride(2) != 1:
            raise ValueError(f"{name}: expected a contiguous last dim (stride 1), got strides {x.stride()}")
    if value.shape[0] != key.shape[0]:
        raise ValueError(f"value: expected {key.shape[0]} tokens (same as key), got {value.shape[0]}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping: expected shape [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping: expected dtype int32 or int64, got {slot_mapping.dtype}")
    for name, x in (("value", value), ("v_cache", v_cache), ("slot_mapping", slot_mapping), ("k_cache", k_cache)):
        _check_device(name, x, key.device)


def store_kvcache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int32/int64, -1 = skip
) -> None:
    """Scatter ``key``/``value`` rows into the paged caches at ``slot_mapping``."""
    _validate(key, value, k_cache, v_cache, slot_mapping)
    _check_kernel_device("key", key)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    block_h = triton.next_power_of_2(num_kv_heads)
    tile = block_h * triton.next_power_of_2(head_dim)
    num_warps = 1 if tile <= 512 else (2 if tile <= 2048 else 4)
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), slot_mapping.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        FP8_CACHE=k_cache.dtype == torch.float8_e4m3fn,
        num_warps=num_warps,
    )
