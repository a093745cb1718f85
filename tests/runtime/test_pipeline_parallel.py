"""Pipeline parallelism through the Ray runtime over gloo: PP=2 (and PP=2 x TP=2) engines give
HF's greedy tokens and the in-process engine's sampled ones, with prefix hits, prefill chunks,
preemption, structured outputs, n > 1, log-probabilities and beam search, through compiled
graphs and plain actor calls; the stage split and loading are checked against the checkpoint.
"""

from __future__ import annotations

import json
import time

import pytest

from nvray import LLM, BeamSearchParams, SamplingParams
from nvray.layers.pp import stage_layers
from oracle import hf_greedy, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def pp2(ray_cluster, tiny_path):
    llm = LLM("tiny", pipeline_parallel_size=2, max_model_len=512, max_num_batched_tokens=64)
    yield llm
    llm.shutdown()


def in_process(call, **options):
    llm = LLM("tiny", runtime="inprocess", max_model_len=512, max_num_batched_tokens=64,
              **options)
    try:
        return call(llm)
    finally:
        llm.shutdown()


def test_stages_split_the_layers_in_order_without_gaps():
    assert [list(stage_layers(36, s, 2)) for s in range(2)] == [list(range(18)),
                                                                 list(range(18, 36))]
    assert [len(stage_layers(10, s, 4)) for s in range(4)] == [3, 3, 2, 2]
    assert [stage_layers(5, s, 5).start for s in range(5)] == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 exceeds the model's 2 layers"):
        stage_layers(2, 0, 3)


def test_pp2_matches_hf_with_prefix_hits_chunks_and_a_parallelism_card(pp2, tiny_path):
    prompts = random_prompts(6, 20, 150, seed=71)
    again = [prompts[0], prompts[1][:40] + [7, 8, 9]]  # repeated / shared prefixes
    outs = pp2.generate(prompts, GREEDY, use_tqdm=False) + pp2.generate(again, GREEDY,
                                                                         use_tqdm=False)
    for prompt, out in zip(prompts + again, outs):
        assert out.token_ids == hf_greedy(tiny_path, prompt, 10)
    assert outs[-2].num_cached_tokens > 0 and outs[-1].num_cached_tokens >= 32
    stats = pp2.stats()
    assert stats["parallelism"] == {"tensor_parallel_size": 1, "pipeline_parallel_size": 2,
                                    "expert_parallel": False, "all_reduce": "none"}


def test_pp2_sampling_logprobs_penalties_n_and_stops_equal_in_process(pp2):
    """What the last stage does with the logits (seeded sampling, penalties, biases, prompt and
    sample log-probabilities, n choices, stop strings) gives the in-process engine's outputs,
    with steps of disjoint sequences in flight on the two stages."""
    prompts = random_prompts(4, 10, 60, seed=72)
    base = pp2.generate(prompts[3], GREEDY, use_tqdm=False)[0]
    params = [SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=8, ignore_eos=True,
                             logprobs=2, presence_penalty=1.0, frequency_penalty=0.5),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=1,
                             repetition_penalty=1.4, logit_bias={17: 3.0}),
              SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=12, min_tokens=4,
                             ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, stop=[base.text[6:9]])]
    got = pp2.generate(prompts, params, use_tqdm=False)
    want = in_process(lambda llm: llm.generate(prompts, params, use_tqdm=False))
    assert [o.index for o in got] == [0, 1, 2, 0, 0, 0]
    for a, b in zip(got, want):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        assert (a.logprobs is None) == (b.logprobs is None)
        rows = zip(a.logprobs or (a.prompt_logprobs or [None])[1:],
                   b.logprobs or (b.prompt_logprobs or [None])[1:])
        for x, y in rows:
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4) and x.top_ids == y.top_ids


def test_pp2_structured_outputs_and_beam_search(pp2):
    import jsonschema

    schema = {"type": "object", "required": ["id", "ok"],
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                             "ok": {"type": "boolean"}}}
    free = random_prompts(2, 5, 20, seed=73)
    alone = [o.token_ids for o in pp2.generate(free, GREEDY, use_tqdm=False)]
    constrained = [SamplingParams(max_tokens=60, seed=i, structured_outputs={"json": schema})
                   for i in range(3)]
    outs = pp2.generate(["a", free[0], "b", free[1], "c"],
                        [constrained[0], GREEDY, constrained[1], GREEDY, constrained[2]],
                        use_tqdm=False)
    assert [outs[1].token_ids, outs[3].token_ids] == alone
    for out in (outs[0], outs[2], outs[4]):
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), schema)
    beams = BeamSearchParams(beam_width=3, max_tokens=5)
    got = pp2.beam_search(free, beams, use_tqdm=False)
    want = in_process(lambda llm: llm.beam_search(free, beams, use_tqdm=False))
    for a, b in zip(got, want):
        assert [o.token_ids for o in a] == [o.token_ids for o in b]


@pytest.mark.parametrize("dispatch", ["compiled", "actor_calls"])
def test_pp2_under_preemption_matches_hf(ray_cluster, tiny_path, dispatch):
    """A cache too small for the batch: sequences are preempted (some while a step of theirs
    is in flight on the other stage) and recomputed; tokens stay HF's."""
    prompts = random_prompts(8, 40, 90, seed=74)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM("tiny", pipeline_parallel_size=2, max_model_len=256, kvcache_block_size=8,
              num_kvcache_blocks=40, max_num_batched_tokens=64, ray_dispatch=dispatch)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
    finally:
        llm.shutdown()
    assert stats["num_preemptions"] > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(tiny_path, prompt, 24)
    assert (stats["num_running"], stats["num_waiting"]) == (0, 0)


def test_pp2_speculates_under_preemption_with_hfs_tokens(ray_cluster, tiny_path):
    """n-gram speculation over pipeline stages (steps of disjoint sequences in flight on both,
    a sequence preempted while its verified run is in flight is not rolled back): HF's
    greedy tokens, drafts accepted."""
    prompts = random_prompts(6, 20, 60, seed=75)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llm = LLM("tiny", pipeline_parallel_size=2, max_model_len=256, kvcache_block_size=8,
              num_kvcache_blocks=40, max_num_batched_tokens=64,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_min": 1, "disable_by_batch_size": 8,
                                  "adaptive": False})
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(tiny_path, prompt, 32)
    assert stats["speculative"]["num_accepted_tokens"] > 0 and stats["num_preemptions"] > 0


@pytest.mark.parametrize("family", ["qwen3-moe-mixed", "gemma3", "llama3", "qwen3_5"])
def test_pp2_matches_hf_for_each_model_family(ray_cluster, family_path, family):
    """Each family's layers split over two stages (the MoE's dense layer, Gemma's windowed and
    global layers and scaled embeddings, Llama's untied LM head on the last stage only,
    Qwen3.5's linear-attention layers and their state slots on both stages)."""
    path = family_path(family)
    prompts = random_prompts(3, 20, 60, seed=75)
    llm = LLM(path, pipeline_parallel_size=2, max_model_len=256, max_num_batched_tokens=32)
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(path, prompt, 10)


def test_pp2_tp2_matches_hf(ray_cluster, family_path):
    """Four ranks: two stages of two tensor-parallel ranks each (collectives stay inside a
    stage, activations go rank to rank)."""
    path = family_path("llama3")
    prompts = random_prompts(3, 20, 60, seed=76)
    llm = LLM(path, pipeline_parallel_size=2, tensor_parallel_size=2, max_model_len=256,
              max_num_batched_tokens=32, num_cpus_per_rank=0.5)
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        parallelism = llm.stats()["parallelism"]
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(path, prompt, 10)
    assert (parallelism["tensor_parallel_size"], parallelism["pipeline_parallel_size"]) == (2, 2)


def test_more_stages_than_layers_is_refused_by_name(ray_cluster):
    with pytest.raises(Exception, match="pipeline_parallel_size=3 exceeds the model's 2 layers"):
        LLM("tiny", pipeline_parallel_size=3, max_model_len=128)


def test_a_stage_of_linear_attention_layers_only_is_refused_by_name(ray_cluster, family_path):
    """Qwen3.5's layers 0..2 are linear, full, linear: a second stage would hold layer 2 only."""
    with pytest.raises(Exception, match=r"pipeline stage 1 holds no attention layer \(layers 2..2"):
        LLM(family_path("qwen3_5-tied"), pipeline_parallel_size=2, max_model_len=128)


def test_an_idle_pp2_engine_rests_and_wakes_to_the_same_tokens(pp2, tiny_path):
    """After an idle spell the stages' compiled graph is gone; the requests that wake the engine
    run through actor calls (a step at a time) while a new graph compiles, then through it,
    several prompts at once so that both stages hold a step, with HF's tokens throughout."""
    prompts = random_prompts(4, 20, 40, seed=77)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [hf_greedy(tiny_path, p, 16) for p in prompts]
    assert [o.token_ids for o in pp2.generate(prompts, params, use_tqdm=False)] == want
    time.sleep(2.5)  # the engine loop's idle second, then the teardown
    assert pp2.stats()["step_dispatch"] == "actor_calls"
    for _ in range(40):  # woken: actor calls at first, the new graph once it is compiled
        assert [o.token_ids for o in pp2.generate(prompts, params, use_tqdm=False)] == want
        if pp2.stats()["step_dispatch"] == "compiled_graph":
            break
    assert pp2.stats()["step_dispatch"] == "compiled_graph"
