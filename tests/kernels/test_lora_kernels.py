"""The batched LoRA kernels (shrink, expand) against a token-by-token torch computation.

Tokens of a step use different adapter slots or none (the base), in any order; the kernels get
them grouped by slot through ``LoRABatch`` (the rank's own builder), over buffers longer than
what they hold (a CUDA graph's static buffers), and must give every adapter token its own
slot's delta and leave base tokens alone; a smaller step after a larger one leaves none of the
larger one's tiles behind. Also the torch path the CPU runs (``ops.py``), and a
verification graph's layout (tokens at padded rows). Runs under Triton's interpreter on the
CPU, compiled on a GPU.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
import torch  # noqa: E402

from kernel_device import kernel_device  # noqa: E402
from kernel_refs import lora_expand_ref, lora_shrink_ref  # noqa: E402
from kernels.lora import lora_expand, lora_shrink  # noqa: E402
from nvray.lora.batch import LoRABatch  # noqa: E402
from nvray.lora.ops import expand_torch, shrink_torch  # noqa: E402

INTERPRET, DEVICE = kernel_device()
SLOTS, RANK = 3, 8


def _case(num_tokens: int, k: int, widths: list[int], seed: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(num_tokens, k + 5, generator=g)).to(dtype)[:, :k]  # strided rows
    a = (torch.randn(SLOTS, len(widths) * RANK, k, generator=g) * 0.3).to(dtype)
    b = (torch.randn(SLOTS, sum(widths), RANK, generator=g) * 0.3).to(dtype)
    slots = torch.randint(-1, SLOTS, (num_tokens,), generator=g).tolist()
    return x.to(DEVICE), a.to(DEVICE), b.to(DEVICE), slots


def _per_token(x, a, b, y, slots, widths, rows=None):
    """Each token's delta through its slot's matrices, one token at a time."""
    want = y.float().clone()
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        row = t if rows is None else rows[t]
        h = x[row].float() @ a[slot].float().T
        col = 0
        for j, width in enumerate(widths):
            want[row, col:col + width] += h[j * RANK:(j + 1) * RANK] @ b[slot, col:col + width].float().T
            col += width
    return want


def _run(fns, x, a, b, y, batch, widths, splits=1, **expand_options):
    shrink, expand = fns
    h = torch.full((splits, x.shape[0], a.shape[1]), float("nan"), device=x.device)
    tiles = batch.tiles_for(x.shape[0])
    shrink(x, a, h, batch.rows, tiles)
    slices = [(j * RANK, sum(widths[:j]), width) for j, width in enumerate(widths)]
    expand(h, b, y, batch.rows, tiles, slices, **expand_options)  # a fused projection: one call


PATHS = {"triton": (lora_shrink, lora_expand), "ref": (lora_shrink_ref, lora_expand_ref),
         "torch": (shrink_torch, expand_torch)}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("num_tokens,k,widths,splits", [
    (37, 64, [48, 16, 16], 1), (5, 40, [24], 1), (70, 96, [80, 80], 1),
    (37, 300, [48, 16, 16], 3), (5, 520, [24], 2),  # K split into partial sums
    (21, 32, [16, 24, 8, 40], 1)])  # more slices than one expand launch takes
def test_every_token_gets_its_own_slots_delta_and_base_tokens_none(path, num_tokens, k, widths,
                                                                   splits):
    dtype = torch.float32
    x, a, b, slots = _case(num_tokens, k, widths, seed=num_tokens, dtype=dtype)
    y = torch.randn(num_tokens, sum(widths), dtype=dtype, device=DEVICE)
    want = _per_token(x, a, b, y, slots, widths)
    batch = LoRABatch(SLOTS, 128, DEVICE)  # buffers longer than the step
    batch.prepare(slots)
    assert batch.has_tokens
    _run(PATHS[path], x, a, b, y, batch, widths, splits)
    torch.testing.assert_close(y.float(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("chunks", [2, 4])
def test_an_expand_program_adding_several_column_blocks_stays_in_its_slice(chunks):
    """Wide steps give each expand program several 128-column blocks of one slice: slices
    whose widths are not multiples of that span must neither spill into the next slice nor
    lose their last columns."""
    widths = [300, 136, 72]
    x, a, b, slots = _case(40, 64, widths, seed=11, dtype=torch.float32)
    y = torch.randn(40, sum(widths), device=DEVICE)
    want = _per_token(x, a, b, y, slots, widths)
    batch = LoRABatch(SLOTS, 64, DEVICE)
    batch.prepare(slots)
    _run(PATHS["triton"], x, a, b, y, batch, widths, splits=2, chunks=chunks)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)


def test_wide_steps_give_expand_programs_more_columns():
    from kernels.lora import expand_chunks

    assert expand_chunks(24, [4096, 1024, 1024]) == 1  # an 8B decode step's q/k/v
    assert expand_chunks(24, [12288, 12288]) > 1 and expand_chunks(1100, [1024]) > 1


def test_a_decode_step_splits_the_input_features_and_a_prefill_does_not():
    from kernels.lora import shrink_splits

    assert shrink_splits(256, 4096) > 1 and shrink_splits(1, 12288) > 1
    assert shrink_splits(16384, 4096) == 1


@pytest.mark.parametrize("path", PATHS)
def test_half_precision_rounds_once(path):
    widths = [32, 32]
    x, a, b, slots = _case(24, 64, widths, seed=3, dtype=torch.float16)
    y = torch.randn(24, 64, dtype=torch.float16, device=DEVICE)
    want = _per_token(x, a, b, y, slots, widths)
    batch = LoRABatch(SLOTS, 64, DEVICE)
    batch.prepare(slots)
    _run(PATHS[path], x, a, b, y, batch, widths)
    torch.testing.assert_close(y.float(), want, rtol=5e-3, atol=5e-3)


def test_a_verification_layout_puts_each_token_at_its_padded_row():
    """Tokens of 3 sequences at rows i * 4 + j (4 rows a sequence, the rest padding)."""
    widths = [16]
    q_lens, seq_slots = [2, 4, 1], [1, -1, 0]
    slots = [s for n, s in zip(q_lens, seq_slots) for _ in range(n)]
    rows = [i * 4 + j for i, n in enumerate(q_lens) for j in range(n)]
    x, a, b, _ = _case(12, 32, widths, seed=5, dtype=torch.float32)
    y = torch.randn(12, 16, device=DEVICE)
    want = _per_token(x, a, b, y, slots, widths, rows)
    batch = LoRABatch(SLOTS, 64, DEVICE)
    batch.prepare(slots, rows)
    _run(PATHS["triton"], x, a, b, y, batch, widths)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)


def test_a_step_without_adapter_tokens_clears_the_tiles_a_graph_reads():
    widths = [16]
    x, a, b, slots = _case(8, 32, widths, seed=7, dtype=torch.float32)
    batch = LoRABatch(SLOTS, 64, DEVICE)
    batch.prepare([0] * 8)
    batch.prepare([-1] * 8)  # the next step: base tokens only
    assert not batch.has_tokens and (batch.tiles[0] == -1).all()
    y = torch.randn(8, 16, device=DEVICE)
    before = y.clone()
    _run(PATHS["triton"], x, a, b, y, batch, widths)  # what a replayed graph would launch
    assert torch.equal(y, before)


def test_a_smaller_step_after_a_larger_one_runs_only_its_own_tiles():
    widths = [16]
    batch = LoRABatch(SLOTS, 128, DEVICE)
    big = [s % SLOTS for s in range(100)]
    batch.prepare(big)
    x, a, b, _ = _case(20, 32, widths, seed=9, dtype=torch.float32)
    slots = [2] * 5 + [-1] * 10 + [0] * 5
    batch.prepare(slots)
    y = torch.randn(20, 16, device=DEVICE)
    want = _per_token(x, a, b, y, slots, widths)
    _run(PATHS["triton"], x, a, b, y, batch, widths)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
