"""Overlapped steps against steps run one at a time: the same tokens, text and stream deltas.

Two in-process engines on the tiny model, one with ``overlap_scheduling`` (the default) and one
without, run the same mixed workload step by step: chunked prefills, prefix hits, KV pressure
that preempts, EOS and stop ids, stop strings, min/max tokens, seeded sampling, streams,
requests arriving mid-run and aborts. Afterwards each engine must hold nothing: no request,
no step in flight, every KV block free. (tests/runtime runs overlap through Ray, TP=1 and 2.)
"""

from __future__ import annotations

import pytest

from nvray import LLM, SamplingParams
from oracle import hf_greedy, random_prompts
from stepping import assert_clean, mixed_workload, run_steps, with_stop_rules


def _engine(overlap: bool, **kwargs):  # noqa: ANN202
    options = {"max_model_len": 256, "max_num_batched_tokens": 64, "num_kvcache_blocks": 24,
               "kvcache_block_size": 16, **kwargs}
    return LLM("tiny", runtime="inprocess", overlap_scheduling=overlap, **options).engine


@pytest.fixture(scope="module")
def engines():  # noqa: ANN201
    return _engine(True), _engine(False)


def test_overlap_gives_the_same_outputs_as_one_step_at_a_time(engines):
    on, off = engines
    arrivals, aborts = mixed_workload(on.tokenizer)
    probe = run_steps(off, {0: [arrivals[0][0]]}, {})["g0"][-1]  # g0 alone: pick stop rules from it
    stop_token, stop_text = probe.token_ids[7], probe.text[10:13]
    assert stop_text.strip(), "the probe text is too short to pick a stop string"
    arrivals = with_stop_rules(arrivals, stop_token, stop_text)
    results = {}
    for name, engine in (("on", on), ("off", off)):
        preemptions = engine.scheduler.num_preemptions
        hits = engine.block_manager.num_hit_tokens
        results[name] = run_steps(engine, arrivals, aborts)
        assert engine.scheduler.num_preemptions > preemptions, "the workload must preempt"
        assert engine.block_manager.num_hit_tokens > hits, "the workload must hit the prefix cache"
        assert_clean(engine)
    a, b = results["on"], results["off"]
    assert a.keys() == b.keys()
    for request_id in a:
        final_a, final_b = a[request_id][-1], b[request_id][-1]
        assert final_a.finished and final_b.finished
        if request_id.startswith("abort"):  # aborted at a step: a prefix of the full answer
            assert final_a.finish_reason == final_b.finish_reason == "abort"
            full = a["g2" if request_id == "abort_early" else "g3"][-1].token_ids
            assert full[:len(final_a.token_ids)] == final_a.token_ids
            assert full[:len(final_b.token_ids)] == final_b.token_ids
            continue
        assert (final_a.token_ids, final_a.text, final_a.finish_reason) == \
            (final_b.token_ids, final_b.text, final_b.finish_reason), request_id
        deltas_a = [(o.delta_text, o.delta_token_ids) for o in a[request_id]]
        assert deltas_a == [(o.delta_text, o.delta_token_ids) for o in b[request_id]], request_id
    assert a["stop_id"][-1].finish_reason == "stop" and a["stop_id"][-1].token_ids[-1] == stop_token
    assert a["stop_str"][-1].finish_reason == "stop" and stop_text not in a["stop_str"][-1].text
    assert len(a["one"][-1].token_ids) == 1
    assert len(a["min"][-1].token_ids) == 20


def test_overlap_greedy_tokens_match_hf_under_kv_pressure(engines, tiny_path):
    on, _ = engines
    prompts = random_prompts(6, 40, 120, seed=43)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    arrivals = {0: [(f"r{i}", p, params, False) for i, p in enumerate(prompts)]}
    preemptions = on.scheduler.num_preemptions
    outs = run_steps(on, arrivals, {})
    assert on.scheduler.num_preemptions > preemptions
    for i, prompt in enumerate(prompts):
        assert outs[f"r{i}"][-1].token_ids == hf_greedy(tiny_path, prompt, 12)
    assert_clean(on)


def test_a_request_that_finishes_drops_the_token_computed_after_it(engines):
    on, _ = engines
    prompt = random_prompts(1, 30, 30, seed=44)[0]
    for max_tokens in (1, 2, 3):
        outs = run_steps(on, {0: [("r", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                          ignore_eos=True), True)]}, {})
        assert len(outs["r"][-1].token_ids) == max_tokens
        assert sum(len(o.delta_token_ids) for o in outs["r"]) == max_tokens
        assert on.stats()["num_finished"]["length"] > 0
        assert_clean(on)
