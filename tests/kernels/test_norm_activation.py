"""The hidden-state RMSNorm (with and without the residual add) and the MLP's gated activation
kernels against the model's own layers.

The oracle is what ``nvray.layers`` computes without the kernels (the path that
``tests/test_model_vs_hf.py`` holds to HF transformers). In float32 the kernels must match it;
in 16-bit, where they round once instead of after every operation, they must be at least as
close to the float32 result as the layers (bfloat16 on the GPU only: Triton's interpreter
truncates to bfloat16 instead of rounding to nearest). Runs under the Triton interpreter on
CPU, compiled on a GPU.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
import torch  # noqa: E402

import kernel_refs  # noqa: E402
import kernels  # noqa: E402
from kernel_device import kernel_device  # noqa: E402
from nvray.layers.activation import silu_and_mul  # noqa: E402
from nvray.layers.norm import add_rms_norm, rms_norm  # noqa: E402

INTERPRET, DEVICE = kernel_device()
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    INTERPRET, reason="Triton's interpreter truncates to bf16 instead of rounding"))]


def _rows(num_tokens: int, width: int, dtype: torch.dtype, seed: int, extra_cols: int = 0
          ) -> torch.Tensor:
    """[num_tokens, width], rows strided when extra_cols > 0."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(num_tokens, width + extra_cols, generator=g) * 3
    return wide.to(dtype=dtype, device=DEVICE)[:, :width]


def _assert_as_close_as_the_layers(got: torch.Tensor, layers: torch.Tensor,
                                   truth: torch.Tensor) -> None:
    layers_err = (layers.float() - truth).abs()
    kernel_err = (got.float() - truth).abs()
    assert kernel_err.max() <= 1.5 * layers_err.max() + 1e-6
    assert kernel_err.mean() <= 1.1 * layers_err.mean() + 1e-7


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", [(7, 1024), (3, 96), (1, 2560)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_matches_the_layers(dtype, num_tokens, hidden, with_residual):
    x = _rows(num_tokens, hidden, dtype, seed=hidden + num_tokens, extra_cols=40)
    residual = _rows(num_tokens, hidden, dtype, seed=hidden, extra_cols=8) if with_residual else None
    g = torch.Generator().manual_seed(1)
    weight = (1 + 0.5 * torch.randn(hidden, generator=g)).to(dtype=dtype, device=DEVICE)
    if with_residual:
        out, new_residual = kernels.rms_norm(x, weight, 1e-6, residual)
        want, want_residual = add_rms_norm(x, residual, weight, 1e-6)
        torch.testing.assert_close(new_residual, want_residual, atol=0, rtol=0)  # one rounded add
        truth = rms_norm((x.float() + residual.float()), weight.float(), 1e-6)
    else:
        out = kernels.rms_norm(x, weight, 1e-6)
        want = rms_norm(x, weight, 1e-6)
        truth = rms_norm(x.float(), weight.float(), 1e-6)
    assert out.shape == (num_tokens, hidden) and out.dtype == dtype and out.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    else:
        _assert_as_close_as_the_layers(out, want, truth)
    ref = kernel_refs.rms_norm_ref(x, weight, 1e-6, residual)  # the kernel's own roundings
    ref = ref[0] if with_residual else ref
    ulp = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(out, ref, **ulp)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,inter", [(5, 3072), (2, 100), (1, 1)])
def test_silu_and_mul_matches_the_layer(dtype, num_tokens, inter):
    x = _rows(num_tokens, 2 * inter, dtype, seed=inter, extra_cols=16)
    out = kernels.silu_and_mul(x)
    assert out.shape == (num_tokens, inter) and out.dtype == dtype and out.is_contiguous()
    want = silu_and_mul(x)
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    else:
        _assert_as_close_as_the_layers(out, want, silu_and_mul(x.float()))
    ulp = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(out, kernel_refs.silu_and_mul_ref(x), **ulp)


def test_no_tokens():
    x = torch.empty(0, 64, device=DEVICE)
    weight = torch.ones(64, device=DEVICE)
    assert kernels.rms_norm(x, weight, 1e-6).shape == (0, 64)
    out, res = kernels.rms_norm(x, weight, 1e-6, x)
    assert out.shape == res.shape == (0, 64)
    assert kernels.silu_and_mul(x).shape == (0, 32)


def test_validation_names_the_argument():
    x = _rows(3, 64, torch.float32, seed=2)
    weight = torch.ones(64, device=DEVICE)
    bad_norms = [
        ("x", (x[0], weight, 1e-6)),
        ("x", (x.to(torch.int32), weight, 1e-6)),
        ("weight", (x, weight[:32], 1e-6)),
        ("residual", (x, weight, 1e-6, x[:2])),
        ("residual", (x, weight, 1e-6, x.half())),
    ]
    for name, args in bad_norms:
        with pytest.raises(ValueError, match=name):
            kernels.rms_norm(*args)
    for bad in (x[:, :63], x[0], x.to(torch.int32)):
        with pytest.raises(ValueError, match="x"):
            kernels.silu_and_mul(bad)


# --- FP8 outputs: the kernels quantizing for the FP8 layer they feed ---------------------------
# The oracle is the unfused pair the layers ran before: the 16/32-bit kernel, then the
# activation quantization kernel. Fused, the values must be the same (both quantize the output
# rounded to x's dtype): identical under the interpreter; compiled, the two kernels may sum a
# row's squares in another order, so a scale may move by an ulp of x's dtype and a value by one
# e4m3 step, rarely. Against the pure-torch references the scales must agree (the interpreter
# does not round to e4m3, so the quantized values are compared to the unfused kernels only).

FP8_GROUPS = [None, 128, 32]


def _assert_same_quantization(fused, q: torch.Tensor, scale: torch.Tensor) -> None:
    if INTERPRET:
        assert torch.equal(fused.scale, scale) and torch.equal(fused.q.float(), q.float())
        return
    ulp = torch.finfo(fused.dtype).eps
    torch.testing.assert_close(fused.scale, scale, atol=0, rtol=4 * ulp)
    group = q.shape[1] // scale.shape[1]
    got = fused.q.float() * fused.scale.repeat_interleave(group, dim=1)
    want = q.float() * scale.repeat_interleave(group, dim=1)
    step = torch.maximum(want.abs() / 8, scale.repeat_interleave(group, dim=1) / 512)
    assert ((got - want).abs() <= step * 1.01 + want.abs() * 4 * ulp).all(), "one e4m3 step at most"
    assert (fused.q.float() != q.float()).float().mean() <= 0.01, "values off by a step are rare"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", [(7, 1024), (3, 96), (2, 2560)])
@pytest.mark.parametrize("group", FP8_GROUPS)
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_fp8_equals_the_norm_then_quantization(dtype, num_tokens, hidden, group,
                                                        with_residual):
    if group is not None and hidden % group:
        pytest.skip("groups divide the row")
    x = _rows(num_tokens, hidden, dtype, seed=hidden + 3, extra_cols=24)
    residual = _rows(num_tokens, hidden, dtype, seed=hidden, extra_cols=8) if with_residual else None
    g = torch.Generator().manual_seed(2)
    weight = (1 + 0.5 * torch.randn(hidden, generator=g)).to(dtype=dtype, device=DEVICE)
    fused = kernels.rms_norm_fp8(x, weight, 1e-6, residual, group)
    plain = kernels.rms_norm(x, weight, 1e-6, residual)
    ref = kernel_refs.rms_norm_fp8_ref(x, weight, 1e-6, residual, group)
    if with_residual:
        (fused, new_residual), (plain, want_residual), ref = fused, plain, ref[0]
        assert torch.equal(new_residual, want_residual)
    q, scale = kernels.quantize_fp8_act(plain, group)
    assert fused.q.dtype == torch.float8_e4m3fn and fused.dtype == dtype
    _assert_same_quantization(fused, q, scale)
    torch.testing.assert_close(fused.scale, ref.scale, atol=0, rtol=2e-2 if dtype != torch.float32 else 1e-5)
    assert fused.scale.shape == (num_tokens, 1 if group is None else hidden // group)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,inter,group", [(5, 3072, None), (5, 3072, 128), (3, 5000, None),
                                                    (2, 20000, None), (2, 100, None), (1, 1, None),
                                                    (4, 96, 32), (3, 1152, 128)])
def test_silu_and_mul_fp8_equals_the_activation_then_quantization(dtype, num_tokens, inter, group):
    x = _rows(num_tokens, 2 * inter, dtype, seed=inter + 1, extra_cols=16)
    fused = kernels.silu_and_mul_fp8(x, group)
    q, scale = kernels.quantize_fp8_act(kernels.silu_and_mul(x), group)
    assert fused.q.dtype == torch.float8_e4m3fn and fused.dtype == dtype
    _assert_same_quantization(fused, q, scale)
    ref = kernel_refs.silu_and_mul_fp8_ref(x, group)
    torch.testing.assert_close(fused.scale, ref.scale, atol=0, rtol=2e-2 if dtype != torch.float32 else 1e-5)


def test_fp8_outputs_refuse_groups_that_do_not_fit():
    x = _rows(2, 96, torch.float32, seed=4)
    weight = torch.ones(96, device=DEVICE)
    for bad in (64, 48, 0):
        with pytest.raises(ValueError, match="group"):
            kernels.rms_norm_fp8(x, weight, 1e-6, None, bad)
        with pytest.raises(ValueError, match="group"):
            kernels.silu_and_mul_fp8(_rows(2, 192, torch.float32, seed=5), bad)
    empty = kernels.rms_norm_fp8(x[:0], weight, 1e-6, None, 32)
    assert empty.q.shape == (0, 96) and empty.scale.shape == (0, 3)
    assert kernels.silu_and_mul_fp8(x[:0]).q.shape == (0, 48)


def test_layers_fuse_only_groups_the_kernels_take():
    """A norm before an FP8 layer hands it an Fp8Activation where the layer's activation groups
    are a power of two wide (or per token); a 384-column block keeps the layer's own
    quantization (the norm's output stays a 16/32-bit tensor)."""
    from nvray.quantization import Fp8Config, Fp8LinearMethod
    from nvray.layers.norm import RMSNorm
    from nvray.quantization.fp8_math import Fp8Activation

    x = _rows(3, 768, torch.float32, seed=6)
    for block, fused in [(None, True), ((128, 128), True), ((128, 384), False)]:
        method = Fp8LinearMethod(Fp8Config(block=block, scale_name="weight_scale", source="test"))
        norm = RMSNorm(768, 1e-6, quantize_for=method).to(DEVICE)
        norm.use_triton_kernels()
        out = norm(x)
        assert isinstance(out, Fp8Activation) == fused, block
        if fused:
            assert out.scale.shape == (3, 1 if block is None else 768 // block[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", [(5, 1024), (3, 96)])
@pytest.mark.parametrize("num_parts", [1, 2, 4])
@pytest.mark.parametrize("group", [False, None, 32])
def test_sum_rms_norm_equals_the_all_reduce_then_the_norm(dtype, num_tokens, hidden, num_parts,
                                                          group):
    """The TP all-reduce fused into the norm (each part: one rank's partial sum, read where it
    lies) gives what summing the parts, rounding once and norming them gives."""
    parts = [_rows(num_tokens, hidden, dtype, seed=10 * hidden + p) for p in range(num_parts)]
    residual = _rows(num_tokens, hidden, dtype, seed=hidden, extra_cols=8)
    weight = (1 + 0.5 * torch.randn(hidden, generator=torch.Generator().manual_seed(3))).to(
        dtype=dtype, device=DEVICE)
    ptrs = torch.tensor([p.data_ptr() for p in parts], dtype=torch.int64, device=DEVICE)
    out, new_residual = kernels.sum_rms_norm(ptrs, residual, weight, 1e-6, group)
    summed = torch.stack([p.float() for p in parts]).sum(0).to(dtype)
    if group is False:
        want, want_residual = kernels.rms_norm(summed, weight, 1e-6, residual)
        assert torch.equal(out, want)
    else:
        want, want_residual = kernels.rms_norm_fp8(summed, weight, 1e-6, residual, group)
        assert torch.equal(out.q.float(), want.q.float()) and torch.equal(out.scale, want.scale)
    assert torch.equal(new_residual, want_residual)
    ref, ref_residual = kernel_refs.sum_rms_norm_ref(parts, residual, weight, 1e-6, group)
    assert torch.equal(ref_residual, want_residual)
    if group is False:
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(out, ref, **tol)


def test_sum_rms_norm_names_bad_peer_addresses():
    residual = torch.zeros(2, 64, device=DEVICE)
    weight = torch.ones(64, device=DEVICE)
    for bad in (torch.zeros(2, dtype=torch.int32, device=DEVICE),
                torch.zeros(0, dtype=torch.int64, device=DEVICE)):
        with pytest.raises(ValueError, match="peer_ptrs"):
            kernels.sum_rms_norm(bad, residual, weight, 1e-6)
