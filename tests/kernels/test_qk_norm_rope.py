"""The fused attention prologue (q/k RMSNorm + rotary) against the model's own layers; its
variant that also stores K/V against the store kernel's reference.

The oracle is what the model computes without the kernel: ``nvray.layers``' RMSNorm and
RotaryEmbedding modules applied to q and k split from the projection output (the path that
``tests/test_model_vs_hf.py`` holds to HF transformers). The kernel must match it in float32; in
float16 and bfloat16, where it rounds once instead of three times, it must be at least as close
to the float32 result as the layers (bfloat16 on the GPU only: Triton's interpreter truncates
to bfloat16 instead of rounding to nearest).
Runs under the Triton interpreter on CPU, compiled on a GPU.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
import torch  # noqa: E402

import kernel_refs  # noqa: E402
import kernels  # noqa: E402
from kernel_device import kernel_device  # noqa: E402
from nvray.layers.norm import RMSNorm  # noqa: E402
from nvray.layers.rotary import RotaryEmbedding  # noqa: E402

INTERPRET, DEVICE = kernel_device()


def _layers_path(qkv, positions, rotary, q_norm, k_norm, num_heads, num_kv_heads, head_dim):
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(-1, num_heads, head_dim)
    k = k.reshape(-1, num_kv_heads, head_dim)
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    return rotary(positions, q, k)


def _float(*norms):
    """float32 copies of the norms (None stays None)."""
    out = []
    for m in norms:
        if m is not None:
            copy = RMSNorm(m.weight.shape[0], m.eps)
            copy.weight.data = m.weight.data.float()
            m = copy
        out.append(m)
    return out


def _case(num_tokens, num_heads, num_kv_heads, head_dim, dtype, norm, seed, extra_cols=0):
    g = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    wide = torch.randn(num_tokens, width + extra_cols, generator=g) * 3
    qkv = wide.to(dtype=dtype, device=DEVICE)[:, :width]  # rows strided when extra_cols > 0
    positions = torch.randint(0, 4096, (num_tokens,), generator=g, dtype=torch.int32).to(DEVICE)
    rotary = RotaryEmbedding(head_dim, 4096, 1e6).to(DEVICE)
    q_norm = k_norm = None
    if norm:
        q_norm, k_norm = RMSNorm(head_dim, 1e-6), RMSNorm(head_dim, 1e-6)
        for m in (q_norm, k_norm):
            m.weight.data = (1 + 0.5 * torch.randn(head_dim, generator=g)).to(dtype=dtype, device=DEVICE)
    return qkv, positions, rotary, q_norm, k_norm


@pytest.mark.parametrize("dtype", [
    torch.float32, torch.float16,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
        INTERPRET, reason="Triton's interpreter truncates to bf16 instead of rounding"))])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(16, 8, 128), (6, 1, 32), (4, 4, 64)])
@pytest.mark.parametrize("norm", [True, False])
def test_matches_the_model_layers(dtype, num_heads, num_kv_heads, head_dim, norm):
    qkv, positions, rotary, q_norm, k_norm = _case(7, num_heads, num_kv_heads, head_dim, dtype,
                                                    norm, seed=head_dim + num_heads, extra_cols=24)
    want_q, want_k = _layers_path(qkv, positions, rotary, q_norm, k_norm, num_heads,
                                  num_kv_heads, head_dim)
    args = (qkv, positions, rotary.cos_sin, num_heads, num_kv_heads,
            q_norm.weight if norm else None, k_norm.weight if norm else None, 1e-6)
    q, k = kernels.qk_norm_rope(*args)
    assert q.shape == want_q.shape and k.shape == want_k.shape and q.dtype == dtype
    if dtype == torch.float32:  # the same operations
        torch.testing.assert_close(q, want_q, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k, want_k, atol=1e-5, rtol=1e-5)
    else:  # 16-bit: fewer roundings than the layers, so at least as close to float32
        truth = _layers_path(qkv.float(), positions, rotary, *_float(q_norm, k_norm), num_heads,
                             num_kv_heads, head_dim)
        for got, want, exact in ((q, want_q, truth[0]), (k, want_k, truth[1])):
            layers_err = (want.float() - exact).abs()
            kernel_err = (got.float() - exact).abs()
            assert kernel_err.max() <= 1.5 * layers_err.max()
            assert kernel_err.mean() <= 1.1 * layers_err.mean()
    ref_q, ref_k = kernel_refs.qk_norm_rope_ref(*args)  # the same roundings as the kernel
    ulp = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(q, ref_q, **ulp)
    torch.testing.assert_close(k, ref_k, **ulp)


def test_no_tokens():
    qkv, positions, rotary, q_norm, k_norm = _case(0, 4, 2, 32, torch.float32, True, seed=3)
    q, k = kernels.qk_norm_rope(qkv, positions, rotary.cos_sin, 4, 2, q_norm.weight,
                                k_norm.weight, 1e-6)
    assert q.shape == (0, 4, 32) and k.shape == (0, 2, 32)


def test_validation_names_the_argument():
    qkv, positions, rotary, q_norm, k_norm = _case(3, 4, 2, 32, torch.float32, True, seed=5)
    cos_sin, qw, kw = rotary.cos_sin, q_norm.weight, k_norm.weight
    bad_calls = [
        ("qkv", (qkv[:, :-32], positions, cos_sin, 4, 2, qw, kw)),
        ("positions", (qkv, positions[:2], cos_sin, 4, 2, qw, kw)),
        ("positions", (qkv, positions.float(), cos_sin, 4, 2, qw, kw)),
        ("cos_sin", (qkv, positions, cos_sin.half(), 4, 2, qw, kw)),
        ("q_weight, k_weight", (qkv, positions, cos_sin, 4, 2, qw, None)),
        ("k_weight", (qkv, positions, cos_sin, 4, 2, qw, kw[:16])),
    ]
    for name, args in bad_calls:
        with pytest.raises(ValueError, match=name):
            kernels.qk_norm_rope(*args, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(16, 8, 128), (6, 1, 32), (4, 4, 64)])
@pytest.mark.parametrize("norm", [True, False])
def test_store_variant_writes_what_the_store_kernel_would(dtype, num_heads, num_kv_heads,
                                                          head_dim, norm):
    """q as from ``qk_norm_rope``; k (normalized, rotated) and v (the projection's) in the cache
    slots that ``store_kvcache`` would fill; tokens with slot -1 and every other slot untouched."""
    qkv, positions, rotary, q_norm, k_norm = _case(6, num_heads, num_kv_heads, head_dim, dtype,
                                                    norm, seed=head_dim + 7, extra_cols=16)
    args = (qkv, positions, rotary.cos_sin, num_heads, num_kv_heads,
            q_norm.weight if norm else None, k_norm.weight if norm else None, 1e-6)
    want_q, k = kernels.qk_norm_rope(*args)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].reshape(-1, num_kv_heads, head_dim)
    slots = torch.tensor([5, -1, 0, 17, 30, 8], dtype=torch.int32, device=DEVICE)
    shape = (4, 8, num_kv_heads, head_dim)  # 4 blocks of 8 slots
    fill = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(dtype=dtype, device=DEVICE)
    want_k, want_v = fill.clone(), fill.clone() + 1
    kernel_refs.store_kvcache_ref(k, v, want_k, want_v, slots)
    k_cache, v_cache = fill.clone(), fill.clone() + 1
    q = kernels.qk_norm_rope_store(*args, k_cache, v_cache, slots)
    torch.testing.assert_close(q, want_q, atol=0, rtol=0)
    torch.testing.assert_close(k_cache, want_k, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, want_v, atol=0, rtol=0)


def test_store_variant_validation_names_the_argument():
    qkv, positions, rotary, q_norm, k_norm = _case(3, 4, 2, 32, torch.float32, True, seed=5)
    args = (qkv, positions, rotary.cos_sin, 4, 2, q_norm.weight, k_norm.weight, 1e-6)
    cache = torch.zeros(2, 4, 2, 32, device=DEVICE)
    slots = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    bad_calls = [
        ("k_cache", (cache[:, :, :1], cache, slots)),
        ("v_cache", (cache, cache.half(), slots)),
        ("v_cache", (cache, cache[:1], slots)),
        ("slot_mapping", (cache, cache, slots[:2])),
        ("slot_mapping", (cache, cache, slots.float())),
    ]
    for name, extra in bad_calls:
        with pytest.raises(ValueError, match=name):
            kernels.qk_norm_rope_store(*args, *extra)


@pytest.mark.skipif(INTERPRET, reason="Triton 3.6's interpreter does not round to e4m3: compiled only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_store_variant_into_an_fp8_cache_writes_what_the_store_reference_would(dtype):
    """An FP8 cache gets the same k and v rounded to e4m3, large values saturated at ±448."""
    num_heads, num_kv_heads, head_dim = 16, 8, 128
    qkv, positions, rotary, q_norm, k_norm = _case(6, num_heads, num_kv_heads, head_dim, dtype,
                                                    True, seed=11, extra_cols=0)
    qkv[:, (num_heads + num_kv_heads) * head_dim:] *= 300  # v beyond e4m3's range in places
    args = (qkv, positions, rotary.cos_sin, num_heads, num_kv_heads, q_norm.weight,
            k_norm.weight, 1e-6)
    want_q, k = kernels.qk_norm_rope(*args)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].reshape(-1, num_kv_heads, head_dim)
    slots = torch.tensor([5, -1, 0, 17, 30, 8], dtype=torch.int32, device=DEVICE)
    shape = (4, 8, num_kv_heads, head_dim)
    want_k = torch.zeros(shape, dtype=torch.float8_e4m3fn, device=DEVICE)
    want_v = want_k.clone()
    kernel_refs.store_kvcache_ref(k, v, want_k, want_v, slots)
    k_cache, v_cache = want_k.clone().zero_(), want_v.clone().zero_()
    q = kernels.qk_norm_rope_store(*args, k_cache, v_cache, slots)
    torch.testing.assert_close(q, want_q, atol=0, rtol=0)
    assert want_v.float().abs().max() == 448  # the saturation was exercised
    assert torch.equal(k_cache.float(), want_k.float()) and torch.equal(v_cache.float(), want_v.float())
