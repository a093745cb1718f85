"""Speculative decoding on the GPU: the tiny model in float32 with CUDA graphs (verification
steps replay the verification graphs: k + 1 rows a sequence, padded where a sequence drafts
fewer), a drafter that is always right and one that is always wrong, with fixed and adaptive
draft counts, a JSON-schema request among them, against the same engine settings without speculation: greedy and seeded tokens
equal. A draft model on the rank (the tiny model drafting for itself, and another random
checkpoint that is never right), its mirror and draft forwards replaying its own graphs. An
EAGLE-3 drafter, random and echoed. Qwen3.5 hybrids: verified chunks held, the kept rows
applied to the linear-attention state, verification graphs replayed; Qwen3.5's MTP head."""

from __future__ import annotations

import pytest
import torch

from nvray import LLM, SamplingParams
from drafters import Recorded
from oracle import random_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
# a tiny model's KV cache sized from the device's memory is millions of blocks on an H200 (20 s
# of the block manager's start-up and 5 s of its shutdown): these batches need a few hundred
SMALL = {"num_kvcache_blocks": 512, "max_num_seqs": 8}


@pytest.mark.parametrize("batch,adaptive", [(1, False), (6, False), (6, True)])
def test_speculation_on_the_gpu_keeps_the_tokens(batch, adaptive):
    prompts = random_prompts(batch, 10, 40, seed=12)
    params = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=1.0, seed=i, max_tokens=32, ignore_eos=True)
              for i in range(batch)]
    if batch > 2:  # a JSON-schema request drafts too: each draft row masked on the GPU
        params[2] = SamplingParams(temperature=0.0, max_tokens=32, structured_outputs={
            "json": {"type": "object", "properties": {"n": {"type": "integer"}}}})
    options = {"runtime": "inprocess", "dtype": "float32", "max_model_len": 256, **SMALL}
    plain = LLM("tiny", **options)
    try:
        expected = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    finally:
        plain.shutdown()
    answers = [list(p) + list(t) for p, t in zip(prompts, expected)]
    spec = LLM("tiny", speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                           "disable_by_batch_size": 8, "adaptive": adaptive},
               **options)
    try:
        vocab = spec.engine.limits.vocab_size
        runner = spec.engine.executor.runner
        for wrong in (False, True):
            spec.engine.speculator.proposer = Recorded(answers, vocab, wrong)
            got = [o.token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
            assert got == expected, f"wrong drafter: {wrong}"
        assert runner.num_verify_replays > 0, "no verification step replayed a graph"
        counters = spec.engine.speculator.counters
        assert counters.num_accepted_tokens > 0 and counters.num_draft_tokens > counters.num_accepted_tokens
    finally:
        spec.shutdown()


@pytest.mark.parametrize("drafter", ["self", "other"])
def test_a_draft_model_on_the_gpu_keeps_the_tokens(drafter, tmp_path):
    from nvray.models.tiny import build_checkpoint

    prompts = random_prompts(6, 10, 40, seed=14)
    params = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=1.0, seed=i, max_tokens=32, ignore_eos=True)
              for i in range(6)]
    options = {"runtime": "inprocess", "dtype": "float32", "max_model_len": 256, **SMALL}
    plain = LLM("tiny", **options)
    try:
        expected = plain.generate(prompts, params, use_tqdm=False)
    finally:
        plain.shutdown()
    model = "tiny" if drafter == "self" else build_checkpoint(str(tmp_path / "drafter"), seed=5)
    spec = LLM("tiny", speculative_config={"method": "draft_model", "model": model,
                                           "num_speculative_tokens": 4,
                                           "disable_by_batch_size": 8, "adaptive": False},
               **options)
    try:
        got = spec.generate(prompts, params, use_tqdm=False)
        runner = spec.engine.executor.runner
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
        assert runner.num_verify_replays > 0 and runner.drafter.num_graph_replays > 0
        greedy = got[1::2]
        drafted = sum(o.num_draft_tokens for o in greedy)
        accepted = sum(o.num_accepted_draft_tokens for o in greedy)
        if drafter == "self":  # its drafts are the target's own greedy tokens
            assert drafted > 50 and accepted >= 0.9 * drafted, (accepted, drafted)
        else:
            assert drafted > 50 and accepted < drafted // 4, (accepted, drafted)
    finally:
        spec.shutdown()


@pytest.mark.parametrize("echo", [False, True])
def test_eagle3_on_the_gpu_keeps_the_tokens(echo, tmp_path):
    """An EAGLE-3 drafter with CUDA graphs on both sides (the target stores its features inside
    its graphs), a JSON-schema request and a penalized one drafting among the others (rank 0
    reads the drafts back for their masks and penalties): random, never right, the plain engine's tokens; echoed with its echoed target
    (``nvray.bench.speculative``: the feature is the token's embedding, which the drafter
    passes to its head), every greedy draft accepted — which holds only if each graph stored
    the features at the right slots."""
    from eagle3_oracle import write_eagle3_checkpoint
    from nvray.bench.speculative import echo_eagle3, echo_weights
    from nvray.models.tiny import resolve_model

    prompts = random_prompts(6, 10, 40, seed=15)
    params = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=1.0, seed=i, max_tokens=32, ignore_eos=True)
              for i in range(6)]
    params[2] = SamplingParams(temperature=0.0, max_tokens=32, structured_outputs={
        "json": {"type": "object", "properties": {"n": {"type": "integer"}}}})  # drafts masked
    params[4] = SamplingParams(temperature=1.0, seed=4, max_tokens=32, ignore_eos=True,
                               presence_penalty=0.5, frequency_penalty=0.2)  # drafts penalized
    options = {"runtime": "inprocess", "dtype": "float32", "max_model_len": 256, **SMALL}
    drafter = write_eagle3_checkpoint(str(tmp_path / "eagle"), resolve_model("tiny"), seed=5,
                                      aux_ids=[0, 1, 1])
    plain = LLM("tiny", **options)
    try:
        if echo:
            echo_weights(plain)
        expected = plain.generate(prompts, params, use_tqdm=False)
    finally:
        plain.shutdown()
    spec = LLM("tiny", speculative_config={"method": "eagle3", "model": drafter,
                                           "num_speculative_tokens": 4,
                                           "disable_by_batch_size": 8, "adaptive": False},
               **options)
    try:
        runner = spec.engine.executor.runner
        if echo:
            echo_weights(spec)
            echo_eagle3(runner.drafter.model, runner.model)
        got = spec.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
        assert runner.num_verify_replays > 0 and runner.drafter.num_graph_replays > 0
        greedy = got[1::2]
        drafted = sum(o.num_draft_tokens for o in greedy)
        accepted = sum(o.num_accepted_draft_tokens for o in greedy)
        if echo:
            assert drafted > 50 and accepted == drafted, (accepted, drafted)
        else:
            assert drafted > 50 and accepted < drafted // 4, (accepted, drafted)
    finally:
        spec.shutdown()


def test_eagle3_eager_with_a_small_token_budget(tmp_path):
    """Without graphs and with max_num_batched_tokens below the start-up's warm-up feeds (the
    head's input buffer grows for them): the plain engine's tokens."""
    from eagle3_oracle import write_eagle3_checkpoint
    from nvray.models.tiny import resolve_model

    prompts = random_prompts(3, 10, 40, seed=16)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    options = {"runtime": "inprocess", "dtype": "float32", "max_model_len": 256,
               "enforce_eager": True, "max_num_batched_tokens": 32, **SMALL}
    drafter = write_eagle3_checkpoint(str(tmp_path / "eagle"), resolve_model("tiny"), seed=6,
                                      aux_ids=[0, 1, 1])
    plain = LLM("tiny", **options)
    try:
        expected = [o.token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)]
    finally:
        plain.shutdown()
    spec = LLM("tiny", speculative_config={"method": "eagle3", "model": drafter,
                                           "num_speculative_tokens": 3}, **options)
    try:
        got = spec.generate(prompts, greedy, use_tqdm=False)
    finally:
        spec.shutdown()
    assert [o.token_ids for o in got] == expected
    assert sum(o.num_draft_tokens for o in got) > 0


def _hybrid_plain_run(path: str, seed: int):  # noqa: ANN202
    """Six prompts, greedy and seeded in turn, float32 options, and the tokens of the engine
    without speculation."""
    prompts = random_prompts(6, 10, 90, seed=seed)
    params = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=1.0, seed=i, max_tokens=32, ignore_eos=True)
              for i in range(len(prompts))]
    options = {"runtime": "inprocess", "dtype": "float32", "max_model_len": 256, **SMALL}
    plain = LLM(path, **options)
    try:
        expected = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    finally:
        plain.shutdown()
    return prompts, params, options, expected


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5-moe"])
def test_a_hybrid_speculates_on_the_gpu_with_the_plain_tokens(family, tmp_path):
    """Greedy and seeded requests, a drafter always right then always wrong: the tokens of the
    same engine without speculation (float32, the Triton kernels; verification steps replay
    their graphs, each token's held row a static input)."""
    from hf_checkpoints import HYBRID_SHAPES, write_hf_checkpoint
    from nvray.models.tiny import tiny_model_path

    path = write_hf_checkpoint(str(tmp_path / family), HYBRID_SHAPES[family], tiny_model_path(),
                               seed=5)
    prompts, params, options, expected = _hybrid_plain_run(path, seed=16)
    answers = [list(p) + list(t) for p, t in zip(prompts, expected)]
    spec = LLM(path, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                         "disable_by_batch_size": 8, "adaptive": False},
               **options)
    try:
        vocab = spec.engine.limits.vocab_size
        for wrong in (False, True):
            spec.engine.speculator.proposer = Recorded(answers, vocab, wrong)
            got = [o.token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
            assert got == expected, f"wrong drafter: {wrong}"
        runner = spec.engine.executor.runner
        assert runner.num_verify_replays > 0, "no verification graph ran"
        assert runner.held_commit.num_replays > 0, "no commit graph ran"
        counters = spec.engine.speculator.counters
        assert counters.num_accepted_tokens > 0
        assert counters.num_draft_tokens > counters.num_accepted_tokens
    finally:
        spec.shutdown()


@pytest.mark.parametrize("family,echo", [("qwen3_5", False), ("qwen3_5", True),
                                         ("qwen3_5-moe", False)])
def test_qwen3_5s_mtp_head_on_the_gpu_keeps_the_tokens(family, echo, tmp_path):
    """Qwen3.5's MTP head from the target's checkpoint, random then an echo head for an echo
    target, and a random head of Qwen3.5-MoE (its experts through the fused MoE kernel):
    greedy and seeded tokens of the engine without speculation (float32, CUDA graphs for the
    head's feeds and passes, the target storing its final states inside its graphs); echoed,
    every greedy draft accepted."""
    from hf_checkpoints import HYBRID_SHAPES, write_hf_checkpoint
    from mtp_oracle import write_mtp_checkpoint
    from nvray.models.tiny import tiny_model_path

    target = write_hf_checkpoint(str(tmp_path / "target"), HYBRID_SHAPES[family],
                                 tiny_model_path(), seed=5)
    path = write_mtp_checkpoint(str(tmp_path / "mtp"), target, seed=3, echo=echo)
    prompts, params, options, expected = _hybrid_plain_run(path, seed=17)
    spec = LLM(path, speculative_config={"method": "mtp", "num_speculative_tokens": 3,
                                         "adaptive": False}, **options)
    try:
        outs = spec.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outs] == expected
        greedy = outs[1::2]
        drafted = sum(o.num_draft_tokens for o in greedy)
        accepted = sum(o.num_accepted_draft_tokens for o in greedy)
        assert drafted > 0 and (accepted == drafted if echo else accepted < drafted)
        runner = spec.engine.executor.runner
        assert runner.num_verify_replays > 0 and runner.drafter.num_graph_replays > 0
    finally:
        spec.shutdown()
