"""The Ray runtime: TP=2 over gloo against TP=1 and HF, streaming through the driver, abort,
calls from several Ray tasks, a rank killed or its forward raising mid-generation, and a clean
shutdown."""

from __future__ import annotations

import time
from typing import Any, Callable

import pytest

from nvray import LLM, EngineConfig, SamplingParams
from nvray.bench.proc_cpu import cores_in_use
from nvray.runtime import EngineDeadError, start_engine
from nvray.runtime.rank_worker import node_gpu_lists
from expert_load_check import check_expert_load
from oracle import hf_greedy, random_prompts
from ray_state import live_actors, live_placement_groups

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
NVRAY_CLASSES = ("EngineDriver", "RankWorker")


def in_process(path: str, call: Callable[[LLM], Any]) -> Any:
    """``call`` on a TP=1 in-process engine of ``path`` (shut down after)."""
    llm = LLM(path, runtime="inprocess", max_model_len=512)
    try:
        return call(llm)
    finally:
        llm.shutdown()


def live_nvray_actors() -> set[str]:
    return set(live_actors(NVRAY_CLASSES))


@pytest.fixture(scope="module")
def tp2(ray_cluster, tiny_path):
    start = time.perf_counter()
    llm = LLM("tiny", tensor_parallel_size=2, max_model_len=512)
    llm.measured_start_s = time.perf_counter() - start
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("dispatch", ["compiled", "actor_calls"])
def test_tp2_matches_tp1_and_hf_on_a_model_with_uneven_heads(ray_cluster, uneven_qwen3_path, dispatch):
    prompts = random_prompts(4, 3, 70, seed=31, vocab=490)
    tp2 = LLM(uneven_qwen3_path, tensor_parallel_size=2, ray_dispatch=dispatch)
    try:
        outs2 = tp2.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        tp2.shutdown()
    outs1 = LLM(uneven_qwen3_path, runtime="inprocess").generate(prompts, GREEDY, use_tqdm=False)
    for prompt, a, b in zip(prompts, outs1, outs2):
        assert b.token_ids == a.token_ids == hf_greedy(uneven_qwen3_path, prompt, 10)


@pytest.mark.parametrize("family,expert_parallel", [
    ("qwen3-moe-mixed", False), ("qwen3-moe-mixed", True), ("gemma3", False), ("llama3", False)])
def test_tp2_matches_hf_for_each_model_family(ray_cluster, family_path, family, expert_parallel):
    """Experts sharded along their width (a dense layer among them), or whole experts per rank
    (expert parallelism), Gemma's windowed and global layers, Llama's rope scaling: TP=2 over
    gloo gives HF's greedy tokens, prefix hits and prefill chunks included."""
    path = family_path(family)
    prompts = random_prompts(3, 20, 60, seed=33)
    llm = LLM(path, tensor_parallel_size=2, max_model_len=256, max_num_batched_tokens=32,
              enable_expert_parallel=expert_parallel)
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        again = llm.generate([prompts[0]], GREEDY, use_tqdm=False)
        stats = llm.stats()
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts + prompts[:1], outs + again):
        assert out.token_ids == hf_greedy(path, prompt, 10)
    assert again[0].num_cached_tokens >= 16
    assert stats["parallelism"] == {"tensor_parallel_size": 2, "pipeline_parallel_size": 1,
                                    "expert_parallel": expert_parallel,
                                    "all_reduce": "gloo"}
    if expert_parallel:
        check_expert_load(stats, path, num_requests=len(prompts) + 1)



def test_tp2_speculation_gives_tp1s_tokens(ray_cluster, tiny_path):
    """n-gram speculation on Ray ranks at TP=2: greedy equal to HF, seeded sampling equal to
    an in-process engine without speculation, drafts accepted and counted in stats()."""
    prompts = random_prompts(3, 6, 12, seed=35)
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)  # it repeats itself
    # a low temperature: the sampled text repeats itself as the greedy one does, drafts hold
    seeded = SamplingParams(temperature=0.3, top_p=0.9, seed=11, max_tokens=32, ignore_eos=True)
    llm = LLM("tiny", tensor_parallel_size=2, max_model_len=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_min": 1, "disable_by_batch_size": 8})
    try:
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        greedy_accepted = llm.stats()["speculative"]["num_accepted_tokens"]
        sampled = llm.generate(prompts, seeded, use_tqdm=False)
        spec = llm.stats()["speculative"]
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(tiny_path, prompt, 32)
    plain = in_process(tiny_path, lambda one: one.generate(prompts, seeded, use_tqdm=False))
    assert [o.token_ids for o in sampled] == [o.token_ids for o in plain]
    assert greedy_accepted > 0 and spec["method"] == "ngram"
    assert spec["num_accepted_tokens"] > greedy_accepted  # seeded drafts accepted too


def test_tp2_draft_model_shards_the_drafter_and_gives_hfs_tokens(ray_cluster, tiny_path):
    """A draft model on Ray ranks at TP=2 (the tiny model drafting for itself, sharded as the
    target is; rank 0 picks the drafts, both ranks feed them): greedy equal to HF, and the
    drafts, which are the target's own greedy tokens, accepted."""
    prompts = random_prompts(3, 6, 12, seed=36)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM("tiny", tensor_parallel_size=2, max_model_len=128,
              speculative_config={"method": "draft_model", "model": "tiny",
                                  "num_speculative_tokens": 3, "adaptive": False})
    try:
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        spec = llm.stats()["speculative"]
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(tiny_path, prompt, 24)
    assert spec["method"] == "draft_model" and spec["num_draft_tokens"] > 30
    assert spec["num_accepted_tokens"] == spec["num_draft_tokens"], spec


def test_tp2_eagle3_shards_the_drafter_and_drafts_as_one_rank_does(ray_cluster, tmp_path,
                                                                   tiny_path):
    """An EAGLE-3 drafter on Ray ranks at TP=2 (its heads and MLP sharded, ``fc`` whole on each
    rank, each rank storing the target's features it computed): HF's tokens, and each
    request's drafts proposed and accepted as a one-rank engine's (whose drafts are the
    reference drafter's: tests/engine/test_speculative.py)."""
    from eagle3_oracle import write_eagle3_checkpoint, write_echo_target

    target = write_echo_target(str(tmp_path / "target"), tiny_path)
    drafter = write_eagle3_checkpoint(str(tmp_path / "eagle"), target, seed=3, aux_ids=[1, 0, 1],
                                      echo=1.0)
    prompts = random_prompts(3, 20, 40, seed=37)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    spec = {"method": "eagle3", "model": drafter, "num_speculative_tokens": 3, "adaptive": False}
    counts = []
    for options in ({"tensor_parallel_size": 2}, {"runtime": "inprocess"}):
        llm = LLM(target, max_model_len=128, speculative_config=spec, **options)
        try:
            outs = llm.generate(prompts, greedy, use_tqdm=False)
        finally:
            llm.shutdown()
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == hf_greedy(target, prompt, 24)
        counts.append([(o.num_draft_tokens, o.num_accepted_draft_tokens) for o in outs])
    assert counts[0] == counts[1]
    assert 0 < sum(a for _, a in counts[0]) < sum(d for d, _ in counts[0]), counts


def test_tp2_mtp_shards_the_head_and_drafts_as_one_rank_does(ray_cluster, tmp_path,
                                                            family_path):
    """Qwen3.5's MTP head on Ray ranks at TP=2 (its attention heads and MLP sharded as the
    target's, ``fc`` whole on each rank, the target's LM head vocab-parallel), an echo target
    and a head passing the stored states on, with noise: HF's tokens, drafts accepted in part
    (each rank stores the target's final states and applies held chunks in part to its share
    of the linear-attention state), and each request's counts a one-rank engine's."""
    from mtp_oracle import write_mtp_checkpoint

    path = write_mtp_checkpoint(str(tmp_path / "mtp"), family_path("qwen3_5"), seed=3, echo=True,
                                noise=0.1)
    prompts = random_prompts(3, 20, 40, seed=37)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    spec = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False}
    counts = []
    for options in ({"tensor_parallel_size": 2}, {"runtime": "inprocess"}):
        llm = LLM(path, max_model_len=128, speculative_config=spec, **options)
        try:
            outs = llm.generate(prompts, greedy, use_tqdm=False)
        finally:
            llm.shutdown()
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == hf_greedy(path, prompt, 16)
        counts.append([(o.num_draft_tokens, o.num_accepted_draft_tokens) for o in outs])
    assert counts[0] == counts[1]
    assert 0 < sum(a for _, a in counts[0]) < sum(d for d, _ in counts[0]), counts


def test_tp2_shards_the_heads_of_a_hybrid_model(ray_cluster, family_path):
    """Qwen3.5-MoE at TP=2: each rank holds half the linear-attention key and value heads (and
    their state), half the gated attention heads, half of each expert and of the shared
    expert; HF's greedy tokens through chunks that cut the linear attention's chunks, and a
    prefix hit that resumes from the state each rank kept of its heads. With n-gram
    speculation: each rank holds the verified chunks' rows of its heads and applies the kept
    ones (tests/engine/test_speculative.py checks the tokens with drafts accepted and not)."""
    path = family_path("qwen3_5-moe")
    prompts = random_prompts(3, 20, 90, seed=34)
    llm = LLM(path, tensor_parallel_size=2, max_model_len=256, max_num_batched_tokens=40,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_min": 1, "adaptive": False})
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        again = llm.generate([prompts[0]], GREEDY, use_tqdm=False)
        spec = llm.stats()["speculative"]
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts + prompts[:1], outs + again):
        assert out.token_ids == hf_greedy(path, prompt, 10)
    assert again[0].num_cached_tokens == (len(prompts[0]) - 1) // 16 * 16 > 0
    assert spec["num_draft_tokens"] > 0, spec


def test_each_gpu_rank_sees_the_gpus_of_its_nodes_engine_ranks():
    """What a rank makes visible before CUDA starts (so a node's ranks can map each other's
    memory): its node's engine GPUs in rank order, never another node's or another engine's."""
    placements = [("node-a", ["3"]), ("node-b", ["0"]), ("node-a", ["1"]), ("node-b", ["2"])]
    assert node_gpu_lists(placements) == [["3", "1"], ["0", "2"], ["3", "1"], ["0", "2"]]
    assert node_gpu_lists([("node-a", []), ("node-a", [])]) == [None, None]


def test_tp2_on_the_tiny_model_matches_hf_with_prefix_hits_and_chunks(tp2, tiny_path):
    prompts = random_prompts(5, 20, 150, seed=32)
    again = [prompts[0], prompts[1][:40] + [7, 8, 9]]  # repeated / shared prefixes, cached by now
    hits_before = tp2.stats()["prefix_cache_hit_tokens"]
    outs = tp2.generate(prompts, GREEDY, use_tqdm=False) + tp2.generate(again, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts + again, outs):
        assert out.token_ids == hf_greedy(tiny_path, prompt, 10)
    assert outs[-2].num_cached_tokens > 0 and outs[-1].num_cached_tokens >= 32
    assert tp2.stats()["prefix_cache_hit_tokens"] > hits_before


def test_overlap_on_and_off_agree_through_ray_at_tp1_and_tp2(ray_cluster, tp2, tiny_path):
    """The tp2 fixture overlaps steps (the default); engines without overlap, and at TP=1, must
    give the same outputs: greedy, seeded sampling, stop strings and min_tokens, with chunked
    prefills (a 64-token budget) and prefix hits."""
    prompts = random_prompts(6, 20, 150, seed=45)
    prompts.append(prompts[0][:40] + [9, 9])  # a cached prefix
    base = tp2.generate(prompts[0], GREEDY, use_tqdm=False)[0]
    params = [GREEDY,
              SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=5, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, stop=[base.text[6:9]]),
              SamplingParams(temperature=0.0, max_tokens=12, min_tokens=4, ignore_eos=True),
              GREEDY, GREEDY, GREEDY]
    on = tp2.generate(prompts, params, use_tqdm=False)
    for options in ({"tensor_parallel_size": 2, "overlap_scheduling": False},
                    {"tensor_parallel_size": 1}):
        other = LLM("tiny", max_model_len=512, max_num_batched_tokens=64, **options)
        try:
            outs = other.generate(prompts, params, use_tqdm=False)
        finally:
            other.shutdown()
        for a, b in zip(on, outs):
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
    assert on[0].token_ids == hf_greedy(tiny_path, prompts[0], 10)


def test_streaming_deltas_concatenate_to_the_final_text(tp2):
    params = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}
    chunks = list(tp2.client.stream("Stream me, please.", params))
    final = chunks[-1]
    assert final.finished and final.finish_reason == "length"
    assert len(chunks) >= 2 and not any(c.finished for c in chunks[:-1])
    assert "".join(c.delta_text for c in chunks) == final.text
    assert sum((c.delta_token_ids for c in chunks), []) == final.token_ids
    assert final.text == tp2.client.generate("Stream me, please.", params).text


def test_chat_messages_as_prompt(tp2, tiny_path):
    messages = [{"role": "user", "content": "Hi there"}]
    out = tp2.client.generate(messages, {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True})
    assert out.token_ids == tp2.chat(messages, GREEDY.__class__(temperature=0.0, max_tokens=4,
                                                                 ignore_eos=True), use_tqdm=False)[0].token_ids
    with pytest.raises(ValueError, match="messages\\[0\\]"):
        tp2.client.generate([{"role": "user"}], None)


def test_abort_frees_the_requests_blocks(tp2):
    from nvray.request import EngineRequest

    client = tp2.client
    sink = client.submit([EngineRequest("abort me " * 10, {"max_tokens": 400, "ignore_eos": True},
                                  "to-abort")], stream=True)
    assert sink.next_batch(timeout=60)  # it is running
    assert client.stats()["kv_cache_usage"] > 0
    client.abort("to-abort")
    outputs = [out for _, out in sink.outputs()]
    assert outputs[-1].finish_reason == "abort"
    stats = client.stats()
    assert stats["num_running"] == 0 and stats["kv_cache_usage"] == 0.0


def test_concurrent_requests_from_several_ray_tasks(tp2, ray_cluster):
    ray = ray_cluster
    client = tp2.client

    @ray.remote(num_cpus=0.1)
    def ask(client, i: int) -> list[int]:
        return client.generate(f"task {i} asks", {"temperature": 0.0, "max_tokens": 6,
                                                  "ignore_eos": True}).token_ids

    results = ray.get([ask.remote(client, i) for i in range(6)], timeout=120)
    expected = [o.token_ids for o in tp2.generate([f"task {i} asks" for i in range(6)],
                                                  SamplingParams(temperature=0.0, max_tokens=6,
                                                                 ignore_eos=True), use_tqdm=False)]
    assert results == expected


def test_bad_request_fails_alone(tp2):
    with pytest.raises(ValueError, match="exceeds max_model_len=512"):
        tp2.client.generate("x " * 600, {"max_tokens": 8})
    tp2.client.check_health()
    assert tp2.client.generate("fine", {"max_tokens": 2}).finished


def fail_forward_after(worker, steps: int):  # noqa: ANN001, ANN201 - runs inside the rank actor
    """Make a rank's forward raise from its ``steps``-th next step on (a fault, injected)."""

    def inject(self) -> None:
        real, calls = self.runner.steps.execute_overlapped, iter(range(10**9))

        def faulty(step):  # noqa: ANN001, ANN202
            if next(calls) >= steps:
                raise RuntimeError("injected forward failure")
            return real(step)

        self.runner.steps.execute_overlapped = faulty

    return worker.__ray_call__.remote(inject)


@pytest.mark.parametrize("fault,layout,killed", [
    ("rank killed", "tp2", 1), ("forward raises", "tp2", 1), ("rank killed", "ep2", 1),
    ("rank killed", "pp2", 0)])
def test_a_rank_fault_fails_in_flight_requests_fast_and_shutdown_leaves_nothing(
        ray_cluster, family_path, fault, layout, killed):
    """(``ep2``: an MoE model whose ranks hold half the experts each; ``pp2``: two pipeline
    stages, the first one killed while the last one, which answers, waits for its input.)"""
    from nvray.request import EngineRequest

    ray = ray_cluster
    before_actors, before_pgs = live_nvray_actors(), live_placement_groups()
    expert_parallel = layout == "ep2"
    model, length = (family_path("qwen3-moe-mixed"), 1024) if expert_parallel else ("tiny", 2048)
    sizes = {"pipeline_parallel_size": 2} if layout == "pp2" else {"tensor_parallel_size": 2}
    client = start_engine(EngineConfig(model=model, max_model_len=length,
                                       enable_expert_parallel=expert_parallel, **sizes))
    assert len(live_nvray_actors() - before_actors) == 3  # a driver and two ranks
    long = {"max_tokens": length - 100, "ignore_eos": True}
    sink = client.submit([EngineRequest(f"long request {i}", long) for i in range(3)],
                         all_or_nothing=False)
    time.sleep(1.0)
    worker_handles = ray.get(client.driver.__ray_call__.remote(
        lambda self: self.engine.executor.workers))
    if fault == "rank killed":
        ray.kill(worker_handles[killed])
    else:
        ray.get(fail_forward_after(worker_handles[killed], steps=5), timeout=30)
    start = time.monotonic()
    results = sink.results(timeout=30)
    assert len(results) == 3
    for result in results:
        assert isinstance(result, EngineDeadError) and "rank" in str(result), result
    assert time.monotonic() - start < 30
    with pytest.raises(EngineDeadError):
        client.check_health()
    with pytest.raises(EngineDeadError):
        client.generate("after the failure", {"max_tokens": 2})
    client.shutdown()
    deadline = time.monotonic() + 20
    while (live_nvray_actors() - before_actors or live_placement_groups() - before_pgs) \
            and time.monotonic() < deadline:
        time.sleep(0.5)
    assert live_nvray_actors() - before_actors == set()
    assert live_placement_groups() - before_pgs == set()
    fresh = LLM("tiny", max_model_len=256)  # the cluster still takes a new engine
    try:
        assert fresh.generate("new engine", SamplingParams(max_tokens=3), use_tqdm=False)[0].finished
    finally:
        fresh.shutdown()


def test_many_streams_share_one_message_per_step(tp2):
    """Through Ray: 16 streams of one client arrive as at most one message per engine step."""
    from nvray.request import EngineRequest

    client = tp2.client
    prompts = [f"stream number {i}" for i in range(16)]
    params = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
    router = client.router.router
    steps_before, messages_before = client.stats()["num_steps"], router.num_messages
    sink = client.submit([EngineRequest(p, params) for p in prompts], stream=True)
    streamed: dict[int, list] = {}
    for index, out in sink.outputs():
        streamed.setdefault(index, []).append(out)
    steps = client.stats()["num_steps"] - steps_before
    messages = router.num_messages - messages_before
    assert 1 <= messages <= steps <= 12 + 2
    expected = tp2.generate(prompts, GREEDY.__class__(**params), use_tqdm=False)
    for i, exp in enumerate(expected):
        assert "".join(o.delta_text for o in streamed[i]) == exp.text
        assert [t for o in streamed[i] for t in o.delta_token_ids] == exp.token_ids


def test_a_request_id_in_use_is_refused_and_the_first_request_is_unharmed(tp2):
    from nvray.request import EngineRequest

    client = tp2.client
    params = {"temperature": 0.0, "max_tokens": 30, "ignore_eos": True}
    first = client.submit([EngineRequest("first of two", params, "dup-id")], stream=True)
    with pytest.raises(ValueError, match="already in use"):
        client.submit([EngineRequest("second of two", params, "dup-id")])
    [out] = first.results(timeout=120)
    assert out.token_ids == client.generate("first of two", params).token_ids


def test_logprobs_penalties_and_n_through_ray_at_tp2_equal_in_process(tp2, tiny_path):
    """Everything a step reports beyond ids (log-probabilities of samples and prompts) and what
    the ranks do with the logits (penalties, biases) crosses the Ray hop and the TP=2 ranks
    unchanged; n choices come back per prompt, by index."""
    prompts = random_prompts(2, 10, 60, seed=51)
    params = [SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=8, ignore_eos=True,
                             logprobs=2, presence_penalty=1.0, frequency_penalty=0.5),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=1,
                             repetition_penalty=1.4, logit_bias={17: 3.0})]
    outs = tp2.generate(prompts, params, use_tqdm=False)
    assert [o.index for o in outs] == [0, 1, 2, 0]
    expected = in_process(tiny_path, lambda llm: llm.generate(prompts, params, use_tqdm=False))
    for got, want in zip(outs, expected):
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs or got.prompt_logprobs[1:],
                        want.logprobs or want.prompt_logprobs[1:]):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert a.top_ids == b.top_ids
    both = tp2.client.generate(prompts[0], {"n": 2, "max_tokens": 3, "seed": 1})
    assert [o.index for o in both] == [0, 1]
    streamed = list(tp2.client.stream(prompts[0], {"n": 2, "max_tokens": 5, "seed": 1,
                                                    "ignore_eos": True}))
    finals = sorted((o for o in streamed if o.finished), key=lambda o: o.index)
    assert [o.index for o in finals] == [0, 1]
    for final in finals:
        deltas = [t for o in streamed if o.index == final.index for t in o.delta_token_ids]
        assert deltas == final.token_ids


def test_beam_search_through_ray_at_tp2_equals_in_process(tp2, tiny_path):
    from nvray import BeamSearchParams

    prompts = random_prompts(2, 6, 30, seed=61)
    params = BeamSearchParams(beam_width=3, max_tokens=5)
    got = tp2.beam_search(prompts, params, use_tqdm=False)
    want = in_process(tiny_path, lambda llm: llm.beam_search(prompts, params, use_tqdm=False))
    for a, b in zip(got, want):
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        assert [o.cumulative_logprob for o in a] == pytest.approx(
            [o.cumulative_logprob for o in b], abs=1e-4)


def test_tp2_structured_outputs_follow_the_schema_beside_untouched_greedy_requests(tp2):
    """Through the driver (grammars compiled off its step loop) and rank 0's matchers at TP=2:
    schema outputs validate, greedy requests in the same batch keep their tokens."""
    import json

    import jsonschema

    schema = {"type": "object", "required": ["id", "ok"],
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                             "ok": {"type": "boolean"}}}
    free = random_prompts(2, 5, 20, seed=41)
    alone = [o.token_ids for o in tp2.generate(free, GREEDY, use_tqdm=False)]
    constrained = [SamplingParams(max_tokens=60, seed=i, structured_outputs={"json": schema})
                   for i in range(3)]
    outs = tp2.generate(["a", free[0], "b", free[1], "c"],
                        [constrained[0], GREEDY, constrained[1], GREEDY, constrained[2]],
                        use_tqdm=False)
    assert [outs[1].token_ids, outs[3].token_ids] == alone
    for out in (outs[0], outs[2], outs[4]):
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), schema)
    with pytest.raises(ValueError, match="keyword 'not'"):
        tp2.generate(["x"], SamplingParams(structured_outputs={"json": {"not": {}}}),
                     use_tqdm=False)


def test_an_idle_engine_rests_and_wakes_to_the_same_tokens(tp2, tiny_path):
    """After a second without requests the ranks stop polling for steps (their compiled graph
    is torn down): no rank or driver process keeps a core busy. The requests that wake it run
    at once (actor calls while a new graph compiles) and give the oracle's tokens, and the
    steps go back to a compiled graph."""
    prompt = random_prompts(1, 30, 30, seed=33)[0]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = hf_greedy(tiny_path, prompt, 24)
    assert tp2.generate([prompt], params, use_tqdm=False)[0].token_ids == want
    time.sleep(2.5)  # the engine loop's idle second, then the teardown
    busy = cores_in_use(2.0)  # per driver and rank process (/proc CPU times)
    assert len(busy) >= 3, busy  # this engine's driver and two ranks at least
    assert max(busy.values()) < 0.2, f"cores in use per process while idle: {busy}"
    assert tp2.stats()["step_dispatch"] == "actor_calls"  # the graph is gone
    for _ in range(40):  # woken: actor calls at first, the new graph once it is compiled
        assert tp2.generate([prompt], params, use_tqdm=False)[0].token_ids == want
        if tp2.stats()["step_dispatch"] == "compiled_graph":
            break
    assert tp2.stats()["step_dispatch"] == "compiled_graph"


def test_a_ray_engine_reports_its_start_up_by_phase(tp2):
    startup = tp2.stats()["startup"]
    phases = startup["phases_s"]
    assert {"imports", "ray_init", "placement_group", "driver_actor", "rank_actors",
            "model_and_weights", "kv_cache", "rank_calls", "compiled_graph",
            "tokenizer_wait"} <= set(phases)
    assert startup["beside_s"]["tokenizer"] > 0  # loaded while the ranks started
    assert startup["total_s"] > 0 and startup["other_s"] <= 0.1 * startup["total_s"] + 0.05
    wall = tp2.measured_start_s  # the report covers LLM() from its first line to its return
    assert 0.9 * wall - 0.1 <= startup["total_s"] <= wall + 0.01, (startup, wall)
