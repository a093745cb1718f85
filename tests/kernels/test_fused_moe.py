"""The fused MoE kernel (kernels/fused_moe.py) against its torch reference, and both against an
independent naive loop over (token, slot) pairs in float64.

The kernel rounds the activation ``silu(gate) * up`` once to x's dtype, as the reference does, so
kernel and reference agree to the summation order; the naive loop does not round it, so in 16-bit
the two differ from it by about the activation's rounding. Triton's interpreter computes
``tl.dot`` on bf16 operands wrongly (raw bits), so the kernel upcasts them to float32 there, and
it truncates to bf16 instead of rounding: hence bf16's looser tolerances. Weights of experts no
token picks, and the intermediate buffer's padding, may be NaN without showing in the output.
Runs under the Triton interpreter on CPU, compiled on a GPU (there also under CUDA-graph capture).
"""

from __future__ import annotations

import importlib

import pytest

pytest.importorskip("triton")
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import kernel_refs  # noqa: E402
import kernels  # noqa: E402
from kernel_device import kernel_device  # noqa: E402
from nvray.quantization.fp8_math import dequantize, quantize_per_block  # noqa: E402

INTERPRET, DEVICE = kernel_device()
fused_moe_module = importlib.import_module("kernels.fused_moe")

# (vs. the reference: same roundings; vs. the naive float64 loop: one more rounding of the
# activation and the inputs' own precision)
TOL_REF = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
           torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
TOL_NAIVE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=5e-3, rtol=5e-3),
             torch.bfloat16: dict(atol=4e-2, rtol=4e-2)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _routing(t: int, e: int, k: int, g: torch.Generator, experts: list[int] | None = None):
    """Each token picks k distinct experts (from ``experts`` if given) with softmax weights."""
    pool = torch.tensor(experts if experts is not None else list(range(e)))
    choice = torch.rand(t, len(pool), generator=g).argsort(dim=1)[:, :k]
    ids = pool[choice]
    weights = torch.softmax(torch.randn(t, k, generator=g), dim=1)
    return weights.to(DEVICE), ids.to(DEVICE)


def _weights(e: int, h: int, inter: int, dtype: torch.dtype, g: torch.Generator):
    w13 = torch.randn(e, 2 * inter, h, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, inter, generator=g) / inter ** 0.5
    return w13.to(dtype=dtype, device=DEVICE), w2.to(dtype=dtype, device=DEVICE)


def _x(t: int, h: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return (torch.randn(t, h, generator=g) * 2).to(dtype=dtype, device=DEVICE)


def _naive(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """One (token, slot) pair at a time, float64, nothing rounded in between (float64 [T, H])."""
    inter = w13.shape[1] // 2
    x, w13, w2 = x.double().cpu(), w13.double().cpu(), w2.double().cpu()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            gate = w13[e, :inter] @ x[t]
            up = w13[e, inter:] @ x[t]
            out[t] += float(topk_weights[t, k]) * (w2[e] @ (gate * torch.sigmoid(gate) * up))
    return out


def _check(x, w13, w2, topk_weights, topk_ids, naive_w13=None, naive_w2=None, **fp8):
    """The kernel against the reference, and both against the naive loop."""
    dtype = x.dtype
    out = kernels.fused_moe(x, w13, w2, topk_weights, topk_ids, **fp8)
    ref = kernel_refs.fused_moe_ref(x, w13, w2, topk_weights, topk_ids, **fp8)
    assert out.shape == x.shape and out.dtype == dtype and out.device == x.device
    assert ref.shape == x.shape and ref.dtype == dtype
    assert torch.isfinite(out).all()
    naive = _naive(x, w13 if naive_w13 is None else naive_w13, w2 if naive_w2 is None else naive_w2,
                   topk_weights, topk_ids).to(dtype)
    torch.testing.assert_close(out.cpu(), ref.cpu(), **TOL_REF[dtype])
    torch.testing.assert_close(ref.cpu(), naive, **TOL_NAIVE[dtype])
    torch.testing.assert_close(out.cpu(), naive, **TOL_NAIVE[dtype])
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (4, 4)])
@pytest.mark.parametrize("num_tokens", [1, 5, 37])
def test_matches_reference_and_naive(dtype, num_experts, top_k, num_tokens):
    """H and I off the 64-wide tile grid (tails along K and N); E=4, K=4: every expert."""
    g = torch.Generator().manual_seed(100 * num_tokens + 10 * num_experts + top_k)
    h, inter = 96, 40
    x = _x(num_tokens, h, dtype, g)
    w13, w2 = _weights(num_experts, h, inter, dtype, g)
    topk_weights, topk_ids = _routing(num_tokens, num_experts, top_k, g)
    _check(x, w13, w2, topk_weights, topk_ids)


@pytest.mark.parametrize("num_tokens,block_m", [(8, 32), (64, 32), (80, 64), (160, 128)])
def test_taller_blocks(num_tokens, block_m):
    """8 to 160 pairs per expert (E=4, K=4): BLOCK_M 32, 64 and 128; in the first case the
    (token, slot) pairs sorted by the torch reference instead of the kernels."""
    g = torch.Generator().manual_seed(num_tokens)
    x = _x(num_tokens, 80, torch.float32, g)
    w13, w2 = _weights(4, 80, 24, torch.float32, g)
    topk_weights, topk_ids = _routing(num_tokens, 4, 4, g)
    assert fused_moe_module._config(num_tokens * 4, 4, x.dtype)[0] == block_m  # noqa: SLF001
    with pytest.MonkeyPatch.context() as mp:
        if num_tokens == 8:
            mp.setattr(fused_moe_module, "_ALIGN_MAX_EXPERTS", 0)
        _check(x, w13, w2, topk_weights, topk_ids.to(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_no_token_picks_are_never_read(dtype):
    """Experts 3 and 7 get no token: their weights are NaN, the output stays finite."""
    g = torch.Generator().manual_seed(7)
    x = _x(37, 64, dtype, g)
    w13, w2 = _weights(8, 64, 32, dtype, g)
    topk_weights, topk_ids = _routing(37, 8, 2, g, experts=[0, 1, 2, 4, 5, 6])
    for e in (3, 7):
        w13[e] = float("nan")
        w2[e] = float("nan")
    _check(x, w13, w2, topk_weights, topk_ids)


@pytest.mark.parametrize("top_k", [1, 2])
def test_every_token_picks_expert_0(top_k):
    """One expert gets every pair (several blocks of it; with K=2 each token picks it twice), the
    others none (NaN weights)."""
    g = torch.Generator().manual_seed(top_k)
    num_tokens, e = 37, 4
    x = _x(num_tokens, 64, torch.float32, g)
    w13, w2 = _weights(e, 64, 32, torch.float32, g)
    w13[1:] = float("nan")
    w2[1:] = float("nan")
    topk_weights = torch.softmax(torch.randn(num_tokens, top_k, generator=g), 1).to(DEVICE)
    topk_ids = torch.zeros(num_tokens, top_k, dtype=torch.int64, device=DEVICE)
    _check(x, w13, w2, topk_weights, topk_ids)


def test_out_of_range_indices_from_an_earlier_kernel_are_dropped(monkeypatch):
    """The GEMMs read pairs and expert ids another kernel wrote; when that kernel did not run
    (start-up's compile-ahead rehearsal skips launches of kernels not yet compiled) they are
    whatever memory held: out-of-range ones are dropped, never dereferenced."""
    g = torch.Generator().manual_seed(3)
    x = _x(5, 64, torch.float32, g)
    w13, w2 = _weights(4, 64, 32, torch.float32, g)
    topk_weights, topk_ids = _routing(5, 4, 2, g)
    block_m = fused_moe_module._config(10, 4, torch.float32)[0]
    sorted_ids = torch.tensor([-7, 2**30, 3, -1] * block_m, dtype=torch.int32, device=DEVICE)
    garbage = (sorted_ids[:4 * block_m],
               torch.tensor([2**30, -3, 1, 9], dtype=torch.int32, device=DEVICE),
               torch.tensor([2**31 - 1], dtype=torch.int32, device=DEVICE))
    monkeypatch.setattr(fused_moe_module, "moe_align", lambda *args: garbage)
    out = kernels.fused_moe(x, w13, w2, topk_weights, topk_ids)
    assert out.shape == (5, 64)


def test_pairs_of_other_ranks_experts_add_nothing():
    """Expert parallelism: ids outside [0, E) are other ranks' experts; with ``skips_pairs``
    those pairs add nothing, the rest is the layer's sum."""
    g = torch.Generator().manual_seed(11)
    x = _x(9, 64, torch.float32, g)
    w13, w2 = _weights(4, 64, 32, torch.float32, g)
    topk_weights, topk_ids = _routing(9, 4, 2, g)
    ids = topk_ids.clone()
    ids[::2, 0] = -1
    ids[1::3, 1] = 7
    got = kernels.fused_moe(x, w13, w2, topk_weights, ids, skips_pairs=True)
    keep = (ids >= 0) & (ids < 4)
    want = kernel_refs.fused_moe_ref(x, w13, w2, topk_weights * keep, torch.where(keep, ids, 0))
    torch.testing.assert_close(got, want, **TOL_REF[torch.float32])


def test_no_tokens():
    g = torch.Generator().manual_seed(0)
    w13, w2 = _weights(4, 64, 32, torch.bfloat16, g)
    x = torch.empty(0, 64, dtype=torch.bfloat16, device=DEVICE)
    topk_weights = torch.empty(0, 2, device=DEVICE)
    topk_ids = torch.empty(0, 2, dtype=torch.int32, device=DEVICE)
    for fn in (kernels.fused_moe, kernel_refs.fused_moe_ref):
        out = fn(x, w13, w2, topk_weights, topk_ids)
        assert out.shape == (0, 64) and out.dtype == torch.bfloat16
    sorted_ids, expert_ids, total = kernels.moe_align(topk_ids, 4, 16)
    assert sorted_ids.numel() == expert_ids.numel() == 0 and total.tolist() == [0]


@pytest.mark.parametrize("impl", ["moe_align", "moe_align_ref"])
@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m", [
    (1, 8, 2, 16), (5, 4, 4, 16), (37, 8, 2, 16), (37, 8, 2, 1), (100, 16, 3, 32), (9, 64, 8, 16),
    (70, 256, 8, 16), (300, 256, 8, 16)])
def test_align_sorts_pairs_into_single_expert_blocks(impl, num_tokens, num_experts, top_k,
                                                     block_m):
    """The kernels (chunks of 256 pairs, 32 at 256 experts; the last case scans 75 chunks, more
    than one pass of 64) and the torch reference give the contract's layout, the same one."""
    g = torch.Generator().manual_seed(num_tokens + block_m)
    experts = [e for e in range(num_experts) if e % 3 != 1]  # some experts get nothing
    _, topk_ids = _routing(num_tokens, num_experts, min(top_k, len(experts)), g, experts=experts)
    top_k = topk_ids.shape[1]
    sorted_ids, expert_ids, total = getattr(kernels, impl)(topk_ids.to(torch.int32), num_experts,
                                                          block_m)
    other = (kernels.moe_align_ref if impl == "moe_align" else kernels.moe_align)(
        topk_ids, num_experts, block_m)
    for got, want in zip((sorted_ids, expert_ids, total), other):
        assert torch.equal(got, want)
    n = num_tokens * top_k
    num_blocks = -(-(n + min(n, num_experts) * (block_m - 1)) // block_m)
    assert sorted_ids.dtype == expert_ids.dtype == total.dtype == torch.int32
    assert sorted_ids.shape == (num_blocks * block_m,) and expert_ids.shape == (num_blocks,)
    flat = topk_ids.reshape(-1).cpu()
    counts = torch.bincount(flat, minlength=num_experts)
    want_total = int(((counts + block_m - 1) // block_m * block_m).sum())
    assert total.tolist() == [want_total]
    sorted_ids, expert_ids = sorted_ids.cpu().long(), expert_ids.cpu().long()
    valid = sorted_ids[sorted_ids < n]
    assert torch.equal(valid.sort().values, torch.arange(n)), "every pair exactly once"
    assert (sorted_ids[want_total:] == n).all() and (sorted_ids <= n).all()
    used = want_total // block_m
    assert (expert_ids[used:] == -1).all()
    blocks = sorted_ids[:want_total].view(used, block_m)
    last, last_full = -1, True
    for b in range(used):
        e = int(expert_ids[b])
        rows = blocks[b][blocks[b] < n]
        assert rows.numel() > 0, "no block is all padding"
        assert (flat[rows] == e).all(), "a block holds one expert's pairs"
        assert e >= last and (rows.diff() > 0).all(), "ascending experts, ascending pairs"
        assert e != last or last_full, "padding only at the end of an expert's run"
        last, last_full = e, bool((blocks[b] < n).all())


class _HostSyncs(TorchDispatchMode):
    """The torch ops a call runs that read device values on the host or size outputs by them."""

    SYNCING = {"_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique2",
               "unique_consecutive", "bincount", "repeat_interleave", "equal", "is_nonzero"}

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name.split("::")[-1] in self.SYNCING:
            self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


def test_no_host_sync_outside_the_kernels():
    """moe_align_ref and the glue around the kernels run no op that syncs (checked on the host
    side of the dispatcher; on a GPU, CUDA-graph capture checks the whole call)."""
    g = torch.Generator().manual_seed(3)
    x = _x(5, 64, torch.float32, g)
    w13, w2 = _weights(4, 64, 32, torch.float32, g)
    topk_weights, topk_ids = _routing(5, 4, 2, g)
    with _HostSyncs() as mode:
        kernels.moe_align_ref(topk_ids, 4, 16)
    assert mode.calls == []
    if not INTERPRET:  # the interpreter itself copies tensors to the host
        with _HostSyncs() as mode:
            kernels.fused_moe(x, w13, w2, topk_weights, topk_ids)
        assert mode.calls == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_shape,h,inter,num_tokens", [
    ((128, 128), 160, 72, 11), ((32, 32), 96, 40, 11), ((128, 128), 160, 72, 40)])
def test_fp8_block_scaled_weights(dtype, block_shape, h, inter, num_tokens):
    """e4m3 weights with per-block scales (partial blocks at the edges; gate/up rows sharing a
    scale block when I is not a multiple of bn; K tiles of 128 and 32; BLOCK_M 16 and 64)
    against the reference on the dequantized weights, and the naive loop on them."""
    g = torch.Generator().manual_seed(h + inter + num_tokens)
    e, top_k = 4, 2
    x = _x(num_tokens, h, dtype, g)
    w13, w2 = _weights(e, h, inter, torch.float32, g)
    q13, s13 = zip(*(quantize_per_block(w.cpu(), block_shape) for w in w13))
    q2, s2 = zip(*(quantize_per_block(w.cpu(), block_shape) for w in w2))
    q13, s13, q2, s2 = (torch.stack(v).to(DEVICE) for v in (q13, s13, q2, s2))
    deq13 = torch.stack([dequantize(q, s, block_shape) for q, s in zip(q13, s13)])
    deq2 = torch.stack([dequantize(q, s, block_shape) for q, s in zip(q2, s2)])
    topk_weights, topk_ids = _routing(num_tokens, e, top_k, g)
    out = _check(x, q13, q2, topk_weights, topk_ids, naive_w13=deq13, naive_w2=deq2,
                 w13_scale=s13, w2_scale=s2, block_shape=block_shape)
    if dtype == torch.float32:  # the same as the unquantized kernel on the dequantized weights
        plain = kernels.fused_moe(x, deq13, deq2, topk_weights, topk_ids)
        torch.testing.assert_close(out, plain, **TOL_REF[dtype])


def test_validation_names_the_argument():
    g = torch.Generator().manual_seed(4)
    x = _x(3, 64, torch.float32, g)
    w13, w2 = _weights(4, 64, 32, torch.float32, g)
    tw, ti = _routing(3, 4, 2, g)
    bad = [
        ("x", (x[0], w13, w2, tw, ti)),
        ("x", (x.to(torch.int32), w13, w2, tw, ti)),
        ("x", (x.t(), w13, w2, tw, ti)),
        ("w13", (x, w13[0], w2, tw, ti)),
        ("w13", (x, w13[:, :, :32], w2, tw, ti)),
        ("w13", (x, w13[:, :63], w2, tw, ti)),
        ("w13", (x, w13.half(), w2, tw, ti)),
        ("w2", (x, w13, w2[:3], tw, ti)),
        ("w2", (x, w13, w2.transpose(1, 2), tw, ti)),
        ("topk_weights", (x, w13, w2, tw[:2], ti)),
        ("topk_weights", (x, w13, w2, tw.double(), ti)),
        ("topk_ids", (x, w13, w2, tw, ti[:, :1])),  # K mismatch
        ("topk_ids", (x, w13, w2, tw, ti.float())),
        ("topk_ids", (x, w13, w2, tw, ti.to(torch.int16))),
        ("topk_ids", (x, w13, w2, tw, ti[:, 0])),
    ]
    for name, args in bad:
        for fn in (kernels.fused_moe, kernel_refs.fused_moe_ref):
            with pytest.raises(ValueError, match=name):
                fn(*args)
    q13 = w13.to(torch.float8_e4m3fn)
    q2 = w2.to(torch.float8_e4m3fn)
    s13 = torch.ones(4, 1, 1, device=DEVICE)
    s2 = torch.ones(4, 1, 1, device=DEVICE)
    bad_fp8 = [
        ("w2_scale", dict(w13_scale=s13, block_shape=(128, 128))),
        ("block_shape", dict(w13_scale=s13, w2_scale=s2)),
        ("block_shape", dict(w13_scale=s13, w2_scale=s2, block_shape=(128, 96))),
        ("w13_scale", dict(w13_scale=s13[:, :, :0], w2_scale=s2, block_shape=(128, 128))),
        ("w2_scale", dict(w13_scale=s13, w2_scale=s2.double(), block_shape=(128, 128))),
    ]
    for name, fp8 in bad_fp8:
        with pytest.raises(ValueError, match=name):
            kernels.fused_moe(x, q13, q2, tw, ti, **fp8)
    with pytest.raises(ValueError, match="w13"):  # FP8 weights without their scales
        kernels.fused_moe(x, q13, q2, tw, ti)
    for name, args in (("topk_ids", (ti[0], 4, 16)), ("num_experts", (ti, 0, 16)),
                       ("block_m", (ti, 4, 0))):
        with pytest.raises(ValueError, match=name):
            kernels.moe_align(*args)


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs and Qwen3-MoE-sized batches need a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [16, 4096])
def test_cuda_graph_capture_and_large_batches(dtype, num_tokens):
    """Captured in a CUDA graph (no host sync), replayed with other routing (half the tokens on
    experts 0..7), at Qwen3-30B-A3B's E=128, K=8 (smaller H and I); then decode-sized
    batches."""
    g = torch.Generator().manual_seed(5)
    e, top_k, h, inter, t = 128, 8, 256, 128, num_tokens
    w13, w2 = _weights(e, h, inter, dtype, g)
    x = _x(t, h, dtype, g)
    topk_weights, topk_ids = _routing(t, e, top_k, g)
    out = kernels.fused_moe(x, w13, w2, topk_weights, topk_ids)  # compile outside the capture
    torch.testing.assert_close(out, kernel_refs.fused_moe_ref(x, w13, w2, topk_weights, topk_ids),
                               **TOL_REF[dtype])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            captured = kernels.fused_moe(x, w13, w2, topk_weights, topk_ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    new_weights, new_ids = _routing(t, e, top_k, g)
    new_ids[: t // 2] = torch.arange(top_k, device=DEVICE)
    x.copy_(_x(t, h, dtype, g))
    topk_weights.copy_(new_weights)
    topk_ids.copy_(new_ids)
    graph.replay()
    torch.testing.assert_close(captured, kernel_refs.fused_moe_ref(x, w13, w2, topk_weights, topk_ids),
                               **TOL_REF[dtype])
    if num_tokens == 16:
        for small in (1, 3, 16):
            _check(x[:small], w13, w2, topk_weights[:small], topk_ids[:small])
