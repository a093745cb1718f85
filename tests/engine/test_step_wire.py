"""A step crosses to the Ray ranks unchanged: what the ranks unpickle equals what the driver
built, field for field and type for type (the wire form is plain tuples: nvray/step_protocol.py)."""

from __future__ import annotations

import pickle

import numpy as np
import ray

from nvray.step_protocol import (Penalties, PromptScore, SampleSpec, SeqStep, StepInput,
                                 placeholder_id)


def a_step() -> StepInput:
    history = np.array([5, 6, 7, 6], dtype=np.int32).tobytes()
    plain = SampleSpec(0.6, 0.9, 20, 0.0, None, 3)
    full = SampleSpec(1.0, 1.0, -1, 0.05, 1234, 0, banned_token_ids=(2, 9), logprobs=5,
                      penalties=Penalties(0.5, 0.25, 1.1, history, 3, 7),
                      logit_bias=((11, -2.5), (12, 3.0)), allowed_token_ids=(4, 5, 6))
    return StepInput(
        seqs=[SeqStep(0, [17], 40, [3, 8], plain),
              SeqStep(7, [placeholder_id(2)], 99, [1], full),
              SeqStep(3, [21, 22, 23, 24], 0, [5], None, PromptScore(2, 1, [22, 23])),
              SeqStep(4, [30, 31], 6, [6, 9], plain, PromptScore(0, 0, [31])),
              SeqStep(5, [40], 70, [], plain, None, 5)],  # no new block-table entry
        block_copies=[(3, 12)], released=[2, 6], adjusts_logits=True, samples_logprobs=True)


def assert_same(got: StepInput, want: StepInput) -> None:
    assert got == want
    assert type(got) is StepInput
    for g, w in zip(got.seqs, want.seqs):
        assert type(g) is SeqStep
        for field in ("sample", "score"):
            assert type(getattr(g, field)) is type(getattr(w, field)), field
        if w.sample is not None and w.sample.penalties is not None:
            assert type(g.sample.penalties) is Penalties
    assert [s.sample.step_index for s in got.seqs if s.sample] == [3, 0, 3, 3]


def test_step_round_trips_through_pickle():
    step = a_step()
    assert_same(pickle.loads(pickle.dumps(step, protocol=5)), step)


def test_step_round_trips_through_ray(ray_cluster):
    step = a_step()
    assert_same(ray.get(ray.put(step)), step)

    @ray.remote(num_cpus=0)
    def echo_fields(s: StepInput) -> list:
        return [(q.seq_id, q.token_ids, q.start_pos, q.block_table, type(q.sample).__name__,
                 type(q.score).__name__, q.table_start) for q in s.seqs] + [s.released]

    assert ray.get(echo_fields.remote(step), timeout=60) == [
        (0, [17], 40, [3, 8], "SampleSpec", "NoneType", 0),
        (7, [-3], 99, [1], "SampleSpec", "NoneType", 0),
        (3, [21, 22, 23, 24], 0, [5], "NoneType", "PromptScore", 0),
        (4, [30, 31], 6, [6, 9], "SampleSpec", "PromptScore", 0),
        (5, [40], 70, [], "SampleSpec", "NoneType", 5),
        [2, 6]]
