"""The offline LLM API as a user sees it: outputs, stop rules, seeds, chat, rejections, aborts.

These run the engine in-process so they can look inside it; tests/runtime runs the same API on
Ray actors."""

from __future__ import annotations

import gc
import weakref

import pytest

from oracle import hf_greedy, random_prompts
from nvray import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", runtime="inprocess", max_model_len=256)


def test_default_model_generates_text_and_token_ids(llm):
    out = llm.generate("Hello, nvray.", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.prompt_token_ids == llm.tokenizer.encode("Hello, nvray.", add_special_tokens=False)
    assert out.usage == {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": 8,
                         "total_tokens": len(out.prompt_token_ids) + 8}


def test_stop_string_is_trimmed_from_the_output(llm):
    base = llm.generate("The engine", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
    stop = base.text[6:9]
    assert stop and stop in base.text
    out = llm.generate("The engine", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                     stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == base.text[:base.text.index(stop)]
    kept = llm.generate("The engine", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                      stop=[stop], include_stop_str_in_output=True))[0]
    assert kept.text == base.text[:base.text.index(stop) + len(stop)]
    assert out.stop_reason == stop and kept.stop_reason == stop  # the stop string that ended it


def test_a_stop_string_the_output_starts_with_leaves_no_text(llm):
    base = llm.generate("The engine", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
    stop = base.text[0]
    out = llm.generate("The engine", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                     stop=[stop]))[0]
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", stop, "")


def _output_texts(llm, prompt: str, num_tokens: int, **params) -> list[str]:
    """The greedy output's text after each of its first k tokens, k = 0 .. num_tokens, as far as
    each is the one before plus whole characters."""
    ids = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=num_tokens,
                                              ignore_eos=True, **params),
                       use_tqdm=False)[0].token_ids
    texts = [""]
    for k in range(1, len(ids) + 1):
        text = llm.tokenizer.decode(ids[:k], skip_special_tokens=True)
        if not text.startswith(texts[-1]) or "\ufffd" in text:
            break
        texts.append(text)
    return texts


def _cut_at_one_character(texts: list[str], min_tokens: int, stop: str) -> str | None:
    """The text a one-character stop string leaves: the first time a token at or after the
    ``min_tokens``-th adds it, cut before it (None: it never comes)."""
    for k in range(min_tokens, len(texts)):
        added = texts[k][len(texts[k - 1]):]
        if stop in added:
            return texts[k - 1] + added[:added.index(stop)]
    return None


def test_a_stop_string_seen_before_min_tokens_stops_only_where_it_comes_again(llm):
    """The text before ``min_tokens`` is not searched again once stops may end it: a stop
    string that occurs there, even ending right before the ``min_tokens``-th token, is passed
    over, and the output ends where it next occurs."""
    texts = _output_texts(llm, "The engine", 48)
    cases = [(m, texts[m - 1][-1], cut) for m in range(2, len(texts))
             if texts[m - 1] and (cut := _cut_at_one_character(texts, m, texts[m - 1][-1]))]
    assert cases, f"no character of this output recurs after min_tokens: {texts[-1]!r}"
    m, stop, cut = cases[0]
    out = llm.generate("The engine", SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True,
                                                     stop=[stop], min_tokens=m), use_tqdm=False)[0]
    assert (out.finish_reason, out.text) == ("stop", cut)
    assert texts[m - 1].endswith(stop) and len(out.text) >= len(texts[m - 1])


def test_a_token_that_adds_the_stop_string_twice_is_cut_at_the_first(llm):
    [engine] = llm.tokenizer.encode(" engine", add_special_tokens=False)  # one token, two n's
    out = llm.generate("The", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                             allowed_token_ids=[engine], stop=["n"]))[0]
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", "n", " e")


def test_stop_token_ids_and_min_tokens(llm):
    prompt = random_prompts(1, 10, 10, seed=21)[0]
    greedy = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    first = greedy.token_ids[0]
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[first]))[0]
    assert out.finish_reason == "stop" and out.token_ids == [first]
    held = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, min_tokens=3,
                                               stop_token_ids=[first]))[0]
    assert first not in held.token_ids[:3]


def _streamed(llm, prompt: str, params: SamplingParams) -> list:
    """The outputs of one streaming request, step by step (bounded: 100 steps)."""
    llm.engine.add_request("streamed", prompt, params, stream=True)
    outs = []
    for _ in range(100):
        outs += [o for o in llm.engine.step() if o.request_id == "streamed"]
        if outs and outs[-1].finished:
            return outs
    raise AssertionError("the streamed request did not finish in 100 steps")


@pytest.mark.parametrize("stop_len", [1, 3])
def test_a_stream_holds_back_what_a_stop_string_could_still_cut_and_ends_whole(llm, stop_len):
    """With stop strings of up to L characters (none of which comes), a streamed text keeps
    its last L - 1 characters back until more text shows they are not a stop string's start;
    the final output sends the rest: the deltas add up to the whole text."""
    words = [llm.tokenizer.encode(w, add_special_tokens=False)[0]
             for w in (" engine", " is", " every", " cache", " prompt", " keep")]
    texts = _output_texts(llm, "The engine", 16, allowed_token_ids=words)  # whole words only
    assert len(texts) == 17
    stop = "\x07" * stop_len  # in no output of the tiny model
    outs = _streamed(llm, "The engine", SamplingParams(temperature=0.0, max_tokens=16,
                                                       ignore_eos=True, stop=[stop],
                                                       allowed_token_ids=words))
    assert "".join(o.delta_text for o in outs) == outs[-1].text == texts[-1]
    assert outs[-1].finish_reason == "length"
    emitted, num_tokens, checked = "", 0, 0
    for out in outs[:-1]:
        emitted += out.delta_text
        num_tokens += len(out.delta_token_ids)
        text = texts[num_tokens]
        assert emitted == text[:max(0, len(text) - (stop_len - 1))], (num_tokens, emitted)
        checked += num_tokens > 0
    assert checked >= 10  # the stream went out token by token


def test_an_output_ending_in_half_a_character_keeps_the_text_transformers_decodes(llm, tiny_path):
    """What the detokenizer holds back for bytes that do not make a whole character comes out
    when the output ends, by max_tokens or by a stop token after them (whose own text is left
    out): the text transformers decodes from the same ids."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_path)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ids = llm.generate("The engine", greedy, use_tqdm=False)[0].token_ids
    k = next((k for k in range(1, len(ids)) if hf.decode(ids[:k]).endswith("\ufffd")
              and ids[k] not in ids[:k]), None)
    assert k is not None, f"no output token ends in half a character here: {ids}"
    by_length = llm.generate("The engine", SamplingParams(temperature=0.0, max_tokens=k,
                                                          ignore_eos=True), use_tqdm=False)[0]
    assert by_length.token_ids == ids[:k] and by_length.finish_reason == "length"
    assert by_length.text == hf.decode(ids[:k], skip_special_tokens=True)
    by_stop = llm.generate("The engine", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                        stop_token_ids=[ids[k]]), use_tqdm=False)[0]
    assert by_stop.token_ids == ids[:k + 1]
    assert (by_stop.finish_reason, by_stop.stop_reason) == ("stop", ids[k])  # the request's own
    assert by_stop.text == hf.decode(ids[:k], skip_special_tokens=True)


def test_an_output_ended_by_eos_has_no_stop_reason(llm):
    eos = llm.tokenizer.eos_token_id
    out = llm.generate("The", SamplingParams(temperature=0.0, max_tokens=4,
                                             allowed_token_ids=[eos]))[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason, out.text) == ([eos], "stop", None, "")


def test_a_stop_string_completed_by_the_min_tokens_th_token_stops_there(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ids = llm.generate("The engine", greedy, use_tqdm=False)[0].token_ids
    texts = [llm.tokenizer.decode(ids[:k], skip_special_tokens=True) for k in range(len(ids) + 1)]
    # the first k >= 3 whose token adds whole characters seen nowhere before: the stop string
    k = next(k for k in range(3, len(ids)) if texts[k + 1].startswith(texts[k])
             and (stop := texts[k + 1][len(texts[k]):]).strip() and "\ufffd" not in stop
             and stop not in texts[k])
    stop, num_tokens = texts[k + 1][len(texts[k]):], k + 1
    out = llm.generate("The engine", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                     stop=[stop], min_tokens=num_tokens),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.token_ids == ids[:num_tokens]
    assert out.text == texts[k]
    later = llm.generate("The engine", SamplingParams(temperature=0.0, max_tokens=24,
                                                       ignore_eos=True, stop=[stop],
                                                       min_tokens=num_tokens + 1),
                         use_tqdm=False)[0]
    assert len(later.token_ids) > num_tokens  # one token short of min_tokens: no stop yet


def test_seeded_sampling_is_reproducible_across_batch_compositions(llm):
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=42, ignore_eos=True)
    alone = llm.generate("seeded prompt", params)[0]
    others = [SamplingParams(temperature=0.8, max_tokens=5), SamplingParams(temperature=0.0, max_tokens=9)]
    mixed = llm.generate(["one other", "seeded prompt", "and a third"],
                         [others[0], params, others[1]])[1]
    assert mixed.token_ids == alone.token_ids
    unseeded = {tuple(llm.generate("seeded prompt", SamplingParams(temperature=1.0, max_tokens=16,
                                                                   ignore_eos=True))[0].token_ids)
                for _ in range(3)}
    assert len(unseeded) > 1  # without a seed, sampling really is random


def test_chat_uses_the_chat_template(llm, tiny_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    out = llm.chat(messages, params)[0]
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    assert out.prompt_token_ids == ids
    assert out.token_ids == hf_greedy(tiny_path, ids, 5)


@pytest.mark.parametrize("prompt,params,match", [
    ("", None, "prompt is empty"),
    ([[]], None, "prompt is empty"),
    ([1, 2, 10**6], None, "outside the vocabulary"),
    ("x " * 300, SamplingParams(max_tokens=16), "exceeds max_model_len=256"),
    ("hi", SamplingParams(max_tokens=300), "exceeds max_model_len=256"),
])
def test_bad_requests_are_rejected_and_the_engine_keeps_working(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, params)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate("still fine", SamplingParams(max_tokens=2))[0].finish_reason in ("length", "stop")


def test_a_huge_prompt_is_refused_from_its_head_without_tokenizing_it_all(llm, monkeypatch):
    """A megabyte of text against max_model_len=256: refused by name, and the tokenizer never
    sees more than the head the refusal needs (it tokenized all of it before: 14.5 s of the
    engine's process for a 10 MB prompt)."""
    tokenizer = llm.engine.intake.tokenizer
    seen: list[int] = []
    encode = tokenizer.encode

    def counting_encode(text, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen.append(len(text))
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", counting_encode)
    prompt = "many words of a prompt far too long " * 30000  # ~1 MB
    with pytest.raises(ValueError, match="prompt is longer than max_model_len=256 tokens: its "
                                         "first 2,048 of 1,080,000 characters alone are"):
        llm.generate(prompt, SamplingParams(max_tokens=4))
    assert seen and max(seen) <= 8 * 256, seen
    monkeypatch.undo()
    assert llm.generate("still fine", SamplingParams(max_tokens=2))[0].token_ids


def test_request_that_can_never_fit_the_kv_cache_is_rejected():
    small = LLM("tiny", runtime="inprocess", num_kvcache_blocks=4, kvcache_block_size=16,
                max_model_len=128)
    with pytest.raises(ValueError, match="needs 5 KV cache blocks but the cache has only 4"):
        small.generate([5] * 60, SamplingParams(max_tokens=14))
    assert small.generate([5] * 30, SamplingParams(max_tokens=4))[0].token_ids


def test_unknown_engine_option_is_rejected():
    with pytest.raises(ValueError, match="unknown engine option.*max_batch"):
        LLM("tiny", runtime="inprocess", max_batch=3)
    with pytest.raises(ValueError, match="scheduling_policy='lifo'"):
        LLM("tiny", runtime="inprocess", scheduling_policy="lifo")
    with pytest.raises(ValueError, match="all_reduce='nvls'"):
        LLM("tiny", runtime="inprocess", all_reduce="nvls")
    with pytest.raises(ValueError, match="not a local checkpoint directory"):
        LLM("/no/such/model", runtime="inprocess")


def test_abort_frees_blocks_and_nothing_leaks(llm):
    engine = llm.engine
    total = engine.block_manager.num_blocks
    engine.add_request("keep", "a prompt to finish", SamplingParams(max_tokens=5, ignore_eos=True))
    engine.add_request("drop", "a prompt to abort " * 5, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.block_manager.num_free_blocks < total
    [aborted] = engine.abort_request("drop")
    assert aborted.finished and aborted.finish_reason == "abort"
    for _ in range(20):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == total
    assert engine.abort_request("drop") == []  # unknown ids are ignored


def test_a_step_that_fails_midway_ends_the_calls_requests_and_the_engine_runs_on(llm, tiny_path):
    """A fault injected into the forward after a few steps (the executor raises instead of
    running the model): generate raises it, every request of the call is ended, no KV block is
    held, no step stays in flight, and the next call gives the oracle's tokens."""
    engine = llm.engine
    executor = engine.executor
    prompts = random_prompts(3, 10, 60, seed=23)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    steps = iter(range(1000))

    def faulty_forward(step):
        if next(steps) == 6:
            raise RuntimeError("injected forward failure")
        return type(executor).execute_overlapped(executor, step)

    executor.execute_overlapped = faulty_forward
    try:
        with pytest.raises(RuntimeError, match="injected forward failure"):
            llm.generate(prompts, params)
    finally:
        del executor.execute_overlapped
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.stats()["num_finished"]["error"] >= 3
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [hf_greedy(tiny_path, p, 12) for p in prompts]


def test_startup_objects_leave_the_cyclic_gc_until_shutdown():
    """An engine freezes what start-up built out of full GC passes (they paused steps for
    0.37 s on a GPU host) and gives it back when it shuts down, so a process that starts and
    stops engines does not keep their reference cycles."""
    gc.collect()
    gc.unfreeze()
    engine = LLM("tiny", runtime="inprocess", max_model_len=128)
    try:
        assert gc.get_freeze_count() > 1000
        out = engine.generate([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        assert len(out[0].token_ids) == 4
    finally:
        engine.shutdown()
    assert gc.get_freeze_count() == 0


def test_shutdown_frees_the_weights_without_the_caller_collecting():
    """``LLM.shutdown()`` in-process gives the model's memory back by itself: its modules hold
    reference cycles that start-up froze, which must not outlive the engine until some later
    full collection (on a GPU the weights of an 8B model stayed in use after shutdown)."""
    engine = LLM("tiny", runtime="inprocess", max_model_len=128)
    try:
        out = engine.generate([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        assert len(out[0].token_ids) == 4
        weights = [weakref.ref(p) for p in engine.engine.executor.runner.model.parameters()]
    finally:
        engine.shutdown()
    assert weights and [w for w in weights if w() is not None] == []


def test_start_up_is_reported_by_phase_and_the_phases_make_up_the_start(tiny_path):
    import time

    start = time.perf_counter()
    llm = LLM("tiny", runtime="inprocess", max_model_len=256)
    wall = time.perf_counter() - start
    try:
        startup = llm.engine.stats()["startup"]
    finally:
        llm.shutdown()
    phases = startup["phases_s"]
    assert {"imports", "tokenizer_wait", "model_and_weights", "kv_cache", "engine"} <= set(phases)
    assert startup["beside_s"]["tokenizer"] > 0  # loaded while the model was built
    assert all(seconds >= 0 for seconds in phases.values())
    assert startup["total_s"] <= wall + 1e-3  # timed inside LLM()
    assert startup["total_s"] >= 0.8 * wall - 0.05  # ... and nearly all of it
    assert abs(sum(phases.values()) + startup["other_s"] - startup["total_s"]) < 0.01
    assert startup["other_s"] <= 0.1 * startup["total_s"] + 0.02  # the phases cover the start


def test_an_output_carries_the_prompt_it_was_given(llm):
    text = llm.generate("The engine", SamplingParams(max_tokens=2), use_tqdm=False)[0]
    ids = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert (text.prompt, ids.prompt) == ("The engine", None)
    assert ids.prompt_token_ids == [5, 6, 7]
