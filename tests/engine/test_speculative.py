"""Speculative decoding (n-gram) against decoding a token a step: the same tokens, text and
finish reasons, greedy and seeded, through chunked prefills, prefix hits, preemption, stop
rules, ``max_tokens`` cutting inside an accepted run, streams, late arrivals and aborts; the
same distribution unseeded; nothing left held afterwards.

Random weights rarely repeat themselves, so besides the real n-gram proposer the engines run
with two stand-ins that make every path happen: one that proposes what the plain engine went
on to generate (every draft accepted: long runs, stops inside them) and one that is always
wrong (every draft rejected: the KV of rejected tokens dropped each step)."""

from __future__ import annotations

import collections
import dataclasses
import json

import pytest
import torch

from nvray import LLM, SamplingParams
from nvray.models.tiny import SPECIAL_TOKENS, resolve_model
from nvray.speculative import NgramProposer, SpeculativeConfig, accepted_run
from nvray.speculative_methods import SPECULATIVE_METHODS, SpeculativeMethod, register
from drafters import Recorded
from oracle import hf_greedy, random_prompts
from stepping import assert_clean, mixed_workload, run_steps, with_stop_rules

K = 3


def _engine(speculative: bool, **kwargs):  # noqa: ANN202
    options = {"max_model_len": 256, "max_num_batched_tokens": 64, "num_kvcache_blocks": 24,
               "kvcache_block_size": 16, "overlap_scheduling": False, **kwargs}
    if speculative:  # k drafts every step (adaptive drafting would pause a failing drafter)
        options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": K,
                                         "prompt_lookup_min": 1, "disable_by_batch_size": 64,
                                         "adaptive": False}
    return LLM("tiny", runtime="inprocess", **options).engine


@pytest.fixture(scope="module")
def engines():  # noqa: ANN201
    return _engine(True), _engine(False)


def _workload(engine):  # noqa: ANN001, ANN202
    arrivals, aborts = mixed_workload(engine.tokenizer)
    return arrivals, aborts


def _assert_same_answers(spec: dict, plain: dict) -> None:
    assert spec.keys() == plain.keys()
    for request_id in spec:
        a, b = spec[request_id][-1], plain[request_id][-1]
        assert a.finished and b.finished
        if request_id.startswith("abort"):  # aborted at a step: a beginning of the answer
            full = plain["g2" if request_id == "abort_early" else "g3"][-1].token_ids
            assert full[:len(a.token_ids)] == a.token_ids  # (fewer steps: it may have ended)
            assert a.finish_reason in ("abort", "length") and b.finish_reason == "abort"
            continue
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason), \
            request_id
        streamed = [t for o in spec[request_id] for t in o.delta_token_ids]  # streams add up
        assert streamed == a.token_ids, request_id


def _run_both(spec_engine, plain_engine, proposer=None):  # noqa: ANN001, ANN202
    """The mixed workload with stop rules on both engines; (spec outputs, plain outputs, what
    speculation counted)."""
    arrivals, aborts = _workload(plain_engine)
    probe = run_steps(plain_engine, {0: [arrivals[0][0]]}, {})["g0"][-1]
    arrivals = with_stop_rules(arrivals, probe.token_ids[7], probe.text[10:13])
    plain = run_steps(plain_engine, arrivals, aborts)
    speculator = spec_engine.speculator
    ngram = speculator.proposer
    if proposer is not None:
        speculator.proposer = proposer(plain)
    before = speculator.counters.stats()
    preemptions = spec_engine.scheduler.num_preemptions
    hits = spec_engine.block_manager.num_hit_tokens
    try:
        spec = run_steps(spec_engine, arrivals, aborts, _only_kept_tokens_hashed)
    finally:
        speculator.proposer = ngram
    after = speculator.counters.stats()
    assert spec_engine.scheduler.num_preemptions > preemptions, "the workload must preempt"
    assert spec_engine.block_manager.num_hit_tokens > hits, "the workload must hit the prefix cache"
    assert_clean(spec_engine)
    assert_clean(plain_engine)
    counted = {key: after[key] - before[key] for key in ("num_drafts", "num_draft_tokens",
                                                        "num_accepted_tokens")}
    # each request's final output counts its own drafts: together, what the engine counted
    finals = [outs[-1] for outs in spec.values()]
    assert sum(o.num_draft_tokens for o in finals) == counted["num_draft_tokens"]
    assert sum(o.num_accepted_draft_tokens for o in finals) == counted["num_accepted_tokens"]
    return spec, plain, counted


def _only_kept_tokens_hashed(engine) -> None:  # noqa: ANN001
    """The prefix cache holds no block with a rejected draft's KV: a running sequence's hashed
    blocks end within its computed tokens."""
    bm = engine.block_manager
    for seq in engine.scheduler.running:
        hashed = len(bm.prefix_cache.seq_block_hashes.get(seq.seq_id, ())) * bm.block_size
        assert hashed <= seq.num_computed_tokens, (seq.request_id, hashed,
                                                   seq.num_computed_tokens)


def _answers(outputs: dict) -> list[list[int]]:
    return [list(out[-1].prompt_token_ids) + list(out[-1].token_ids) for out in outputs.values()
            if out[-1].prompt_token_ids]


def test_ngram_speculation_gives_the_tokens_of_plain_decoding(engines):
    spec, plain, counted = _run_both(*engines)
    _assert_same_answers(spec, plain)
    assert counted["num_drafts"] > 0 and counted["num_accepted_tokens"] > 0, counted


def test_drafts_always_accepted_emit_runs_cut_by_stop_rules(engines):
    vocab = engines[0].limits.vocab_size
    spec, plain, counted = _run_both(*engines, lambda plain: Recorded(_answers(plain), vocab))
    _assert_same_answers(spec, plain)
    # nearly every draft accepted (a seeded run's recorded answer is its own): long runs
    assert counted["num_accepted_tokens"] >= 0.9 * counted["num_draft_tokens"] > 0, counted
    assert counted["num_accepted_tokens"] > 2 * counted["num_drafts"], counted


def test_drafts_never_accepted_give_the_same_tokens(engines):
    vocab = engines[0].limits.vocab_size
    spec, plain, counted = _run_both(*engines,
                                     lambda plain: Recorded(_answers(plain), vocab, wrong=True))
    _assert_same_answers(spec, plain)
    assert counted["num_draft_tokens"] > 0 and counted["num_accepted_tokens"] == 0, counted


def test_other_rows_beside_speculating_ones():
    """A constrained request (a token a step), prompt scores, a pooled prompt and n=2 choices
    (forks sharing the prompt's blocks) in the same steps as speculating sequences: their rows
    sit after other sequences' draft rows, on the ranks and in the engine's records. Two
    log-probability requests draft too (each kept token gets its position's), and so does a
    penalized one (a draft position's penalties count the drafts before it). Everything
    equals the plain engine's."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    prompts = random_prompts(9, 10, 30, seed=9)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=40, structured_outputs={"json": schema}),
              greedy, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                     presence_penalty=1.5, frequency_penalty=0.5),
              greedy, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(max_tokens=0, pool=()),
              SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=24, ignore_eos=True)]
    results, answers = [], []
    for speculative in (False, True):
        llm = LLM("tiny", runtime="inprocess", max_model_len=128, overlap_scheduling=False,
                  **({"speculative_config": {"method": "ngram", "num_speculative_tokens": K,
                                            "disable_by_batch_size": 64, "adaptive": False}}
                     if speculative else {}))
        if speculative:
            llm.engine.speculator.proposer = Recorded(answers, llm.engine.limits.vocab_size)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append(outs)
        if not speculative:
            answers[:] = [list(o.prompt_token_ids) + list(o.token_ids) for o in outs]
        else:
            assert llm.engine.speculator.counters.num_accepted_tokens > 0
        llm.shutdown()
    plain, spec = results
    assert len(spec) == len(plain) == len(prompts) + 1
    assert spec[0].num_accepted_draft_tokens > 0 < spec[5].num_accepted_draft_tokens  # logprobs
    assert spec[1].num_accepted_draft_tokens > 0  # the grammar's: each draft row masked
    assert spec[3].num_accepted_draft_tokens > 0  # the penalized request's
    for a, b in zip(plain, spec):
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
    # log-probabilities and pooled rows: within float noise of another batch
    assert len(spec[0].logprobs) == len(spec[5].logprobs) == 24
    for a, b in zip(plain[0].logprobs + plain[5].logprobs + plain[6].prompt_logprobs[1:],
                    spec[0].logprobs + spec[5].logprobs + spec[6].prompt_logprobs[1:]):
        assert b.top_ids == a.top_ids
        assert b.top_logprobs == pytest.approx(a.top_logprobs, abs=1e-4)
    assert spec[7].pooled == pytest.approx(plain[7].pooled, abs=1e-4)
    json.loads(spec[1].text)  # the constrained answer is the schema's JSON


class _Then:
    """Proposes what ``first`` proposes, then ``tail`` (up to k): e.g. a JSON answer's end,
    its EOS, then tokens no grammar takes after it."""

    def __init__(self, first, tail: list[int]) -> None:  # noqa: ANN001
        self.first, self.tail = first, tail

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        return (self.first.propose(token_ids, k) + self.tail)[:k]


def _json_requests() -> tuple[list[list[int]], list[SamplingParams]]:
    """Four JSON-schema requests, greedy and seeded."""
    schema = {"type": "object", "properties": {"tag": {"enum": ["ab", "ray serve"]},
                                               "ok": {"type": "boolean"},
                                               "n": {"type": "integer"}},
              "required": ["tag", "ok", "n"]}
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=48,
                             structured_outputs={"json": schema}) for i in range(4)]
    return random_prompts(4, 8, 20, seed=19), params


def _plain_outputs(prompts, params, **options):  # noqa: ANN001, ANN202
    """The tiny model's outputs without speculation."""
    plain = LLM("tiny", **options)
    try:
        return plain.generate(prompts, params, use_tqdm=False)
    finally:
        plain.shutdown()


def _assert_json_texts(outs, expected) -> None:  # noqa: ANN001
    """The plain engine's texts; each finished one a JSON object of the schema's keys (a random
    model may write a long integer and stop at max_tokens)."""
    assert [o.text for o in outs] == [o.text for o in expected]
    for out in outs:
        if out.finish_reason == "stop":
            assert set(json.loads(out.text)) == {"tag", "ok", "n"}


def test_grammar_requests_speculate_with_every_draft_row_masked():
    """JSON-schema requests, greedy and seeded, with overlapped steps, speculating with drafts
    that hold, drafts the grammar refuses (a wrong token, EOS mid-object, a special token),
    drafts that run past the grammar's end and the n-gram proposer: rank 0 masks each draft
    row for the drafts before it and its matcher takes the kept run, so the text is the plain
    engine's, valid JSON."""
    prompts, params = _json_requests()
    options = {"runtime": "inprocess", "max_model_len": 128}
    expected = _plain_outputs(prompts, params, overlap_scheduling=False, **options)
    assert sum(o.finish_reason == "stop" for o in expected) >= 2
    answers = [list(o.prompt_token_ids) + list(o.token_ids) for o in expected]
    llm = LLM("tiny", speculative_config={"method": "ngram", "num_speculative_tokens": K,
                                          "prompt_lookup_min": 1, "adaptive": False}, **options)
    try:
        vocab, speculator = llm.engine.limits.vocab_size, llm.engine.speculator
        eos = llm.engine.limits.eos_token_ids[0]
        special = SPECIAL_TOKENS.index("<|im_start|>")  # the tiny tokenizer's ids come first
        nothing = Recorded([], vocab)
        for name, proposer in (("right", Recorded(answers, vocab)),
                               ("refused", Recorded(answers, vocab, wrong=True)),
                               ("eos", _Then(nothing, [eos, 5, 6])),
                               ("special", _Then(nothing, [special, 5, 6])),
                               ("past_the_end", _Then(Recorded(answers, vocab), [eos, 5, 6])),
                               ("ngram", speculator.proposer)):
            speculator.proposer = proposer
            outs = llm.generate(prompts, params, use_tqdm=False)
            _assert_json_texts(outs, expected)
            drafted = sum(o.num_draft_tokens for o in outs)
            accepted = sum(o.num_accepted_draft_tokens for o in outs)
            assert drafted > 0, name
            if name == "right":
                assert accepted == drafted, (accepted, drafted)
            elif name in ("refused", "eos", "special"):
                assert accepted == 0, (name, accepted)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_grammar_requests_draft_with_a_drafter_on_the_ranks(method, tmp_path, tiny_path):
    """JSON-schema requests, greedy and seeded, drafting with the tiny model drafting for
    itself (right until the grammar makes the target choose otherwise) and with an EAGLE-3
    head: rank 0 reads the drafts back and masks each draft row for the drafts before it, so
    the text is the plain engine's, valid JSON, and drafts are accepted where they fit."""
    from eagle3_oracle import write_eagle3_checkpoint

    prompts, params = _json_requests()
    options = {"runtime": "inprocess", "max_model_len": 128}
    expected = _plain_outputs(prompts, params, **options)
    model = "tiny" if method == "draft_model" else write_eagle3_checkpoint(
        str(tmp_path / "eagle"), tiny_path, seed=8, aux_ids=[0, 1, 1])
    llm = LLM("tiny", speculative_config={"method": method, "model": model,
                                          "num_speculative_tokens": K, "adaptive": False},
              **options)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    _assert_json_texts(outs, expected)
    drafted = sum(o.num_draft_tokens for o in outs)
    accepted = sum(o.num_accepted_draft_tokens for o in outs)
    assert drafted > 20, drafted
    if method == "draft_model":  # the target's own greedy tokens, where the grammar agrees
        assert 0 < accepted < drafted, (accepted, drafted)


def test_unseeded_sampling_keeps_its_distribution():
    """Chi-square test of homogeneity over the 2nd and 3rd tokens of 1,200 unseeded samples
    each way, the drafts the greedy continuation (so often accepted); a false alarm at
    p < 1e-4 is one run in 10,000."""
    prompt = random_prompts(1, 12, 12, seed=5)[0]
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    draws = 1200
    counts = {}
    for speculative in (True, False):
        llm = LLM("tiny", runtime="inprocess", max_model_len=64, overlap_scheduling=False,
                  **({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                                            "disable_by_batch_size": 256}}
                     if speculative else {}))
        if speculative:
            greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3),
                                  use_tqdm=False)[0].token_ids
            llm.engine.speculator.proposer = Recorded([prompt + greedy],
                                                      llm.engine.limits.vocab_size)
        outs = llm.generate([prompt] * draws, params, use_tqdm=False)
        counts[speculative] = collections.Counter(tuple(o.token_ids[1:]) for o in outs)
        if speculative:
            assert llm.engine.speculator.counters.num_accepted_tokens > draws // 10
        llm.shutdown()
    cells = sorted(set(counts[True]) | set(counts[False]))
    table = torch.tensor([[counts[s][c] for c in cells] for s in (True, False)], dtype=torch.float64)
    table = table[:, table.sum(0) >= 10]  # pool nothing: rare cells are dropped from both rows
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    chi2 = ((table - expected) ** 2 / expected).sum()
    dof = table.shape[1] - 1
    p_value = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), chi2 / 2)
    assert dof >= 2 and p_value > 1e-4, (chi2.item(), dof, counts)


def test_the_ngram_proposer_copies_on_from_the_latest_earlier_occurrence():
    ngram = NgramProposer(SpeculativeConfig(prompt_lookup_min=1, prompt_lookup_max=3))
    assert ngram.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]  # latest, longest
    assert ngram.propose([5, 6, 7], 3) == []  # nothing recurs
    assert ngram.propose([4, 4], 3) == [4, 4, 4]  # a repeat drafts its next period
    assert ngram.propose([7, 1, 2, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]
    assert ngram.propose([3, 1, 2, 5, 1, 2], 4) == [5, 1, 2, 5]
    # bytes that match across two int32 tokens are no match (1 in 2**24's last byte and 0)
    assert ngram.propose([1, 9, 2**24, 0, 5, 1], 2) == [9, 2**24]
    assert accepted_run([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert accepted_run([5, 6], [5, 6, 2]) == [5, 6, 2]


def test_speculation_is_refused_by_name_where_it_cannot_run():
    with pytest.raises(ValueError, match="speculative_config method='eagle'"):
        LLM("tiny", runtime="inprocess", speculative_config={"method": "eagle"})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM("tiny", runtime="inprocess", speculative_config={"num_speculative_tokens": 0})


def test_a_method_registered_as_a_plug_in_speculates_by_its_name():
    """A new host method is one class (``nvray/speculative_methods.py``): registered, it is
    accepted by name, its proposer drafts every step and the tokens are plain decoding's."""
    proposed = []

    class RepeatLast:  # drafts the newest token again
        def propose(self, token_ids: list[int], k: int) -> list[int]:
            proposed.append(k)
            return [token_ids[-1]] * k

    @register
    class RepeatLastMethod(SpeculativeMethod):
        name = "repeat_last"

        @classmethod
        def host_proposer(cls, config):  # noqa: ANN001, ANN206
            return RepeatLast()

    prompts = ["the cat sat on the mat", "one two three"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    try:
        spec = LLM("tiny", runtime="inprocess", speculative_config={
            "method": "repeat_last", "num_speculative_tokens": K, "adaptive": False})
        outs = spec.generate(prompts, params, use_tqdm=False)
        counted = spec.engine.speculator.counters.stats()
    finally:
        del SPECULATIVE_METHODS["repeat_last"]
    plain = LLM("tiny", runtime="inprocess").generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert proposed and counted["num_drafts"] > 0, counted
    with pytest.raises(ValueError, match="speculative_config method='repeat_last'"):
        LLM("tiny", runtime="inprocess", speculative_config={"method": "repeat_last"})


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5-moe"])
def test_a_model_with_recurrent_layers_speculates_with_its_state_rolled_back(family,
                                                                            family_path):
    """Qwen3.5 hybrids (Gated DeltaNet state per sequence): a verified chunk's rows are held
    and only the kept ones reach the state. HF's greedy tokens with the n-gram proposer (with
    overlapped stretches), a drafter always right and one always wrong, through chunked
    prefills, preemption and prefix hits that resume from a kept state; seeded n = 2 choices
    the plain engine's; no slot or block left held."""
    path = family_path(family)
    prompts = random_prompts(6, 20, 90, seed=9)
    expected = [hf_greedy(path, prompt, 24) for prompt in prompts]
    answers = [prompt + out for prompt, out in zip(prompts, expected)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=3, max_tokens=12, ignore_eos=True,
                            n=2)
    options = {"runtime": "inprocess", "num_kvcache_blocks": 14, "kvcache_block_size": 16,
               "max_model_len": 160, "max_num_batched_tokens": 40, "max_num_seqs": 8}
    plain = LLM(path, **options)
    try:
        plain_choices = [o.token_ids for o in plain.generate(prompts[:2], seeded, use_tqdm=False)]
    finally:
        plain.shutdown()
    llm = LLM(path, **options, speculative_config={
        "method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
        "disable_by_batch_size": 64, "adaptive": False})
    speculator, vocab = llm.engine.speculator, llm.engine.limits.vocab_size
    try:
        for name, proposer in [("ngram", speculator.proposer), ("right", Recorded(answers, vocab)),
                               ("wrong", Recorded(answers, vocab, wrong=True))]:
            speculator.proposer = proposer
            before = speculator.counters.stats()
            outs = llm.generate(prompts + prompts[:2], greedy, use_tqdm=False)
            after = speculator.counters.stats()
            assert [o.token_ids for o in outs] == expected + expected[:2], name
            drafted, accepted = (after[key] - before[key]
                                 for key in ("num_draft_tokens", "num_accepted_tokens"))
            assert drafted > 0 and (accepted == drafted if name == "right" else
                                    accepted == 0 if name == "wrong" else True), (name, after)
            assert any(o.num_cached_tokens for o in outs), name
        choices = llm.generate(prompts[:2], seeded, use_tqdm=False)
        assert [o.token_ids for o in choices] == plain_choices
        stats = llm.engine.stats()
        bm = llm.engine.block_manager
        assert stats["num_preemptions"] > 0
        assert sorted(bm.states.free_slots) == list(range(bm.states.num_live))
        assert bm.num_free_blocks == bm.num_blocks
    finally:
        llm.shutdown()


def test_larger_batches_overlap_their_steps_and_smaller_ones_draft():
    """With ``disable_by_batch_size`` 2 and overlapped steps on: while more than two sequences
    run, steps overlap and carry no drafts (also the first after a drafting step, whose
    sequences have no token in flight); while two or fewer run, each step is answered at once
    and drafts follow its tokens. One request runs alone, three join it, then they finish one
    by one. The tokens are the plain engine's throughout."""
    prompts = random_prompts(4, 12, 20, seed=6)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (70, 10, 20, 30)]
    plain = LLM("tiny", runtime="inprocess", max_model_len=128)
    try:
        expected = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    finally:
        plain.shutdown()
    llm = LLM("tiny", runtime="inprocess", max_model_len=128,
              speculative_config={"method": "ngram", "num_speculative_tokens": K,
                                  "disable_by_batch_size": 2, "adaptive": False})
    engine = llm.engine
    answers = [list(p) + list(t) for p, t in zip(prompts, expected)]
    engine.speculator.proposer = Recorded(answers, engine.limits.vocab_size)
    handed = []  # (answered at once, drafts, placeholders) of each step handed over
    execute_overlapped = engine.executor.execute_overlapped

    def spy(step):  # noqa: ANN001, ANN202 - the real call, recorded
        if step is not None:
            handed.append((step.answer_now, sum(s.num_drafts for s in step.seqs),
                           sum(t < 0 for s in step.seqs for t in s.token_ids)))
        return execute_overlapped(step)

    engine.executor.execute_overlapped = spy
    arrivals = {0: [("r0", prompts[0], params[0], False)],
                6: [(f"r{i}", prompts[i], params[i], False) for i in (1, 2, 3)]}
    try:
        outputs = run_steps(engine, arrivals, {})
        assert_clean(engine)
    finally:
        llm.shutdown()
    assert [outputs[f"r{i}"][-1].token_ids for i in range(4)] == expected
    overlapped = [h for h in handed if not h[0]]
    answered = [h for h in handed if h[0]]
    assert any(h[2] for h in overlapped), "no step overlapped the one before it"
    assert all(h[1] == 0 for h in overlapped), "an overlapped step carried drafts"
    assert all(h[2] == 0 for h in answered), "a step answered at once held placeholders"
    assert sum(h[1] for h in answered) > 0, "no drafts while the batch was small"


def test_a_request_may_opt_out_of_speculation():
    prompt = random_prompts(1, 12, 12, seed=7)[0]
    llm = LLM("tiny", runtime="inprocess", max_model_len=128,
              speculative_config={"method": "ngram", "prompt_lookup_min": 1})
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    try:
        counters = llm.engine.speculator.counters
        alone = llm.generate(prompt, greedy, use_tqdm=False)[0]
        answer = [list(prompt) + list(alone.token_ids)]
        llm.engine.speculator.proposer = Recorded(answer, llm.engine.limits.vocab_size)
        drafted = counters.num_drafts
        out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40,
                                                  ignore_eos=True, speculate=False),
                           use_tqdm=False)[0]
        assert counters.num_drafts == drafted and out.token_ids == alone.token_ids
        llm.generate(prompt, greedy, use_tqdm=False)
        assert counters.num_drafts > drafted  # the same request, speculating
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="speculate"):
        SamplingParams(speculate="no")


def test_a_request_with_bad_words_never_gets_a_banned_word_from_a_draft():
    """A drafter that proposes the unbanned answer, banned word and all: the request with
    ``bad_words`` does not draft, and gets the tokens it gets without speculation (the banned
    word's ids nowhere in them)."""
    prompt = random_prompts(1, 12, 12, seed=9)[0]
    llm = LLM("tiny", runtime="inprocess", max_model_len=128,
              speculative_config={"method": "ngram", "prompt_lookup_min": 1})
    try:
        free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30,
                                                   ignore_eos=True, speculate=False),
                            use_tqdm=False)[0]
        intake = llm.engine.intake  # a word of the answer that is one of its tokens
        word = next(w for t in free.token_ids[2:] for w in [llm.tokenizer.decode([t]).strip()]
                    if w.isalpha() and (t,) in intake.bad_word_ids((w,)))
        banned = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                bad_words=[word])
        expected = llm.generate(prompt, dataclasses.replace(banned, speculate=False),
                                use_tqdm=False)[0]
        llm.engine.speculator.proposer = Recorded([list(prompt) + list(free.token_ids)],
                                                  llm.engine.limits.vocab_size)
        got = llm.generate(prompt, banned, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    assert expected.token_ids != free.token_ids  # the ban changed the answer
    assert got.token_ids == expected.token_ids
    assert word not in got.text.split()
    assert got.num_draft_tokens == 0


def test_adaptive_drafting_backs_off_a_drafter_that_keeps_failing():
    prompt = random_prompts(1, 12, 12, seed=8)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    drafted, tokens = {}, {}
    for adaptive in (False, True):
        llm = LLM("tiny", runtime="inprocess", max_model_len=128,
                  speculative_config={"method": "ngram", "num_speculative_tokens": K,
                                      "adaptive": adaptive})
        try:
            first = llm.generate(prompt, greedy, use_tqdm=False)[0]
            answer = [list(prompt) + list(first.token_ids)]
            spec = llm.engine.speculator
            spec.proposer = Recorded(answer, llm.engine.limits.vocab_size, wrong=True)
            before = spec.counters.num_draft_tokens
            tokens[adaptive] = llm.generate(prompt, greedy, use_tqdm=False)[0].token_ids
            drafted[adaptive] = spec.counters.num_draft_tokens - before
            assert tokens[adaptive] == first.token_ids
        finally:
            llm.shutdown()
    assert drafted[False] >= K * 50  # k drafts at nearly every step, all rejected
    assert 0 < drafted[True] < drafted[False] / 5, drafted


def test_a_windowed_model_speculates_with_its_blocks_given_back(family_path):
    """Gemma 3's sliding-window layers (window 8, blocks of 4): drafts accepted and rejected
    while out-of-window blocks are given back; the same tokens as decoding a token a step."""
    path = family_path("gemma3")
    prompts = random_prompts(3, 20, 40, seed=10)
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    options = {"runtime": "inprocess", "max_model_len": 128, "kvcache_block_size": 4,
               "overlap_scheduling": False}
    plain = LLM(path, **options)
    try:
        expected = plain.generate(prompts, greedy, use_tqdm=False)
    finally:
        plain.shutdown()
    answers = [list(o.prompt_token_ids) + list(o.token_ids) for o in expected]
    llm = LLM(path, speculative_config={"method": "ngram", "num_speculative_tokens": K,
                                        "disable_by_batch_size": 8, "adaptive": False}, **options)
    try:
        vocab = llm.engine.limits.vocab_size
        for wrong in (False, True):
            llm.engine.speculator.proposer = Recorded(answers, vocab, wrong)
            outs = llm.generate(prompts, greedy, use_tqdm=False)
            assert [o.token_ids for o in outs] == [o.token_ids for o in expected], wrong
        counters = llm.engine.speculator.counters
        assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
        assert llm.engine.block_manager.windowed
    finally:
        llm.shutdown()


def test_inter_token_latency_counts_a_gap_per_step_not_per_token():
    """A verified run's tokens arrive in one step: the histogram gets one gap for it (vLLM's
    per-iteration latency), not zeros for the tokens that came with it."""
    prompt = random_prompts(1, 12, 12, seed=13)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    llm = LLM("tiny", runtime="inprocess", max_model_len=128,
              speculative_config={"method": "ngram", "num_speculative_tokens": K,
                                  "adaptive": False})
    try:
        first = llm.generate(prompt, greedy, use_tqdm=False)[0]
        llm.engine.speculator.proposer = Recorded([list(prompt) + list(first.token_ids)],
                                                  llm.engine.limits.vocab_size)
        def gaps_counted() -> int:
            return llm.engine.stats()["inter_token_latency_seconds"]["count"]

        count, steps = gaps_counted(), llm.engine.stats()["steps"]["decode"]
        llm.generate(prompt, greedy, use_tqdm=False)
        gaps, decode_steps = gaps_counted() - count, llm.engine.stats()["steps"]["decode"] - steps
    finally:
        llm.shutdown()
    assert decode_steps <= 40 // (K + 1) + 2  # runs of k + 1 tokens
    assert gaps == decode_steps  # one gap per step after the first token's


# ------------------------------------------------------------------ draft model (on the ranks)
def _draft_engine(drafter: str, **kwargs):  # noqa: ANN001, ANN202
    options = {"max_model_len": 256, "max_num_batched_tokens": 64, "num_kvcache_blocks": 24,
               "kvcache_block_size": 16, "overlap_scheduling": False, **kwargs}
    spec = {"method": "draft_model", "model": drafter, "num_speculative_tokens": K,
            "disable_by_batch_size": 64, "adaptive": False, **options.pop("spec", {})}
    return LLM("tiny", runtime="inprocess", speculative_config=spec, **options).engine


def test_the_target_as_its_own_draft_model_drafts_what_it_then_decodes(engines):
    """The tiny model drafting for itself, with overlapped steps above 4 running sequences (no
    draft model work there) and drafts below: the plain engine's tokens through the mixed
    workload, and every greedy request's drafts accepted — each drafting sequence feeds the
    draft cache what it lacks (its prompt in chunks of max_num_batched_tokens, the tokens of
    steps without drafts, the last draft of a run accepted whole) at the right positions."""
    engine = _draft_engine("tiny", overlap_scheduling=True, spec={"disable_by_batch_size": 4})
    spec, plain, counted = _run_both(engine, engines[1])
    _assert_same_answers(spec, plain)
    greedy = [outs[-1] for rid, outs in spec.items()
              if rid in ("g0", "g1", "prefix", "late", "stop_id", "stop_str", "min")]
    assert sum(o.num_draft_tokens for o in greedy) > 40
    for out in greedy:
        assert out.num_accepted_draft_tokens == out.num_draft_tokens, out.request_id
    assert counted["num_accepted_tokens"] > 2 * counted["num_drafts"], counted


def test_sequences_preempted_while_they_catch_up_and_forks_keep_the_drafters_cache_right():
    """Prompts longer than the feed budget (max_num_batched_tokens=32: each sequence feeds the
    draft model in chunks before it drafts) under so few blocks that sequences are preempted
    between and inside those steps, and n=2 greedy choices (forks sharing the prompt's
    blocks, copied on write in both caches): the tokens are HF's, every draft is accepted."""
    prompts = random_prompts(5, 70, 110, seed=23)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    llm = LLM("tiny", runtime="inprocess", max_model_len=256, num_kvcache_blocks=24,
              kvcache_block_size=16, max_num_batched_tokens=32, overlap_scheduling=False,
              speculative_config={"method": "draft_model", "model": "tiny",
                                  "num_speculative_tokens": 3, "adaptive": False})
    try:
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        forks = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=40, n=2,
                                                         ignore_eos=True), use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0, "the workload must preempt"
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(resolve_model("tiny"), prompt, 40)
        assert out.num_accepted_draft_tokens == out.num_draft_tokens > 0, out.request_id
    assert [c.token_ids for c in forks] == [outs[0].token_ids] * 2
    assert all(c.num_accepted_draft_tokens == c.num_draft_tokens > 0 for c in forks)


def test_a_preempted_sequence_feeds_the_draft_model_again_from_its_new_blocks():
    """Without prefix caching a preempted sequence comes back in other blocks, whose draft cache
    holds another sequence's: it feeds the draft model its tokens again (the tiny model
    drafting for itself: every drafts still accepted, the tokens HF's)."""
    prompts = random_prompts(6, 30, 60, seed=21)
    greedy = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    llm = LLM("tiny", runtime="inprocess", max_model_len=256, num_kvcache_blocks=16,
              kvcache_block_size=16, enable_prefix_caching=False, overlap_scheduling=False,
              speculative_config={"method": "draft_model", "model": "tiny",
                                  "num_speculative_tokens": 3, "adaptive": False})
    try:
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0, "the workload must preempt"
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(resolve_model("tiny"), prompt, 60)
        assert out.num_accepted_draft_tokens == out.num_draft_tokens > 30, out.request_id


def test_a_prefix_hit_feeds_the_draft_model_only_past_the_blocks_it_was_fed_before():
    """Prefix caching with the tiny model drafting for itself: a prompt that opted out of
    speculation leaves its blocks without draft rows, so a repeat that hits them feeds the draft
    model from its first token; one that drafted leaves them fed, so the next repeat's first
    feed starts where its hit ends (64 tokens: four blocks), for both choices of an n = 2
    request (the second forked from the first). Every draft is accepted (the rows read there
    are the earlier sequences') and the tokens are HF's."""
    prompt = random_prompts(1, 70, 70, seed=29)[0]
    llm = LLM("tiny", runtime="inprocess", max_model_len=256, kvcache_block_size=16,
              overlap_scheduling=False,
              speculative_config={"method": "draft_model", "model": "tiny",
                                  "num_speculative_tokens": 3, "adaptive": False})
    feeds: dict[int, int] = {}  # each sequence's first feed's start (its first draft_start)
    execute = llm.engine.executor.execute

    def recording(step):  # noqa: ANN001, ANN202
        for s in step.seqs:
            if s.draft_tokens:
                feeds.setdefault(s.seq_id, s.draft_start)
        return execute(step)

    llm.engine.executor.execute = recording
    runs = []
    try:
        for ending, speculate, n in (([1, 2], False, 1), ([3, 4], True, 1), ([5, 6, 7], True, 1),
                                     ([8, 9], True, 2)):
            feeds.clear()
            tokens = prompt[:64] + ending
            params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                    speculate=speculate, n=n)
            outs = llm.generate(tokens, params, use_tqdm=False)
            runs += [(tokens, out, sorted(feeds.values())) for out in outs]
    finally:
        llm.shutdown()
    for tokens, out, _ in runs:
        assert out.token_ids == hf_greedy(resolve_model("tiny"), tokens, 30)
    assert runs[0][1].num_draft_tokens == 0 and not runs[0][2]
    for _, out, _ in runs[1:]:
        assert out.num_accepted_draft_tokens == out.num_draft_tokens > 10, out.request_id
    assert runs[1][2][0] == 0  # the hit's blocks hold no draft rows: fed from the start
    assert runs[2][2][0] == 64  # the hit's four blocks were fed by the run before
    assert runs[3][2] == [64, 64]  # n = 2: the choice forked from the hit's one too


def test_a_draft_model_of_another_family_whose_drafts_fail_keeps_the_tokens(engines,
                                                                           family_path):
    """A random Llama-shaped drafter with the target's vocabulary: its drafts are (nearly)
    all wrong, every rejected draft's KV dropped in both caches, and the output is the plain
    engine's; no block is left held."""
    engine = _draft_engine(family_path("llama3"))
    spec, plain, counted = _run_both(engine, engines[1])
    _assert_same_answers(spec, plain)
    assert counted["num_accepted_tokens"] < counted["num_draft_tokens"] // 4, counted


def test_a_draft_model_drafts_for_penalized_requests_and_is_refused_by_name(family_path, tmp_path,
                                                                           tiny_path):
    """Penalized requests and a choice request drafting with the tiny model drafting for
    itself: each draft row's penalties count the drafts before it, which the ranks read back
    (drafts right until the penalties make the target choose otherwise), the plain engine's
    tokens."""
    prompts = random_prompts(3, 10, 20, seed=13)
    penalized = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                               presence_penalty=1.0)
    choice = SamplingParams(temperature=0.0, max_tokens=16,
                            structured_outputs={"choice": ["ray serve", "nvray"]})
    params = [penalized, penalized, choice]
    llm = LLM("tiny", runtime="inprocess", max_model_len=64,
              speculative_config={"method": "draft_model", "model": "tiny"})
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    plain = LLM("tiny", runtime="inprocess", max_model_len=64)
    try:
        expected = plain.generate(prompts, params, use_tqdm=False)
    finally:
        plain.shutdown()
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    penalized = outs[:2]
    drafted = sum(o.num_draft_tokens for o in penalized)
    accepted = sum(o.num_accepted_draft_tokens for o in penalized)
    assert 0 < accepted < drafted, (accepted, drafted)
    assert outs[-1].text in ("ray serve", "nvray")
    from nvray.models.tiny import build_checkpoint

    other_vocab = build_checkpoint(str(tmp_path / "other"), vocab_size=640)
    with pytest.raises(ValueError, match="vocabulary has 640 tokens, the target's"):
        LLM("tiny", runtime="inprocess",
            speculative_config={"method": "draft_model", "model": other_vocab})
    with pytest.raises(ValueError, match="needs the drafter's checkpoint directory"):
        LLM("tiny", runtime="inprocess", speculative_config={"method": "draft_model"})
    with pytest.raises(ValueError, match="needs full attention in every layer"):
        LLM("tiny", runtime="inprocess", max_model_len=256,
            speculative_config={"method": "draft_model", "model": family_path("gemma3")})
    from hf_checkpoints import SHAPES, write_hf_checkpoint

    windowed = write_hf_checkpoint(str(tmp_path / "windowed"),
                                   {**SHAPES["mistral"], "sliding_window": 64}, tiny_path, seed=7)
    with pytest.raises(ValueError, match="needs a target whose layers all attend fully"):
        LLM(windowed, runtime="inprocess",
            speculative_config={"method": "draft_model", "model": "tiny"})
    short = build_checkpoint(str(tmp_path / "short"), {"max_position_embeddings": 128})
    with pytest.raises(ValueError, match="its positions reach 128 tokens, fewer than "
                                         "max_model_len=256"):
        LLM("tiny", runtime="inprocess", max_model_len=256,
            speculative_config={"method": "draft_model", "model": short})
    with pytest.raises(ValueError, match="needs pipeline_parallel_size=1"):
        LLM("tiny", pipeline_parallel_size=2,
            speculative_config={"method": "draft_model", "model": "tiny"})


# ------------------------------------------------------------------------ EAGLE-3 (on the ranks)
def _eagle3_run(target: str, drafter: str, prompts: list[list[int]], max_tokens: int, **kwargs):
    """Greedy outputs of an EAGLE-3 engine, n=2 forks of the first prompt after them, and
    every verified run as (the sequence's tokens before it, its drafts)."""
    return _head_run(target, {"method": "eagle3", "model": drafter}, prompts, max_tokens,
                     **kwargs)


def _head_run(target: str, method: dict, prompts: list[list[int]], max_tokens: int, **kwargs):
    """``_eagle3_run`` for a head of any method (``method``: its speculative_config keys)."""
    llm = LLM(target, runtime="inprocess", max_model_len=256, overlap_scheduling=False,
              kvcache_block_size=16, speculative_config={
                  **method, "num_speculative_tokens": K, "adaptive": False}, **kwargs)
    runs, speculator = [], llm.engine.speculator
    emitted = speculator.emitted

    def record(seq, drafts, sampled):  # noqa: ANN001, ANN202
        runs.append((list(seq.token_ids), list(drafts)))
        return emitted(seq, drafts, sampled)

    speculator.emitted = record
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    try:
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        forks = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                         n=2, ignore_eos=True), use_tqdm=False)
        preemptions = llm.engine.scheduler.num_preemptions
        hits = llm.engine.block_manager.num_hit_tokens
    finally:
        llm.shutdown()
    return outs, forks, runs, preemptions, hits


@pytest.mark.parametrize("drafter", [
    {"echo": 1.0, "max_position_embeddings": 128},  # its rope extended to max_model_len
    {"echo": 3.0, "draft_vocab": 300, "own_embeddings": True},  # d2t, its own embeddings
    {"echo": 2.0, "draft_vocab": 400, "speculators": True}])  # norm before the residual
def test_eagle3_drafts_are_the_reference_drafters_through_preemption_hits_and_forks(
        tmp_path, tiny_path, drafter):
    """An EAGLE-3 drafter (random, leaning to repeat; in the published format, and in the
    speculators library's with its hidden norm before the residual) for a target that repeats
    its last token, under so few blocks that sequences are preempted, prompts sharing a prefix (hits
    whose features the target stored earlier, one ending where the sharing sequences' tokens
    part), feeds chunked by max_num_batched_tokens and
    n=2 forks: the tokens are HF's, and every verified run's drafts are the reference
    drafter's after the same tokens (HF's features, the layer in plain torch) — drafts
    accepted in part, so the accepted ones are fed again from the target's features."""
    from eagle3_oracle import reference_drafts, write_eagle3_checkpoint, write_echo_target

    target = write_echo_target(str(tmp_path / "target"), tiny_path)
    aux = [1, 0, 1]
    path = write_eagle3_checkpoint(str(tmp_path / "eagle"), target, seed=3, aux_ids=aux,
                                   **drafter)
    prompts = random_prompts(5, 40, 70, seed=5)
    # hits of 2 blocks: one whose next token is the cached sequence's, one whose is not (its
    # drafter row at position 31 holds token 32: its own, in a block of its own)
    prompts += [prompts[0][:40] + [7, 8, 9], prompts[0][:32] + [11, 12, 13, 14] * 5]
    outs, forks, runs, preemptions, hits = _eagle3_run(
        target, path, prompts, 30, num_kvcache_blocks=24, max_num_batched_tokens=32)
    assert preemptions > 0 and hits > 0, "the workload must preempt and hit the prefix cache"
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(target, prompt, 30)
    assert [c.token_ids for c in forks] == [outs[0].token_ids] * 2
    assert len(runs) > 60
    for tokens, drafts in runs:
        assert drafts == reference_drafts(target, path, tokens, len(drafts), aux), len(tokens)
    drafted = sum(o.num_draft_tokens for o in outs)
    accepted = sum(o.num_accepted_draft_tokens for o in outs)
    assert 20 < accepted < drafted - 20, (accepted, drafted)


def test_eagle3_through_the_mixed_workload_gives_the_plain_tokens(engines, tmp_path, tiny_path):
    """A random EAGLE-3 drafter for the tiny model, with overlapped steps above 4 running
    sequences: the plain engine's tokens, text and finish reasons through chunked prefills,
    prefix hits, preemption, stop rules and aborts; nothing left held."""
    from eagle3_oracle import write_eagle3_checkpoint

    path = write_eagle3_checkpoint(str(tmp_path / "eagle"), tiny_path, seed=4, aux_ids=[0, 1, 1],
                                   draft_vocab=256)
    engine = LLM("tiny", runtime="inprocess", max_model_len=256, max_num_batched_tokens=64,
                 num_kvcache_blocks=24, kvcache_block_size=16, overlap_scheduling=True,
                 speculative_config={"method": "eagle3", "model": path,
                                     "num_speculative_tokens": K, "adaptive": False,
                                     "disable_by_batch_size": 4}).engine
    spec, plain, counted = _run_both(engine, engines[1])
    _assert_same_answers(spec, plain)
    assert counted["num_draft_tokens"] > 100, counted


def test_eagle3_is_refused_by_name_where_it_cannot_run(tmp_path, tiny_path):
    from eagle3_oracle import write_eagle3_checkpoint

    with pytest.raises(ValueError, match=r"is \['Qwen3ForCausalLM'\], not an EAGLE-3 drafter"):
        LLM("tiny", runtime="inprocess", speculative_config={"method": "eagle3", "model": "tiny"})
    with pytest.raises(ValueError, match="method 'eagle3' needs the drafter's checkpoint"):
        LLM("tiny", runtime="inprocess", speculative_config={"method": "eagle3"})
    far = write_eagle3_checkpoint(str(tmp_path / "far"), tiny_path, seed=1, aux_ids=[0, 1, 5])
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids=\[0, 1, 5\] must "
                                         "name three layers of the target's 2"):
        LLM("tiny", runtime="inprocess", speculative_config={"method": "eagle3", "model": far})
    default_ids = write_eagle3_checkpoint(str(tmp_path / "default"), tiny_path, seed=1)
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids=\[2, 1, -1\]"):
        LLM("tiny", runtime="inprocess",
            speculative_config={"method": "eagle3", "model": default_ids})
    wide = write_eagle3_checkpoint(str(tmp_path / "wide"), tiny_path, seed=1, aux_ids=[0, 1, 1])
    with open(f"{wide}/config.json") as f:
        config = json.load(f)
    with open(f"{wide}/config.json", "w") as f:
        json.dump({**config, "target_hidden_size": 128}, f)
    with pytest.raises(ValueError, match="for a target of hidden size 128, this target's is 64"):
        LLM("tiny", runtime="inprocess", speculative_config={"method": "eagle3", "model": wide})
    with pytest.raises(ValueError, match="an EAGLE-3 drafter, not a model to serve"):
        LLM(wide, runtime="inprocess")
    with open(f"{wide}/config.json", "w") as f:
        json.dump({**config, "hidden_size": 32, "target_hidden_size": 64}, f)
    with pytest.raises(ValueError, match="of hidden size 32 without embeddings of its own "
                                         "cannot share the target's"):
        LLM("tiny", runtime="inprocess", speculative_config={"method": "eagle3", "model": wide})


# --------------------------------------------------------------- Qwen3.5's MTP head (on the ranks)
@pytest.mark.parametrize("family,echo,noise", [
    ("qwen3_5", False, 0.0),  # random: drafts rejected
    ("qwen3_5", True, 0.0),  # echo: every draft right
    ("qwen3_5-vl", True, 0.1),  # as Qwen3.5 ships (a language model in a VL checkpoint), in part
    ("qwen3_5-moe", False, 0.0),  # random: its routed and shared experts
    ("qwen3_5-moe", True, 0.1)])  # the stored states of a MoE target, in part
def test_mtp_drafts_are_the_reference_heads_through_preemption_hits_and_forks(
        tmp_path, family_path, family, echo, noise):
    """Qwen3.5's MTP head read from the target's checkpoint (``mtp.*``): random; with an echo
    target and a head passing the target's stored state on (every draft right only where the
    stored states and chained outputs are); the same with noise (accepted in part, so accepted
    drafts are fed again and held chunks applied in part). The tokens are HF's, and every
    checked verified run's drafts are the reference head's after the same tokens (HF's final
    hidden states, HF's decoder layer and norms), under preemption, prefix hits (one ending
    where the sharing sequences' tokens part), chunked feeds and n=2 forks."""
    from mtp_oracle import reference_mtp_drafts, write_mtp_checkpoint

    path = write_mtp_checkpoint(str(tmp_path / "mtp"), family_path(family), seed=3, echo=echo,
                                noise=noise)
    prompts = random_prompts(5, 40, 70, seed=5)
    prompts += [prompts[0][:40] + [7, 8, 9], prompts[0][:32] + [11, 12, 13, 14] * 5]
    outs, forks, runs, preemptions, hits = _head_run(
        path, {"method": "mtp"}, prompts, 24, num_kvcache_blocks=24, max_num_batched_tokens=32,
        max_num_seqs=8)
    # (an echo head's runs are accepted: sequences end before the cache fills)
    assert (preemptions > 0 or echo) and hits > 0, "the workload must preempt and hit the cache"
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(path, prompt, 24)
    assert [c.token_ids for c in forks] == [outs[0].token_ids] * 2
    assert len(runs) > 30
    for tokens, drafts in runs[::5]:
        assert drafts == reference_mtp_drafts(path, tokens, len(drafts)), len(tokens)
    drafted = sum(o.num_draft_tokens for o in outs)
    accepted = sum(o.num_accepted_draft_tokens for o in outs)
    if not echo:
        assert accepted < drafted, (accepted, drafted)
    else:
        assert (accepted == drafted) if not noise else (20 < accepted < drafted - 20), \
            (accepted, drafted)


def test_a_hybrid_with_a_head_serves_a_repeated_prompt_from_a_kept_state(tmp_path, family_path):
    """MTP on Qwen3.5 (a head: prefix hits leave their last block out) with prefix caching: the
    first repeat of a prompt is already served from the cache (its state kept one block before
    the prompt's last boundary, where such a hit ends), with HF's tokens."""
    from mtp_oracle import write_mtp_checkpoint

    path = write_mtp_checkpoint(str(tmp_path / "mtp"), family_path("qwen3_5"), seed=3, echo=True,
                                noise=0.1)
    prompt = random_prompts(1, 70, 71, seed=9)[0]
    llm = LLM(path, runtime="inprocess", max_model_len=256, kvcache_block_size=16,
              speculative_config={"method": "mtp", "num_speculative_tokens": K})
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    try:
        first, again = (llm.generate([prompt], greedy, use_tqdm=False)[0] for _ in range(2))
    finally:
        llm.shutdown()
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 48  # 4 full blocks before the last token, less the last
    assert first.token_ids == again.token_ids == hf_greedy(path, prompt, 8)


def test_mtp_is_refused_by_name_where_it_cannot_run(family_path, tmp_path):
    import shutil

    from mtp_oracle import write_mtp_checkpoint

    # the head reads the target's config with its overrides: its positions reach as far
    path = write_mtp_checkpoint(str(tmp_path / "mtp"), family_path("qwen3_5"), seed=3)
    LLM(path, runtime="inprocess", max_model_len=2048, num_kvcache_blocks=8,
        hf_overrides={"max_position_embeddings": 4096},
        speculative_config={"method": "mtp"}).shutdown()

    headless = shutil.copytree(family_path("qwen3_5"), tmp_path / "headless")
    config = json.loads((headless / "config.json").read_text())
    (headless / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    with pytest.raises(ValueError, match=r"has no mtp\.\* tensors \(a checkpoint saved without "
                                         r"its MTP head\)"):
        LLM(str(headless), runtime="inprocess", max_model_len=128,
            speculative_config={"method": "mtp"})
    with pytest.raises(ValueError, match=r"method 'mtp' needs a model with an MTP head .*"
                                         r"\['Qwen3ForCausalLM'\] has none"):
        LLM("tiny", runtime="inprocess", speculative_config={"method": "mtp"})
    with pytest.raises(ValueError, match=r"needs a model with an MTP head"):  # none in its config
        LLM(family_path("qwen3_5"), runtime="inprocess", max_model_len=128,
            speculative_config={"method": "mtp"})
    with pytest.raises(ValueError, match=r"method 'mtp' takes no model \(the head is the "
                                         r"target checkpoint's own\)"):
        LLM("tiny", runtime="inprocess", speculative_config={"method": "mtp", "model": "tiny"})
    head = shutil.copytree(path, tmp_path / "head")  # the head's architecture named to serve
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3_5MTP"]}))
    with pytest.raises(ValueError, match=r"names Qwen3.5's MTP head \(Qwen3_5MTP\), not a model "
                                         r"to serve: .*'method': 'mtp'"):
        LLM(str(head), runtime="inprocess", max_model_len=128)
