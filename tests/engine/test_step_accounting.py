"""Step accounting: ``LLMEngine.stats()``'s ``steps`` and ``step_seconds`` (``/metrics``:
``nvray_steps_total``, ``nvray_step_seconds_total``, tested in tests/serve).

Every ``step()`` that does work counts once: as ``prefill`` when the step it launches computes
prompt tokens (decodes riding along or not), else as ``decode``; with overlapped steps the call
that only collects the last step in flight counts as that step's kind. Its wall time goes with it.
"""

from __future__ import annotations

import time

import pytest

from nvray import LLM, SamplingParams
from oracle import random_prompts

MAX_STEPS = 200


def _engine(overlap: bool):  # noqa: ANN202
    return LLM("tiny", runtime="inprocess", overlap_scheduling=overlap, max_model_len=256,
               max_num_batched_tokens=32, kvcache_block_size=16).engine


def _drain(engine) -> float:
    """Step until idle; the wall time of the loop."""
    start = time.perf_counter()
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            return time.perf_counter() - start
        engine.step()
    pytest.fail(f"the engine did not drain in {MAX_STEPS} steps")


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_chunked_prompt_and_decodes_are_counted_by_kind(overlap):
    engine = _engine(overlap)
    engine.step()  # an idle engine's step does nothing and counts nothing
    assert engine.stats()["steps"] == {"prefill": 0, "decode": 0}

    prompt = random_prompts(1, 100, 100, seed=3)[0]
    engine.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    wall = _drain(engine)
    stats = engine.stats()
    # 100 prompt tokens at 32 a step: 4 chunks, the last one samples token 1; tokens 2-6 are
    # decode steps, and with overlap one more call collects the last of them
    assert stats["steps"] == {"prefill": 4, "decode": 5 + overlap}
    assert stats["step_seconds"]["prefill"] > 0 and stats["step_seconds"]["decode"] > 0
    assert sum(stats["step_seconds"].values()) <= wall


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_a_step_that_mixes_a_prompt_with_decodes_counts_as_prefill(overlap):
    engine = _engine(overlap)
    first, second = random_prompts(2, 20, 20, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request("first", first, params)
    for _ in range(3):  # its prefill, then decodes
        engine.step()
    assert engine.stats()["steps"] == {"prefill": 1, "decode": 2}
    engine.add_request("second", second, params)  # joins the first one's next decode step
    engine.step()
    assert engine.stats()["steps"] == {"prefill": 2, "decode": 2}
    _drain(engine)
    # second's 7 decode steps (and the collecting call, with overlap) remain, the first one
    # finishing on the way
    assert engine.stats()["steps"] == {"prefill": 2, "decode": 2 + 7 + overlap}
