"""The sort-free filter kernel: each row keeps exactly the tokens that sorting the row and
filtering it keeps (top-k, top-p, min-p and their mixes), ties at a cut kept whole. Runs under
the Triton interpreter on CPU, compiled on a GPU (there also at Qwen3's vocabulary)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
import torch  # noqa: E402

import kernel_refs  # noqa: E402
import kernels  # noqa: E402
from kernel_device import kernel_device  # noqa: E402

INTERPRET, DEVICE = kernel_device()
VOCAB = 2500  # three of the kernel's 1,024-column loop steps, the last one partial

# (top_k, top_p, min_p) per row: every filter alone, each pair, all three, none
FILTERS = [(0, 0.9, 0.0), (0, 0.5, 0.0), (0, 0.999, 0.0), (50, 1.0, 0.0), (1, 1.0, 0.0),
           (0, 1.0, 0.05), (0, 1.0, 1.0), (700, 0.8, 0.0), (30, 0.95, 0.01),
           (2000, 0.6, 0.002), (0, 1.0, 0.0), (VOCAB, 0.7, 0.0), (VOCAB + 5, 1.0, 0.0)]


def _params(filters=FILTERS):
    top_k = torch.tensor([f[0] for f in filters], dtype=torch.int32, device=DEVICE)
    top_p = torch.tensor([f[1] for f in filters], dtype=torch.float32, device=DEVICE)
    min_p = torch.tensor([f[2] for f in filters], dtype=torch.float32, device=DEVICE)
    return top_k, top_p, min_p


def _kept(logits: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    return logits >= thresholds.unsqueeze(1)


def _sorted_filter_keeps(logits: torch.Tensor, filters) -> torch.Tensor:
    """What the sampler's sort path keeps, row by row in plain Python order (the oracle)."""
    keep = torch.zeros_like(logits, dtype=torch.bool)
    for row, (top_k, top_p, min_p) in enumerate(filters):
        order = logits[row].double().argsort(descending=True, stable=True)
        k = top_k if 0 < top_k < logits.shape[1] else logits.shape[1]
        probs = logits[row, order[:k]].double().softmax(dim=0)
        mass = 0.0
        for rank in range(k):
            if rank and (mass >= top_p or probs[rank] < min_p * probs[0]):
                break
            keep[row, order[rank]] = True
            mass += float(probs[rank])
    return keep


def test_kept_tokens_match_sorting_and_filtering_each_row():
    logits = torch.randn(len(FILTERS), VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    logits = logits.to(DEVICE)
    thresholds = kernels.filter_thresholds(logits, *_params())
    expected = _sorted_filter_keeps(logits.cpu(), FILTERS)
    kept = _kept(logits, thresholds).cpu()
    for row, filters in enumerate(FILTERS):
        assert torch.equal(kept[row], expected[row]), (
            f"row {row} {filters}: kept {int(kept[row].sum())} tokens, the sort keeps "
            f"{int(expected[row].sum())}")
    assert torch.equal(kept, _kept(logits, kernel_refs.filter_thresholds_ref(logits, *_params())).cpu())


def test_ties_at_a_cut_are_kept_whole():
    # 40 distinct values, each on many tokens: every cut falls inside a run of equal logits
    logits = (torch.arange(VOCAB) % 40).float().div(4).repeat(len(FILTERS), 1).to(DEVICE)
    thresholds = kernels.filter_thresholds(logits, *_params())
    reference = kernel_refs.filter_thresholds_ref(logits, *_params())
    # the sort keeps part of the run at its smallest kept value; the kernel keeps all of it
    kept = _kept(logits, thresholds)
    assert torch.equal(kept, _kept(logits, reference))
    is_best = logits == logits.max(dim=1, keepdim=True).values
    assert bool((kept | ~is_best).all())  # the best always stays


def test_banned_tokens_and_one_token_rows():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    logits[:, ::2] = float("-inf")  # half the vocabulary banned
    logits[2, :] = float("-inf")
    logits[2, 1234] = 5.0  # only one token left
    filters = [(0, 0.9, 0.0), (3000, 0.5, 0.1), (0, 0.3, 0.5)]
    thresholds = kernels.filter_thresholds(logits, *_params(filters))
    kept = _kept(logits, thresholds).cpu()
    assert torch.equal(kept, _sorted_filter_keeps(logits.cpu(), filters) & logits.cpu().isfinite())
    assert kept[2].nonzero().flatten().tolist() == [1234]


def test_a_row_without_filters_keeps_everything():
    logits = torch.randn(2, 300, device=DEVICE)
    thresholds = kernels.filter_thresholds(logits, *_params([(0, 1.0, 0.0), (300, 1.0, 0.0)]))
    assert bool(_kept(logits, thresholds).all())


@pytest.mark.skipif(INTERPRET, reason="Qwen3's vocabulary at batch size: compiled only")
def test_qwen3_vocabulary_in_bfloat16_matches_the_reference():
    rows, vocab = 256, 151936
    logits = torch.randn(rows, vocab, device=DEVICE).mul(4).bfloat16().float() / 0.6
    params = _params([FILTERS[i % len(FILTERS)] for i in range(rows)])
    kept = _kept(logits, kernels.filter_thresholds(logits, *params))
    expected = _kept(logits, kernel_refs.filter_thresholds_ref(logits, *params))
    # bf16 logits tie often; a mass summed in another order may move a top-p cut by one value
    differ = (kept != expected).any(dim=1)
    assert int(differ.sum()) <= rows // 32, f"{int(differ.sum())} of {rows} rows differ"


@pytest.mark.parametrize("bad", [
    {"logits": torch.zeros(2, 8, dtype=torch.float16)},
    {"logits": torch.zeros(8)},
    {"top_k": torch.zeros(2, dtype=torch.int64)},
    {"top_p": torch.ones(3)},
    {"min_p": torch.zeros(2, dtype=torch.float64)},
])
def test_bad_arguments_are_rejected_naming_them(bad):
    args = {"logits": torch.zeros(2, 8), "top_k": torch.zeros(2, dtype=torch.int32),
            "top_p": torch.ones(2), "min_p": torch.zeros(2)}
    args = {name: value.to(DEVICE) for name, value in {**args, **bad}.items()}
    with pytest.raises(ValueError, match=next(iter(bad))):
        kernels.filter_thresholds(**args)


@pytest.mark.parametrize("filters", [dict(top_p=0.9), dict(top_p=0.5, min_p=0.01),
                                     dict(min_p=0.1), dict(top_k=1500, top_p=0.95),
                                     dict(top_p=0.8, banned_token_ids=(0, 1, 2))])
def test_the_sampler_draws_what_the_sorted_vocabulary_draws(filters):
    """Seeded rows of the sampler: thresholds from the kernel (``fused=True``) against the whole
    sorted vocabulary (float logits without ties), greedy and unfiltered rows among them."""
    from nvray.step_protocol import SampleSpec
    from nvray.worker.sampler import sample

    base = dict(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, step_index=0)
    specs = [SampleSpec(**{**base, **filters, "seed": 100 + i, "step_index": i,
                           "temperature": 0.5 + 0.2 * i}) for i in range(12)]
    specs[4] = specs[4]._replace(temperature=0.0)
    specs[7] = SampleSpec(**{**base, "seed": 7})  # no filter in a filtered batch
    logits = (torch.randn(12, VOCAB, generator=torch.Generator().manual_seed(2)) * 3).to(DEVICE)
    sorted_path = sample(logits, specs).tolist()
    assert sample(logits, specs, fused=True).tolist() == sorted_path
    assert len(set(sorted_path)) > 6  # the rows drew different tokens


def test_unseeded_filtered_batches_race_in_the_kernel_over_the_kept_tokens():
    """No seeds: the fused sampler races in the kernel. Top-p 0.9 over six tokens keeps the
    three best; their draws follow the softmax renormalized over them."""
    from nvray.step_protocol import SampleSpec
    from nvray.worker.sampler import sample

    row = torch.tensor([2.0, 1.5, 1.0, -1.0, -2.0, -3.0])
    probs = row.softmax(-1)
    assert float(probs[:2].sum()) < 0.9 <= float(probs[:3].sum())
    spec = SampleSpec(temperature=1.0, top_p=0.9, top_k=-1, min_p=0.0, seed=None, step_index=0)
    ids = sample(row.repeat(300, 1).to(DEVICE), [spec] * 300, fused=True).cpu()
    counts = torch.bincount(ids, minlength=6).float()
    assert counts[3:].sum() == 0
    expected = 300 * probs[:3] / probs[:3].sum()
    sigma = (expected * (1 - expected / 300)).sqrt()
    assert bool(((counts[:3] - expected).abs() <= 5 * sigma).all()), (counts, expected)
