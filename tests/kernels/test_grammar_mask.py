"""The grammar-mask kernel: each listed logits row becomes -inf exactly where its mask (picked
by ``sources``) forbids a token and keeps every other value; unlisted rows are untouched.
Packed words with bit 31 set (negative int32) and a vocabulary that ends inside a word and
inside a block are covered. Runs under the Triton interpreter on CPU, compiled on a GPU."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
import torch  # noqa: E402

import kernel_refs  # noqa: E402
import kernels  # noqa: E402
from kernel_device import kernel_device  # noqa: E402

INTERPRET, DEVICE = kernel_device()
VOCAB = 4096 + 1000 + 7  # two of the kernel's 4,096-token blocks, the last partial


def _allowed(seed: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.rand(n, VOCAB, generator=gen) < 0.3
    allowed[0, :] = False  # a row allowing nothing
    allowed[0, 31::32] = True  # ... but the tokens of bit 31
    return allowed


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    words = -(-VOCAB // 32)
    bits = torch.zeros(allowed.shape[0], words * 32, dtype=torch.int64)
    bits[:, :VOCAB] = allowed.long()
    packed = (bits.view(allowed.shape[0], words, 32) << torch.arange(32)).sum(-1)
    return ((packed + 2**31) % 2**32 - 2**31).to(torch.int32)  # the words as int32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("launch", ["kernel", "ref"])
def test_listed_rows_lose_exactly_their_forbidden_tokens(dtype, launch):
    allowed = _allowed(0, 3)
    masks = _pack(allowed).to(DEVICE)
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(1)).to(dtype)
    rows, sources = [3, 0, 4], [2, 0, 1]  # row 3 takes mask 2, ...; rows 1 and 2 unlisted
    got = logits.to(DEVICE)
    run = kernels.mask_logits if launch == "kernel" else kernel_refs.mask_logits_ref
    run(got, masks, torch.tensor(rows, device=DEVICE), torch.tensor(sources, device=DEVICE))
    got = got.cpu()
    for row in range(5):
        if row not in rows:
            assert torch.equal(got[row], logits[row])
            continue
        keep = allowed[sources[rows.index(row)]]
        assert torch.equal(got[row][keep], logits[row][keep])
        assert torch.isneginf(got[row][~keep]).all()


def test_no_rows_is_a_no_op():
    logits = torch.randn(2, VOCAB).to(DEVICE)
    before = logits.clone()
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    kernels.mask_logits(logits, _pack(_allowed(2, 1)).to(DEVICE), empty, empty)
    assert torch.equal(logits, before)
