"""The sampling kernel: greedy rows are ``torch.argmax`` (first index on ties), sampled rows
follow ``softmax(logits / T)`` (counts within 5 standard deviations of the expected ones, over
rows that share one set of logits), one seed gives one answer. Runs under the Triton interpreter
on CPU, compiled on a GPU."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
import torch  # noqa: E402

import kernel_refs  # noqa: E402
import kernels  # noqa: E402
from kernel_device import kernel_device  # noqa: E402

INTERPRET, DEVICE = kernel_device()
SAMPLERS = [kernels.race_sample, kernel_refs.race_sample_ref]
NARROW = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
# three blocks of the kernel's loop: the likely tokens sit in different blocks
WIDE_VOCAB = 2500
LIKELY = {10: 1.0, 1100: 0.5, 2400: 0.0, 1500: -0.7}


def _wide_logits(rows: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    row = torch.full((WIDE_VOCAB,), -30.0)
    for col, value in LIKELY.items():
        row[col] = value
    return row.repeat(rows, 1).to(dtype=dtype, device=DEVICE)


def _narrow_logits(rows: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return NARROW.repeat(rows, 1).to(dtype=dtype, device=DEVICE)


def _assert_follows(ids: torch.Tensor, logits_row: torch.Tensor, temperature: float) -> None:
    """Each token's count within 5 standard deviations of rows * softmax(row / T)."""
    n = ids.numel()
    probs = (logits_row.float().cpu() / temperature).softmax(-1)
    counts = torch.bincount(ids.long().cpu(), minlength=probs.numel()).float()
    sigma = (n * probs * (1 - probs)).sqrt()
    off = ((counts - n * probs).abs() > 5 * sigma + 1).nonzero().flatten().tolist()
    assert not off, (f"tokens {off}: counts {counts[off].tolist()}, expected "
                     f"{(n * probs[off]).tolist()}")


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_draws_follow_the_tempered_softmax(sampler, temperature):
    logits = _narrow_logits(400)  # enough rows to tell T from 1 (the interpreter is slow)
    ids = sampler(logits, temperature, seed=7)
    assert ids.dtype == torch.int32 and ids.shape == (400,)
    _assert_follows(ids, logits[0], temperature)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_per_row_temperatures_mix_greedy_and_sampled_rows(sampler):
    logits = _narrow_logits(800, torch.float16)
    temps = torch.tensor([0.0, 2.0] * 400, device=DEVICE)
    ids = sampler(logits, temps, seed=3)
    assert ids[0::2].tolist() == [0] * 400  # greedy rows: the argmax
    _assert_follows(ids[1::2], logits[0], 2.0)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_draws_over_a_vocabulary_of_several_blocks(sampler):
    logits = _wide_logits(300)
    _assert_follows(sampler(logits, 0.5, seed=5), logits[0], 0.5)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_thresholds_keep_the_draws_at_or_above_them(sampler):
    """Per-row thresholds on logits / T: a token below its row's never wins, and the kept ones
    follow the softmax renormalized over them; a greedy row's threshold is on its logits."""
    logits = _wide_logits(600)
    cut = {0: LIKELY[1100], 1: LIKELY[10]}  # even rows keep two tokens, odd rows only the best
    thresholds = torch.tensor([cut[i % 2] / 0.5 for i in range(600)], device=DEVICE)
    ids = sampler(logits, 0.5, seed=9, thresholds=thresholds)
    assert set(ids[1::2].tolist()) == {10}
    kept = torch.full((WIDE_VOCAB,), float("-inf"))
    kept[[10, 1100]] = logits[0, [10, 1100]].cpu()
    _assert_follows(ids[0::2], kept, 0.5)
    greedy = sampler(logits[:2], 0.0, seed=9, thresholds=torch.tensor([-40.0, 0.9], device=DEVICE))
    assert greedy.tolist() == [10, 10]


def test_greedy_ties_go_to_the_first_index():
    """Ties inside one lane (columns a block apart), across lanes, and across blocks."""
    ties = [(3, 1027), (5, 7), (1500, 2100), (0, WIDE_VOCAB - 1)]
    logits = torch.zeros(len(ties) + 1, WIDE_VOCAB)
    for row, cols in enumerate(ties):
        logits[row, list(cols)] = 4.0
    logits[-1, 1] = -1.0  # all but one column tie at 0
    ids = kernels.race_sample(logits.to(DEVICE), 0.0, seed=1)
    assert ids.tolist() == [a for a, _ in ties] + [0] == logits.argmax(-1).tolist()


def test_a_seed_fixes_the_draw_and_a_scalar_temperature_equals_a_full_row_of_it():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=g).to(DEVICE)
    first = kernels.race_sample(logits, 1.0, seed=11)
    assert torch.equal(first, kernels.race_sample(logits, 1.0, seed=11))
    assert not torch.equal(first, kernels.race_sample(logits, 1.0, seed=12))
    per_row = torch.full((64,), 1.0, device=DEVICE)
    assert torch.equal(first, kernels.race_sample(logits, per_row, seed=11))


def test_strided_rows_and_no_rows():
    wide = _wide_logits(40)
    strided = torch.cat([wide, wide], dim=1)[:, :WIDE_VOCAB]
    assert kernels.race_sample(strided, 0.0, seed=0).tolist() == [10] * 40
    assert kernels.race_sample(wide[:0], 0.7, seed=0).shape == (0,)


def test_validation_names_the_argument():
    logits = _wide_logits(4)
    bad = [
        ("logits", (logits[0], 1.0)),
        ("logits", (logits.to(torch.int32), 1.0)),
        ("logits", (logits.t(), 1.0)),
        ("temperatures", (logits, -0.5)),
        ("temperatures", (logits, float("nan"))),
        ("temperatures", (logits, torch.ones(3, device=DEVICE))),
        ("temperatures", (logits, torch.ones(4, dtype=torch.float64, device=DEVICE))),
    ]
    for name, args in bad:
        with pytest.raises(ValueError, match=name):
            kernels.race_sample(*args, seed=0)
    with pytest.raises(ValueError, match="thresholds"):
        kernels.race_sample(logits, 1.0, seed=0, thresholds=torch.zeros(3, device=DEVICE))


def _spec(temperature: float, **kw):
    from nvray.step_protocol import SampleSpec

    base = dict(temperature=temperature, top_p=1.0, top_k=-1, min_p=0.0, seed=None, step_index=0)
    return SampleSpec(**{**base, **kw})


def test_the_sampler_runs_greedy_and_plain_batches_in_the_kernel():
    """``sample(..., fused=True)`` as the model runner calls it on the GPU: a greedy batch gives
    the argmax; a batch sharing one temperature and one mixing two follow each row's
    ``softmax(logits / T)``."""
    from nvray.worker.sampler import sample

    torch.manual_seed(0)
    scattered = torch.randn(8, 50).to(DEVICE)
    assert sample(scattered, [_spec(0.0)] * 8, fused=True).tolist() == \
        scattered.argmax(-1).tolist()
    shared = sample(_narrow_logits(200), [_spec(1.0)] * 200, fused=True)
    _assert_follows(shared, NARROW, 1.0)
    mixed = sample(_narrow_logits(200), [_spec(0.5), _spec(2.0)] * 100, fused=True)
    _assert_follows(mixed[0::2], NARROW, 0.5)
    _assert_follows(mixed[1::2], NARROW, 2.0)



def test_the_fused_sampler_keeps_seeds_and_bans_and_takes_a_single_row():
    """Seeded or banned rows are not plain: ``fused=True`` draws them eagerly, as without it;
    a batch of one row runs in the kernel."""
    from nvray.worker.sampler import sample

    torch.manual_seed(1)
    logits = torch.randn(6, 50).to(DEVICE)
    seeded = [_spec(1.0, seed=10 + i, step_index=i) for i in range(6)]
    assert sample(logits, seeded, fused=True).tolist() == sample(logits, seeded).tolist()
    half = [seeded[0], _spec(1.0)]  # one seeded row makes the batch not plain
    assert sample(logits[:2], half, fused=True)[0] == sample(logits[:1], seeded[:1])[0]
    banned = [_spec(1.0, banned_token_ids=tuple(range(49)))] * 6
    assert sample(logits, banned, fused=True).tolist() == [49] * 6
    one = sample(logits[:1], [_spec(0.7)], fused=True)
    assert one.shape == (1,) and 0 <= int(one[0]) < 50


def test_the_fused_sampler_draws_new_noise_at_every_call():
    """150 draws from 1,000 equally likely tokens: ~139 distinct expected (a kernel seed drawn
    from a few dozen values would repeat its draws)."""
    from nvray.worker.sampler import sample

    flat = torch.zeros(1, 1000).to(DEVICE)
    draws = {int(sample(flat, [_spec(1.0)], fused=True)[0]) for _ in range(150)}
    assert len(draws) > 110
