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
    ref = kernels.rms_norm_ref(x, weight, 1e-6, residual)  # the kernel's own roundings
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
    torch.testing.assert_close(out, kernels.silu_and_mul_ref(x), **ulp)


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
