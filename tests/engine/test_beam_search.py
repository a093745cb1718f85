"""Beam search against a reference beam search (``oracle.py``) over HF transformers' logits, and
the block accounting of its forks. In-process (the tests look at the block manager); the same
engine code runs behind Ray (tests/runtime)."""

from __future__ import annotations

import pytest

from oracle import random_prompts, reference_beam_search
from nvray import BeamSearchParams, SamplingParams
from nvray.engine.beam_search import Hypothesis, beam_score
from tiny_engines import BLOCK, tiny_inprocess



@pytest.fixture(scope="module")
def llm(overlap_llm):
    return overlap_llm


@pytest.mark.parametrize("width,max_tokens,length_penalty", [(1, 5, 1.0), (3, 7, 1.0),
                                                             (4, 6, 0.5)])
def test_beams_equal_the_reference(llm, tiny_path, width, max_tokens, length_penalty):
    prompts = random_prompts(2, 5, 19, seed=width)
    eos = llm.engine.limits.eos_token_ids
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                              length_penalty=length_penalty)
    results = llm.beam_search(prompts, params, use_tqdm=False)
    for prompt, beams in zip(prompts, results):
        expected = reference_beam_search(tiny_path, prompt, width, max_tokens, eos, length_penalty)
        assert [b.token_ids for b in beams] == [tokens for tokens, _ in expected]
        assert [b.cumulative_logprob for b in beams] == pytest.approx(
            [cum for _, cum in expected], abs=1e-4)
        assert [b.index for b in beams] == list(range(width))
        assert all(b.text == llm.tokenizer.decode(b.token_ids, skip_special_tokens=True)
                   for b in beams)


@pytest.mark.parametrize("length_penalty", [0.0, 3.0])
def test_length_penalty_ranks_beams_that_ended_at_different_lengths(llm, tiny_path,
                                                                     length_penalty):
    """A prompt whose beams reach EOS at several lengths: the penalty changes which beams win
    (the reference says so), and the engine's beams follow it."""
    prompt = random_prompts(1, 3, 12, seed=11)[0]
    eos = llm.engine.limits.eos_token_ids
    neutral = reference_beam_search(tiny_path, prompt, 4, 8, eos, 1.0)
    expected = reference_beam_search(tiny_path, prompt, 4, 8, eos, length_penalty)
    assert [t for t, _ in expected] != [t for t, _ in neutral]  # the penalty matters here
    params = BeamSearchParams(beam_width=4, max_tokens=8, length_penalty=length_penalty)
    beams = llm.beam_search([prompt], params, use_tqdm=False)[0]
    assert [b.token_ids for b in beams] == [t for t, _ in expected]
    assert [b.cumulative_logprob for b in beams] == pytest.approx([c for _, c in expected],
                                                                  abs=1e-4)
    assert [b.finish_reason for b in beams] == [  # EOS ends a beam early; the rest hit the limit
        "stop" if t[-1] in eos else "length" for t, _ in expected]
    for b in beams:  # the final output is the whole answer, its own delta; EOS is not text
        assert b.finished is True and b.prompt_token_ids == prompt
        assert b.text == llm.tokenizer.decode(b.token_ids, skip_special_tokens=True)
        assert (b.delta_text, b.delta_token_ids) == (b.text, b.token_ids)
    ended = [b for b in beams if b.finish_reason == "stop"]  # EOS is the last of its tokens
    assert all(llm.tokenizer.decode(b.token_ids) != b.text for b in ended)
    assert ended or length_penalty > 1.0  # short beams win without a penalty on length


def test_ignore_eos_keeps_every_beam_to_max_tokens(llm, tiny_path):
    prompt = random_prompts(1, 3, 12, seed=11)[0]  # its beams reach EOS when it is not ignored
    expected = reference_beam_search(tiny_path, prompt, 4, 8, eos=())
    params = BeamSearchParams(beam_width=4, max_tokens=8, ignore_eos=True)
    beams = llm.beam_search([prompt], params, use_tqdm=False)[0]
    assert [b.token_ids for b in beams] == [t for t, _ in expected]
    assert all(len(b.token_ids) == 8 and b.finish_reason == "length" for b in beams)


def test_beams_share_blocks_and_give_every_block_back(llm):
    engine, bm = llm.engine, llm.engine.block_manager
    prompt = random_prompts(1, 29, 29, seed=7)[0]  # 3 full blocks and a partial one
    copied = bm.num_copied_blocks
    engine.add_request("beams", prompt, BeamSearchParams(beam_width=4, max_tokens=12))
    seen_sharing = False
    for _ in range(200):
        group = engine.beams.groups.get("beams")
        if group is None:
            break
        tables = [b.block_table for b in group.beams.values() if b.block_table]
        if len(tables) == 4:  # every beam of a round holds blocks: the prompt's are shared
            first = tables[0][:len(prompt) // BLOCK]
            assert all(t[:len(first)] == first for t in tables)
            assert all(bm.pool.blocks[b].ref_count == 4 for b in first)
            seen_sharing = True
        engine.step()
    assert seen_sharing and "beams" not in engine.beams.groups
    assert bm.num_copied_blocks > copied  # a shared partial block is copied, never overwritten
    for _ in range(5):
        engine.step()
    assert not engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks
    assert not engine.plans and not engine.beams.group_of_seq  # nothing of the search is kept
    stats = engine.stats()
    assert stats["num_accepted"] == sum(stats["num_finished"].values())


def test_aborting_a_beam_search_ends_it_and_frees_its_blocks(llm):
    engine, bm = llm.engine, llm.engine.block_manager
    prompt_ids = engine.add_request("gone", "abort this search",
                                    BeamSearchParams(beam_width=2, max_tokens=30))
    for _ in range(4):
        engine.step()
    outs = engine.abort_request("gone")
    assert [o.index for o in outs] == [0, 1] and {o.finish_reason for o in outs} == {"abort"}
    assert all(o.finished is True and o.request_id == "gone" and o.prompt_token_ids == prompt_ids
               for o in outs)
    for _ in range(5):
        engine.step()
    assert not engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks


def test_a_failed_step_ends_a_search_with_the_engines_error(llm):
    engine, bm = llm.engine, llm.engine.block_manager
    engine.add_request("doomed", "fail this search", BeamSearchParams(beam_width=2, max_tokens=30))
    for _ in range(4):
        engine.step()
    outs = engine.fail_all("engine failed: boom")
    assert [o.index for o in outs] == [0, 1]
    assert all(o.finish_reason == "error" and o.error == "engine failed: boom" for o in outs)
    for _ in range(5):
        engine.step()
    assert not engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("bad", [dict(beam_width=0), dict(beam_width=11), dict(max_tokens=0),
                                 dict(temperature=0.5), dict(length_penalty=float("nan"))])
def test_bad_beam_search_params_are_rejected_naming_the_field(bad):
    field = next(iter(bad))
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **bad})


def test_a_search_under_kv_pressure_ends_with_the_same_beams(tiny_path):
    """A cache that holds little more than one beam: beams are preempted, idle ones give their
    blocks back, and the search still ends (within a bounded number of steps) with the beams a
    roomy cache gives."""
    prompt = random_prompts(1, 20, 20, seed=17)[0]
    params = BeamSearchParams(beam_width=3, max_tokens=20)
    roomy = tiny_inprocess(max_model_len=64)
    tight = tiny_inprocess(max_model_len=64, num_kvcache_blocks=8)
    try:
        want = roomy.beam_search(prompt, params, use_tqdm=False)[0]
        engine = tight.engine
        engine.add_request("tight", prompt, params)
        outs = []
        for _ in range(2000):
            outs += engine.step()
            if not engine.has_unfinished_requests():
                break
        assert not engine.has_unfinished_requests(), "the search stalled"
        assert engine.scheduler.num_preemptions > 0  # the cache was really too small
        assert [o.token_ids for o in sorted(outs, key=lambda o: o.index)] == \
            [w.token_ids for w in want]
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        roomy.shutdown()
        tight.shutdown()


def test_beam_score_is_the_log_probability_over_the_length_to_the_penalty():
    """vLLM's score: cumulative log-probability / (prompt + generated tokens, EOS not counted)
    ** length_penalty, down to a one-token prompt whose beam ended at once."""
    assert beam_score(1, Hypothesis([7], -2.0, True), 2.0) == -2.0
    assert beam_score(2, Hypothesis([7], -3.0, False), 1.0) == pytest.approx(-1.0)
    assert beam_score(2, Hypothesis([7, 8], -3.0, True), 0.5) == pytest.approx(-3.0 / 3 ** 0.5)


def test_a_search_that_cannot_fit_max_model_len_is_rejected(llm):
    limit = llm.engine.limits.max_model_len
    with pytest.raises(ValueError, match="max_model_len"):
        llm.engine.add_request("too-long", [1, 2, 3], BeamSearchParams(beam_width=2,
                                                                        max_tokens=limit - 2))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("policy", ["sjf", "priority"])
def test_a_search_beside_another_request_under_kv_pressure_runs_under_every_policy(tiny_path,
                                                                                 policy):
    """The beams of each round are ordered and preempted by their arrival and priority like any
    request: a tight cache shared with a plain request still ends both, the beams as alone."""
    prompt, other = random_prompts(2, 20, 20, seed=17)
    params = BeamSearchParams(beam_width=3, max_tokens=12)
    roomy = tiny_inprocess(max_model_len=64)
    tight = tiny_inprocess(max_model_len=64, num_kvcache_blocks=10, scheduling_policy=policy)
    try:
        want = roomy.beam_search(prompt, params, use_tqdm=False)[0]
        engine = tight.engine
        engine.add_request("search", prompt, params, priority=1)
        engine.add_request("other", other, SamplingParams(max_tokens=12, ignore_eos=True))
        outs = []
        for _ in range(2000):
            outs += engine.step()
            if not engine.has_unfinished_requests():
                break
        assert not engine.has_unfinished_requests(), "the requests stalled"
        beams = sorted((o for o in outs if o.request_id == "search"), key=lambda o: o.index)
        assert [o.token_ids for o in beams] == [w.token_ids for w in want]
        assert [len(o.token_ids) for o in outs if o.request_id == "other"] == [12]
    finally:
        roomy.shutdown()
        tight.shutdown()


def test_every_round_of_a_search_keeps_its_priority_and_arrival_time(llm):
    """The scheduler orders and preempts each round's beams as the request it came in as."""
    engine = llm.engine
    engine.add_request("ranked", "keep my place", BeamSearchParams(beam_width=2, max_tokens=6),
                       priority=3)
    arrival = next(iter(engine.beams.groups["ranked"].beams.values())).arrival_time
    seen, rounds = set(), set()
    for _ in range(100):
        group = engine.beams.groups.get("ranked")
        if group is None:
            break
        seen |= {(b.priority, b.arrival_time) for b in group.beams.values()}
        rounds |= {b.seq_id for b in group.beams.values()}
        engine.step()
    assert seen == {(3, arrival)} and len(rounds) > 2  # several rounds of new beams


def test_two_searches_at_once_under_kv_pressure_end_with_the_beams_each_has_alone(tiny_path):
    """Searches whose rounds end in different steps in a cache too small for both: a round that
    is complete moves on while the other search's beams wait for blocks."""
    prompts = random_prompts(2, 20, 20, seed=23)
    widths = (3, 2)
    roomy = tiny_inprocess(max_model_len=64)
    tight = tiny_inprocess(max_model_len=64, num_kvcache_blocks=10)
    try:
        want = [roomy.beam_search(p, BeamSearchParams(beam_width=w, max_tokens=12),
                                  use_tqdm=False)[0] for p, w in zip(prompts, widths)]
        engine = tight.engine
        for i, (p, w) in enumerate(zip(prompts, widths)):
            engine.add_request(f"s{i}", p, BeamSearchParams(beam_width=w, max_tokens=12))
        outs = []
        for _ in range(2000):
            outs += engine.step()
            if not engine.has_unfinished_requests():
                break
        assert not engine.has_unfinished_requests(), "the searches stalled"
        assert engine.scheduler.num_preemptions > 0  # the cache was really too small
        for i, beams in enumerate(want):
            got = sorted((o for o in outs if o.request_id == f"s{i}"), key=lambda o: o.index)
            assert [o.token_ids for o in got] == [b.token_ids for b in beams]
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        roomy.shutdown()
        tight.shutdown()
