"""n > 1: a request's choices share its prompt's KV blocks (forks, copy-on-write) and each is
the completion a request of its own with seed + index would give. In-process, so the tests can
look at the block manager; overlapped steps on and off."""

from __future__ import annotations

import pytest

from oracle import random_prompts
from nvray import SamplingParams
from tiny_engines import BLOCK, tiny_inprocess



@pytest.fixture(scope="module")
def llm(overlap_llm):
    return overlap_llm


def _sampled(seed: int, n: int = 1, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=0.95, seed=seed, max_tokens=12, ignore_eos=True,
                          n=n, **kw)


def test_choices_equal_single_requests_with_seed_plus_index(llm):
    prompt = random_prompts(1, 37, 37, seed=1)[0]  # 36 shared tokens: the 5th block is partial
    others = random_prompts(3, 5, 30, seed=2)
    mixed = llm.generate([prompt] + others, [_sampled(100, n=4)] + [_sampled(7)] * 3,
                         use_tqdm=False)
    choices = mixed[:4]
    assert [c.index for c in choices] == [0, 1, 2, 3]
    alone = [llm.generate(prompt, _sampled(100 + i), use_tqdm=False)[0] for i in range(4)]
    assert [c.token_ids for c in choices] == [a.token_ids for a in alone]
    assert [c.text for c in choices] == [a.text for a in alone]
    assert len({tuple(c.token_ids) for c in choices}) > 1  # the choices differ
    again = llm.generate(prompt, _sampled(100, n=4), use_tqdm=False)  # no other requests
    assert [c.token_ids for c in again] == [c.token_ids for c in choices]


def test_the_prompt_is_prefilled_once_and_forks_copy_the_shared_partial_block(llm):
    engine, bm = llm.engine, llm.engine.block_manager
    prompt = random_prompts(1, 37, 37, seed=3)[0]
    copied = bm.num_copied_blocks
    prompt_tokens = engine.stats()["prompt_tokens"]
    engine.add_request("fork", prompt, _sampled(5, n=3))
    tables = {}
    for _ in range(6):  # prefill, then the forks join
        engine.step()
        states = engine.requests["fork"]
        if all(s.seq.block_table for s in states):
            tables = {s.seq.index: list(s.seq.block_table) for s in states}
            break
    assert len(tables) == 3
    full = (len(prompt) - 1) // BLOCK  # the full blocks of the shared prompt
    shared = tables[0][:full]
    assert all(t[:full] == shared for t in tables.values())
    assert all(bm.pool.blocks[b].ref_count == 3 for b in shared)
    # the partial 5th block was shared, then copied before each write into it
    assert len({t[full] for t in tables.values()}) == 3
    assert bm.num_copied_blocks - copied >= 2
    assert engine.stats()["prompt_tokens"] - prompt_tokens == len(prompt)  # counted once
    for _ in range(40):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert bm.num_free_blocks == bm.num_blocks  # every shared and copied block came back


def test_choices_that_cannot_fork_prefill_on_their_own(tiny_path):
    """With one sequence per batch, choice 0 finishes before the others can start: they
    prefill on their own (prefix cache) and still equal their single-request twins."""
    llm = tiny_inprocess(max_num_seqs=1)
    try:
        prompt = random_prompts(1, 20, 20, seed=9)[0]
        params = SamplingParams(temperature=1.0, seed=11, max_tokens=10, n=3, ignore_eos=True,
                                logprobs=1)
        outs = llm.generate(prompt, params, use_tqdm=False)
        assert llm.engine.block_manager.num_copied_blocks == 0  # no fork happened
        for out in outs:
            twin = llm.generate(prompt, SamplingParams(temperature=1.0, seed=11 + out.index,
                                                       max_tokens=10, ignore_eos=True, logprobs=1),
                                use_tqdm=False)[0]
            assert out.token_ids == twin.token_ids and len(out.logprobs) == 10
            assert [lp.logprob for lp in out.logprobs] == pytest.approx(
                [lp.logprob for lp in twin.logprobs], abs=1e-5)
    finally:
        llm.shutdown()


def test_aborting_a_request_ends_all_its_choices(llm):
    engine, bm = llm.engine, llm.engine.block_manager
    engine.add_request("many", "abort all of my choices", _sampled(1, n=3))
    engine.step()
    engine.step()
    aborted = engine.abort_request("many")
    assert sorted(o.index for o in aborted) == [0, 1, 2]
    assert all(o.finished and o.finish_reason == "abort" for o in aborted)
    for _ in range(10):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks
    stats = engine.stats()
    assert stats["num_accepted"] == sum(stats["num_finished"].values())


def test_n_above_the_limit_is_rejected_naming_n(llm):
    with pytest.raises(ValueError, match="n=300"):
        llm.generate("x", SamplingParams(n=300), use_tqdm=False)
