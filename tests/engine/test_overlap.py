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

MAX_STEPS = 3000


def _engine(overlap: bool, **kwargs):  # noqa: ANN202
    options = {"max_model_len": 256, "max_num_batched_tokens": 64, "num_kvcache_blocks": 24,
               "kvcache_block_size": 16, **kwargs}
    return LLM("tiny", runtime="inprocess", overlap_scheduling=overlap, **options).engine


def _run(engine, arrivals: dict[int, list[tuple]], aborts: dict[int, list[str]]) -> dict:
    """Step until idle; ``arrivals``/``aborts``: what happens before step k. Returns, per
    request, every output it got, in order."""
    outputs: dict[str, list] = {}
    for k in range(MAX_STEPS):
        for request_id, prompt, params, stream in arrivals.get(k, []):
            engine.add_request(request_id, prompt, params, stream=stream)
            outputs[request_id] = []
        for request_id in aborts.get(k, []):
            outputs[request_id] += engine.abort_request(request_id)
        if k > max([*arrivals, *aborts]) and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            outputs[out.request_id].append(out)
    else:
        pytest.fail(f"the engine did not drain in {MAX_STEPS} steps")
    return outputs


def _assert_clean(engine) -> None:
    bm = engine.block_manager
    assert not engine.has_unfinished_requests() and engine.in_flight is None
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert bm.num_free_blocks == bm.num_blocks
    assert all(block.ref_count == 0 for block in bm.blocks)
    assert engine.num_accepted == sum(engine.num_finished.values())  # each ended exactly once


def _workload(tokenizer) -> tuple[dict[int, list[tuple]], dict[int, list[str]]]:
    prompts = random_prompts(8, 20, 150, seed=41)
    shared = prompts[0][:48]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    first = {
        0: [(f"g{i}", p, greedy, i % 2 == 0) for i, p in enumerate(prompts[:4])]
           + [("eos", prompts[4], SamplingParams(temperature=0.0, max_tokens=60), False),
              ("seeded", prompts[5], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=30,
                                                    seed=7, ignore_eos=True), True),
              ("min", prompts[6], SamplingParams(temperature=0.0, max_tokens=20, min_tokens=5,
                                                 ignore_eos=True), False)],
        3: [("prefix", shared + [5, 6, 7], greedy, True),
            ("one", prompts[7][:30], SamplingParams(temperature=0.0, max_tokens=1), False)],
        9: [("late", prompts[1], greedy, False),  # the same prompt again: prefix hits
            ("abort_early", prompts[2], greedy, True)],
        20: [("abort_late", prompts[3][:90], greedy, False)],
    }
    return first, {10: ["abort_early"], 30: ["abort_late"]}


def _with_stop_rules(arrivals, stop_token: int, stop_text: str):  # noqa: ANN001, ANN202
    more = [("stop_id", arrivals[0][0][1], SamplingParams(temperature=0.0, max_tokens=40,
                                                          stop_token_ids=[stop_token]), True),
            ("stop_str", arrivals[0][0][1], SamplingParams(temperature=0.0, max_tokens=40,
                                                           stop=[stop_text]), True)]
    return {**arrivals, 5: more}


@pytest.fixture(scope="module")
def engines():  # noqa: ANN201
    return _engine(True), _engine(False)


def test_overlap_gives_the_same_outputs_as_one_step_at_a_time(engines):
    on, off = engines
    arrivals, aborts = _workload(on.tokenizer)
    probe = _run(off, {0: [arrivals[0][0]]}, {})["g0"][-1]  # g0 alone: pick stop rules from it
    stop_token, stop_text = probe.token_ids[7], probe.text[10:13]
    assert stop_text.strip(), "the probe text is too short to pick a stop string"
    arrivals = _with_stop_rules(arrivals, stop_token, stop_text)
    results = {}
    for name, engine in (("on", on), ("off", off)):
        preemptions = engine.scheduler.num_preemptions
        hits = engine.block_manager.num_hit_tokens
        results[name] = _run(engine, arrivals, aborts)
        assert engine.scheduler.num_preemptions > preemptions, "the workload must preempt"
        assert engine.block_manager.num_hit_tokens > hits, "the workload must hit the prefix cache"
        _assert_clean(engine)
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
    outs = _run(on, arrivals, {})
    assert on.scheduler.num_preemptions > preemptions
    for i, prompt in enumerate(prompts):
        assert outs[f"r{i}"][-1].token_ids == hf_greedy(tiny_path, prompt, 12)
    _assert_clean(on)


def test_a_request_that_finishes_drops_the_token_computed_after_it(engines):
    on, _ = engines
    prompt = random_prompts(1, 30, 30, seed=44)[0]
    for max_tokens in (1, 2, 3):
        outs = _run(on, {0: [("r", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                          ignore_eos=True), True)]}, {})
        assert len(outs["r"][-1].token_ids) == max_tokens
        assert sum(len(o.delta_token_ids) for o in outs["r"]) == max_tokens
        assert on.num_finished["length"] > 0
        _assert_clean(on)
