"""Stepping an in-process engine through a scripted workload, as the engine tests compare two
engines: ``run_steps`` (arrivals and aborts by step, every output kept), ``mixed_workload``
(chunked prefills, prefix hits, KV pressure, EOS and stop rules, min/max tokens, seeded
sampling, streams, late arrivals, aborts), ``assert_clean`` (nothing left held)."""

from __future__ import annotations

import pytest

from nvray import SamplingParams
from oracle import random_prompts

MAX_STEPS = 3000


def run_steps(engine, arrivals: dict[int, list[tuple]], aborts: dict[int, list[str]],
              after_step=None) -> dict:  # noqa: ANN001
    """Step until idle; ``arrivals``/``aborts``: what happens before step k; ``after_step``:
    called with the engine after each step. Returns, per request, every output it got, in
    order."""
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
        if after_step is not None:
            after_step(engine)
    else:
        pytest.fail(f"the engine did not drain in {MAX_STEPS} steps")
    return outputs


def assert_clean(engine) -> None:
    bm = engine.block_manager
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert bm.num_free_blocks == bm.num_blocks
    assert all(block.ref_count == 0 for block in bm.pool.blocks)
    assert engine.stats()["num_accepted"] == sum(engine.stats()["num_finished"].values())  # each ended exactly once


def mixed_workload(tokenizer) -> tuple[dict[int, list[tuple]], dict[int, list[str]]]:
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


def with_stop_rules(arrivals, stop_token: int, stop_text: str):  # noqa: ANN001, ANN202
    more = [("stop_id", arrivals[0][0][1], SamplingParams(temperature=0.0, max_tokens=40,
                                                          stop_token_ids=[stop_token]), True),
            ("stop_str", arrivals[0][0][1], SamplingParams(temperature=0.0, max_tokens=40,
                                                           stop=[stop_text]), True)]
    return {**arrivals, 5: more}
