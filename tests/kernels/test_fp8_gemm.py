"""FP8 linear kernels (kernels/fp8_gemm.py) against their torch references: under the Triton
interpreter on CPU, compiled on a GPU (there also at Qwen3-0.6B/8B layer shapes, and the
``torch._scaled_mm`` per-channel path, which has no CPU kernel).

Triton 3.6's interpreter converts float32 to e4m3 without rounding to nearest, so the quantized
activation values themselves are compared compiled only; their scales, and the GEMM on given
FP8 operands, are compared everywhere.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
import torch  # noqa: E402

import kernel_refs  # noqa: E402
import kernels  # noqa: E402
from kernel_device import kernel_device  # noqa: E402
from nvray.quantization.fp8_math import quantize_per_block, quantize_per_channel  # noqa: E402

INTERPRET, DEVICE = kernel_device()
BLOCK = (128, 128)
REAL_SHAPES = [(1024, 4096), (3072, 1024), (6144, 1024), (4096, 12288)]  # (N, K) of 0.6B / 8B layers


def _operands(m: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 2).to(DEVICE)
    x[0, :7] = 0.0  # a partly zero row; a whole zero row below
    if m > 2:
        x[2] = 0.0
    w = (torch.randn(n, k, generator=g) * 0.05).to(DEVICE)
    return x, w


@pytest.mark.parametrize("group", [None, 128])
def test_activation_quantization_matches_reference(group):
    x, _ = _operands(9, 8, 384, seed=1)
    q, scale = kernels.quantize_fp8_act(x, group)
    q_ref, scale_ref = kernel_refs.quantize_fp8_act_ref(x, group)
    torch.testing.assert_close(scale, scale_ref, atol=0, rtol=1e-6)
    if not INTERPRET:
        assert torch.equal(q.float(), q_ref.float())
    assert torch.isfinite(q.float()).all() and q.float().abs().max() <= 448


@pytest.mark.parametrize("m", [1, 5, 70])
def test_block_fp8_gemm_matches_reference(m):
    x, w = _operands(m, 200, 256, seed=m)  # 200 rows: the last weight block is partial
    wq, ws = quantize_per_block(w.cpu(), BLOCK)
    wq, ws = wq.to(DEVICE), ws.to(DEVICE)
    aq, a_scale = kernel_refs.quantize_fp8_act_ref(x, BLOCK[1])
    out = kernels.block_fp8_mm(aq, a_scale, wq, ws, BLOCK, torch.float32)
    ref = kernel_refs.block_fp8_mm_ref(aq, a_scale, wq, ws, BLOCK, torch.float32)
    # Hopper's FP8 tensor cores accumulate a K block in less than fp32 precision
    torch.testing.assert_close(out, ref, atol=2e-3 * ref.abs().max().item(), rtol=1e-3)


def test_block_fp8_gemm_rejects_mismatched_scales():
    x, w = _operands(3, 256, 256, seed=2)
    wq, ws = quantize_per_block(w.cpu(), BLOCK)
    aq, a_scale = kernel_refs.quantize_fp8_act_ref(x, BLOCK[1])
    with pytest.raises(ValueError, match="scales"):
        kernels.block_fp8_mm(aq, a_scale[:, :1], wq.to(DEVICE), ws.to(DEVICE), BLOCK, torch.float32)


@pytest.mark.parametrize("m,n,k", [(1, 200, 256), (5, 200, 512), (70, 96, 272), (130, 300, 128)])
def test_channel_fp8_gemm_matches_reference(m, n, k):
    """Per-channel weights, per-token activations; K a multiple of 256, of 16 only, and one tile;
    rows and columns off the tile grid."""
    x, w = _operands(m, n, k, seed=m + k)
    wq, ws = quantize_per_channel(w.cpu())
    aq, a_scale = kernel_refs.quantize_fp8_act_ref(x, None)
    out = kernels.channel_fp8_mm(aq, a_scale, wq.to(DEVICE), ws.to(DEVICE), torch.float32)
    ref = kernel_refs.channel_fp8_mm_ref(aq, a_scale, wq.to(DEVICE), ws.to(DEVICE), torch.float32)
    torch.testing.assert_close(out, ref, atol=2e-3 * ref.abs().max().item(), rtol=1e-3)
    with pytest.raises(ValueError, match="scales"):
        kernels.channel_fp8_mm(aq, a_scale.repeat(1, 2), wq.to(DEVICE), ws.to(DEVICE), torch.float32)


@pytest.mark.skipif(INTERPRET, reason="torch._scaled_mm and the real shapes: compiled only")
@pytest.mark.parametrize("n,k", REAL_SHAPES)
@pytest.mark.parametrize("block", [None, BLOCK])
@pytest.mark.parametrize("m", [1, 37, 256, 1100])
def test_fp8_linear_matches_reference_at_real_shapes(m, n, k, block):
    x, w = _operands(m, n, k, seed=n + m)
    x = x.to(torch.bfloat16)
    wq, ws = quantize_per_channel(w) if block is None else quantize_per_block(w, block)
    out = kernels.fp8_linear(x, wq, ws, block, None).float()
    ref = kernel_refs.fp8_linear_ref(x.float(), wq, ws, block, None)
    # both multiply the same FP8 values; the difference is bf16 output rounding and fp32 order
    torch.testing.assert_close(out, ref, atol=2e-2 * ref.abs().max().item(), rtol=1e-2)


@pytest.mark.parametrize("block,m,n,k", [(None, 6, 256, 256), (BLOCK, 6, 256, 256),
                                         (None, 140, 16384, 1024)])  # the last on cuBLAS
def test_fp8_linear_takes_an_activation_quantized_before_it(block, m, n, k):
    """A layer given the Fp8Activation a fused norm or activation kernel made computes what it
    computes quantizing the same input itself; scales of another grouping are refused."""
    from nvray.quantization.fp8_math import Fp8Activation

    x, w = _operands(m, n, k, seed=3)
    wq, ws = quantize_per_channel(w.cpu()) if block is None else quantize_per_block(w.cpu(), block)
    wq, ws = wq.to(DEVICE), ws.to(DEVICE)
    group = None if block is None else block[1]
    act = Fp8Activation(*kernels.quantize_fp8_act(x, group), x.dtype)
    torch.testing.assert_close(kernels.fp8_linear(act, wq, ws, block, None),
                               kernels.fp8_linear(x, wq, ws, block, None), atol=0, rtol=0)
    act_ref = Fp8Activation(*kernel_refs.quantize_fp8_act_ref(x, group), x.dtype)  # rounds to e4m3
    torch.testing.assert_close(kernel_refs.fp8_linear_ref(act_ref, wq, ws, block, None),
                               kernel_refs.fp8_linear_ref(x, wq, ws, block, None), atol=1e-5, rtol=1e-5)
    other = Fp8Activation(*kernels.quantize_fp8_act(x, 128 if block is None else None), x.dtype)
    for linear in (kernels.fp8_linear, kernel_refs.fp8_linear_ref):
        with pytest.raises(ValueError, match="does not fit"):
            linear(other, wq, ws, block, None)


@pytest.mark.skipif(INTERPRET, reason="Hopper's FP8 accumulation precision: compiled only")
@pytest.mark.parametrize("m", [16, 128])
def test_channel_fp8_gemm_accumulates_in_fp32_over_long_k(m):
    """Qwen3-8B's down_proj has K = 12,288. Positive operands make every partial sum grow, so an
    accumulator kept in the tensor cores' reduced precision over the whole K loop (Triton's
    default on sm90) falls 23% short of the exact sum on an H100; with each K tile's sum added
    in fp32 the error was 1.7e-3, below a bf16 output's own rounding (up to 2^-8)."""
    k, n = 12288, 256
    g = torch.Generator().manual_seed(m)
    x = (torch.rand(m, k, generator=g) + 0.5).to(DEVICE)
    w = (torch.rand(n, k, generator=g) + 0.5).to(DEVICE)
    wq, ws = quantize_per_channel(w)
    aq, a_scale = kernels.quantize_fp8_act(x, None)
    exact = (aq.double() * a_scale.double()) @ (wq.double() * ws.double()).t()
    ours = kernels.channel_fp8_mm(aq, a_scale, wq, ws, torch.float32).double()
    assert float(((ours - exact).abs() / exact.abs()).max()) < 4e-3
