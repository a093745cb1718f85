"""Sampler: filtered tokens are never drawn; seeded draws do not depend on the batch."""

from __future__ import annotations

import pytest
import torch

from nvray.step_protocol import SampleSpec
from nvray.worker.sampler import sample


def spec(**kw) -> SampleSpec:
    base = dict(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, seed=None, step_index=0)
    return SampleSpec(**{**base, **kw})


LOGITS = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0])
# probabilities 0.5, 0.25, 0.25 exactly (float32 softmax of these logits is exact)
HALVES = torch.tensor([0.5, 0.25, 0.25]).log()


def draws(s: SampleSpec, n: int = 400) -> set[int]:
    return set(sample(LOGITS.repeat(n, 1), [s] * n).tolist())


def test_top_k_keeps_exactly_the_k_best():
    assert draws(spec(top_k=3, temperature=5.0)) == {0, 1, 2}
    assert draws(spec(top_k=1, temperature=5.0)) == {0}


@pytest.mark.parametrize("top_k", [-1, 3], ids=["sorted", "candidates"])
def test_min_p_keeps_tokens_exactly_at_the_fraction_of_the_best(top_k):
    n = 600
    at_half = set(sample(HALVES.repeat(n, 1), [spec(min_p=0.5, top_k=top_k)] * n).tolist())
    above_half = set(sample(HALVES.repeat(n, 1), [spec(min_p=0.51, top_k=top_k)] * n).tolist())
    assert (at_half, above_half) == ({0, 1, 2}, {0})


def test_different_seeds_draw_different_tokens():
    logits = torch.zeros(1, 1000)  # uniform: the seed alone decides
    ids = {sample(logits, [spec(seed=seed)]).item() for seed in range(20)}
    assert len(ids) > 10


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = LOGITS.softmax(-1)
    p = float(probs[0] + probs[1]) - 1e-4  # the two best reach p; the third is not needed
    assert draws(spec(top_p=p)) == {0, 1}
    assert draws(spec(top_p=p, top_k=5)) == {0, 1}  # the top-K candidates' path




@pytest.mark.parametrize("top_k", [-1, 3], ids=["sorted", "candidates"])
@pytest.mark.parametrize("top_p,kept", [(0.5, {0}), (0.75, {0, 1}), (0.76, {0, 1, 2})])
def test_top_p_stops_at_the_first_token_whose_mass_reaches_p(top_k, top_p, kept):
    """A set whose mass equals ``top_p`` exactly is enough: the next token is not kept."""
    n = 600
    drawn = set(sample(HALVES.repeat(n, 1), [spec(top_p=top_p, top_k=top_k)] * n).tolist())
    assert drawn == kept


def test_min_p_drops_tokens_below_the_fraction_of_the_best():
    probs = LOGITS.softmax(-1)
    allowed = {i for i, q in enumerate(probs.tolist()) if q >= 0.3 * float(probs.max())}
    assert draws(spec(min_p=0.3, temperature=1.0)) <= allowed


def test_temperature_zero_is_argmax_and_banned_ids_are_never_drawn():
    assert sample(LOGITS.unsqueeze(0), [spec(temperature=0.0)]).tolist() == [0]
    banned = spec(temperature=0.0, banned_token_ids=(0, 1))
    assert sample(LOGITS.unsqueeze(0), [banned]).tolist() == [2]
    assert 0 not in draws(spec(banned_token_ids=(0,)))


def test_unfiltered_sampling_reaches_many_tokens():
    assert len(draws(spec(temperature=3.0), n=2000)) >= 6


def test_seeded_rows_do_not_depend_on_batch_composition():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    seeded = spec(seed=1234, step_index=7, top_k=20, top_p=0.9)
    alone = sample(logits[2:3], [seeded]).item()
    mixed = sample(logits, [spec(), spec(temperature=0.0), seeded, spec(seed=5), spec()])
    assert mixed[2].item() == alone
    other_step = [sample(logits[2:3], [spec(seed=1234, step_index=k)]).item() for k in range(20)]
    assert len(set(other_step)) > 1  # the step index changes the noise


@pytest.mark.parametrize("filters", [dict(top_k=1), dict(top_k=7, top_p=0.8),
                                     dict(top_k=50, min_p=0.05), dict(top_k=200, top_p=0.5),
                                     dict(top_k=3, banned_token_ids=(0, 1, 2))])
def test_top_k_candidates_draw_what_the_sorted_vocabulary_draws(monkeypatch, filters):
    """Seeded rows: the top-K path against the whole sorted vocabulary (float logits without
    ties: equal logits at a filter's cut may keep a different one of them on each path)."""
    from nvray.worker import sampler

    torch.manual_seed(1)
    logits = torch.randn(12, 300) * 3
    specs = [spec(seed=100 + i, step_index=i, temperature=0.5 + 0.2 * i, **filters)
             for i in range(12)]
    specs[4] = specs[4]._replace(temperature=0.0)  # a greedy row among them
    candidates = sample(logits, specs)
    monkeypatch.setattr(sampler, "_MAX_CANDIDATES", 0)  # the sorted-vocabulary path
    assert sample(logits, specs).tolist() == candidates.tolist()


def test_top_k_above_the_candidate_bound_still_filters():
    logits = torch.arange(2000, dtype=torch.float32).repeat(64, 1) / 400
    ids = sample(logits, [spec(top_k=1500, temperature=0.3)] * 64)
    assert ids.min().item() >= 2000 - 1500


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0.0), dict(top_k=-5),
                                 dict(min_p=1.5), dict(max_tokens=-1), dict(seed=-1),
                                 dict(min_tokens=20, max_tokens=10), dict(stop=[""]),
                                 dict(temperature=float("nan")), dict(stop_token_ids=[-3]),
                                 dict(n=0), dict(n=1.5), dict(logprobs=21), dict(logprobs=-1),
                                 dict(prompt_logprobs=-2), dict(presence_penalty=2.5),
                                 dict(frequency_penalty=float("inf")), dict(repetition_penalty=0),
                                 dict(logit_bias={"x": 1.0}), dict(logit_bias={5: 101}),
                                 dict(logit_bias={-1: 1.0}), dict(allowed_token_ids=[]),
                                 dict(allowed_token_ids=[-1]), dict(bad_words=[" "])])
def test_bad_sampling_params_are_rejected_naming_the_field(bad):
    from nvray import SamplingParams

    field = next(iter(bad))
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad)


def test_unknown_sampling_param_is_rejected():
    from nvray import SamplingParams

    with pytest.raises(ValueError, match="presence_pentaly"):
        SamplingParams.from_dict({"presence_pentaly": 1.0})


def test_rows_without_top_k_keep_their_whole_vocabulary_beside_a_top_k_row():
    """A batch whose rows differ in top_k: a row with top_k off (0, or -1 beside a greedy row
    whose top_k is set) still draws from every token, never from another row's k best."""
    n, uniform = 300, torch.zeros(64)
    out = sample(uniform.repeat(2 * n, 1), [spec(top_k=0), spec(top_k=2)] * n)
    assert len(set(out[0::2].tolist())) > 2 and len(set(out[1::2].tolist())) <= 2
    out = sample(uniform.repeat(2 * n, 1), [spec(top_p=0.999), spec(temperature=0.0, top_k=2)] * n)
    assert len(set(out[0::2].tolist())) > 2


def test_top_p_one_removes_no_token_where_the_float32_mass_reaches_one_early():
    from nvray.worker.sampler import _filter_sorted

    sorted_logits = torch.tensor([[30.0] + [0.0] * 15])  # the best token's probability rounds to 1
    kept = _filter_sorted(sorted_logits, [spec(top_p=1.0)])
    assert torch.isfinite(kept).all()
