"""Structured outputs in the engine: random weights under a grammar still give valid output, in
every lifecycle (overlap on and off, preemption, n > 1, aborts, stop strings, logprobs), and
requests without a grammar in the same batch are untouched."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from nvray import SamplingParams
from nvray.structured_outputs import StructuredOutputsParams
from tiny_engines import tiny_inprocess

SCHEMAS = {
    "nested objects": {
        "type": "object", "required": ["user"],
        "properties": {"user": {"type": "object", "required": ["name", "admin"], "properties": {
            "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
            "admin": {"type": "boolean"}}},
            "note": {"type": "string", "maxLength": 5}}},
    "arrays with min/max items": {
        "type": "object", "required": ["ids"],
        "properties": {"ids": {"type": "array", "minItems": 1, "maxItems": 4,
                               "items": {"type": "integer", "minimum": 0, "maximum": 99}}}},
    "enums and optional fields": {
        "type": "object", "required": ["color"],
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "size": {"type": "integer", "minimum": 1, "maximum": 9}}},
    "numbers with bounds": {
        "type": "object", "required": ["t", "k"],
        "properties": {"t": {"type": "number", "minimum": -5, "maximum": 5},
                       "k": {"type": "integer", "exclusiveMaximum": 1000}}},
}


def constrained(seed: int | None = None, max_tokens: int = 100, **constraint) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, seed=seed, temperature=1.0,
                          structured_outputs=StructuredOutputsParams(**constraint))


def assert_valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)  # strict JSON: no raw control characters


def run_all(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.fixture(scope="module")
def llm():
    """The tiny model in-process with overlapped steps (the default); the schema test also
    runs without them."""
    engine = tiny_inprocess()
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_every_output_follows_its_schema(llm, overlap):
    engine = llm if overlap else tiny_inprocess(overlap_scheduling=False)
    try:
        names = [name for name in SCHEMAS for _ in range(4)]
        outs = run_all(engine, ["describe it"] * len(names),
                       [constrained(i, json=SCHEMAS[name]) for i, name in enumerate(names)])
    finally:
        if engine is not llm:
            engine.shutdown()
    for name, out in zip(names, outs):
        assert out.finish_reason == "stop", out.text  # the grammar ended it, by EOS
        assert_valid(out.text, SCHEMAS[name])
    for name in SCHEMAS:  # sampled, not one forced answer
        assert len({o.text for n, o in zip(names, outs) if n == name}) > 1, name


def test_a_loose_schemas_strings_hold_no_raw_control_characters(llm):
    """``strict: false`` (vLLM's loose JSON schema) still writes JSON that ``json.loads``
    accepts: xgrammar's strings allow raw control characters, which JSON forbids, so loose
    rows take the control-character mask as strict ones do."""
    schema = {"type": "object", "required": ["s"],
              "properties": {"s": {"type": "string", "maxLength": 40}}}
    outs = run_all(llm, ["a string please"] * 24,
                   [constrained(i, max_tokens=60, json=schema, strict=False) for i in range(24)])
    ended = [o for o in outs if o.finish_reason == "stop"]
    assert len(ended) >= 12, [o.text for o in outs]
    for out in ended:
        assert_valid(out.text, schema)
    assert len({o.text for o in ended}) > 1  # sampled, not one forced answer


def test_requests_without_a_grammar_keep_their_tokens_beside_constrained_ones(llm):
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    free_prompts = ["the first free prompt", "and a second one"]
    alone = [o.token_ids for o in run_all(llm, free_prompts, [greedy] * 2)]
    schema = SCHEMAS["nested objects"]
    mixed = run_all(llm, ["json please", free_prompts[0], "more json", free_prompts[1]],
                    [constrained(1, json=schema), greedy, constrained(2, json=schema), greedy])
    assert [mixed[1].token_ids, mixed[3].token_ids] == alone
    for out in (mixed[0], mixed[2]):
        assert_valid(out.text, schema)


def test_regex_choice_json_object_and_grammar_outputs_match(llm):
    outs = run_all(llm, ["x"] * 4, [
        constrained(3, regex=r"[0-9]{3}-[a-z]{2}"),
        constrained(4, choice=["yes", "no", "maybe so"]),
        constrained(5, json_object=True),
        constrained(6, grammar='root ::= "(" [a-c]+ ")" | "none"'),
    ])
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outs[0].text)
    assert outs[1].text in ("yes", "no", "maybe so")
    if outs[2].finish_reason == "stop":
        assert isinstance(json.loads(outs[2].text), dict)
    else:  # random weights may fill 100 tokens with an object's whitespace and strings
        assert outs[2].text.startswith("{")
    assert re.fullmatch(r"\([a-c]+\)|none", outs[3].text)
    assert {o.finish_reason for i, o in enumerate(outs) if i != 2} == {"stop"}


def test_n_choices_each_follow_the_schema_with_their_own_matcher(llm):
    schema = SCHEMAS["arrays with min/max items"]
    params = SamplingParams(n=4, max_tokens=100, seed=7, structured_outputs={"json": schema})
    outs = llm.generate(["a list"], params, use_tqdm=False)
    assert sorted(o.index for o in outs) == [0, 1, 2, 3]
    for out in outs:
        assert_valid(out.text, schema)
    assert len({o.text for o in outs}) > 1


def test_max_tokens_cuts_a_json_value_short_with_finish_reason_length(llm):
    out = run_all(llm, ["cut"], [constrained(8, json=SCHEMAS["nested objects"], max_tokens=6)])[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    assert '{"user"'.startswith(out.text) or out.text.startswith('{"user"')  # a prefix of the JSON
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_stop_strings_and_logprobs_work_under_a_grammar(llm):
    schema = SCHEMAS["enums and optional fields"]
    params = SamplingParams(max_tokens=100, seed=9, logprobs=2, stop=['"color"'],
                            structured_outputs={"json": schema})
    out = run_all(llm, ["stop early"], [params])[0]
    assert out.text == "{" and out.finish_reason == "stop"
    full = run_all(llm, ["stop early"], [SamplingParams(max_tokens=100, seed=9, logprobs=2,
                                                        structured_outputs={"json": schema})])[0]
    assert_valid(full.text, schema)
    assert len(full.logprobs) == len(full.token_ids)
    assert all(-1e9 < lp.logprob <= 0 for lp in full.logprobs)  # raw logits: never masked


def test_a_seeded_request_gives_the_same_json_when_preempted_in_a_tight_cache(tiny_path):
    """Preemption recomputes a sequence's KV; its matcher keeps its state, so a seeded request
    draws the same tokens as in a roomy cache (on the CPU, where recomputed logits are
    bit-identical; a GPU's prefill kernels round differently from its decode kernels, so there
    the outputs are only checked against the schema)."""
    schema = SCHEMAS["nested objects"]
    prompts = [f"request {i} wants an object" for i in range(6)]
    params = [constrained(20 + i, json=schema, max_tokens=60) for i in range(6)]
    roomy = tiny_inprocess(max_model_len=128)
    tight = tiny_inprocess(max_model_len=128, num_kvcache_blocks=14)
    try:
        want = [o.text for o in run_all(roomy, prompts, params)]
        got = run_all(tight, prompts, params)
        assert tight.stats()["num_preemptions"] > 0  # the cache was really too small
        for out in got:
            assert_valid(out.text, schema)
        if tight.engine.executor.runner.device.type == "cpu":
            assert [o.text for o in got] == want
        run_all(tight, ["flush"], [SamplingParams(max_tokens=2)])  # the next step releases
        assert not tight.engine.executor.runner.grammar_masks.matchers  # none left behind
    finally:
        roomy.shutdown()
        tight.shutdown()


def test_an_aborted_constrained_request_leaves_no_matcher_or_block(llm):
    engine = llm.engine
    masks = engine.executor.runner.grammar_masks
    engine.add_request("gone", "abort me", constrained(11, json=SCHEMAS["nested objects"]))
    for _ in range(3):
        engine.step()
    assert masks.matchers  # the rank holds the request's matcher
    engine.abort_request("gone")
    for _ in range(3):
        engine.step()
    run_all(llm, ["flush"], [SamplingParams(max_tokens=2)])  # a step carries the release
    assert not masks.matchers and not engine.has_unfinished_requests()
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("constraint,named", [
    ({"json": {"not": {"type": "string"}}}, "'not'"),
    ({"json": {"type": "object", "properties": {"a": {"if": {}}}}}, "'if'"),
    ({"json": {"$ref": "https://example.com/schema.json"}}, "outside the schema"),
    ({"json": {"type": "strin"}}, 'Unsupported type "strin"'),
    ({"json": "{not json"}, "not valid JSON"),
    ({"regex": "a(b"}, "parenthesis"),
    ({"grammar": "root ::= missing"}, 'Rule "missing" is not defined'),
    ({"choice": []}, "non-empty list"),
])
def test_a_constraint_that_cannot_be_enforced_is_refused_naming_it(llm, constraint, named):
    with pytest.raises(ValueError, match=re.escape(named)) as error:
        llm.generate(["x"], SamplingParams(structured_outputs=constraint), use_tqdm=False)
    assert str(error.value).startswith("structured_outputs")
    assert not llm.engine.has_unfinished_requests()


def test_exactly_one_constraint_per_request():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="unknown field"):
        SamplingParams(structured_outputs={"jsn": {}})


def test_a_constrained_request_skipping_steps_keeps_its_matcher_in_step(llm):
    """Multi-token bad words make a request wait for each token on the host, so with overlapped
    steps it sits out every other step while the others run: the token it sampled before a
    step without constrained rows still reaches its matcher."""
    schema = SCHEMAS["nested objects"]
    params = [SamplingParams(max_tokens=100, seed=30 + i, bad_words=["zebra crossing"],
                             structured_outputs={"json": schema}) for i in range(2)]
    free = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    outs = run_all(llm, ["json one", "free text", "json two"], [params[0], free, params[1]])
    for out in (outs[0], outs[2]):
        assert out.finish_reason == "stop"
        assert_valid(out.text, schema)


def test_a_batch_of_many_constrained_rows_fills_its_masks_in_threads(llm):
    """From 32 rows on, masks are filled and tokens accepted by xgrammar's batch matcher."""
    outs = run_all(llm, [f"code {i}" for i in range(40)],
                   [constrained(100 + i, regex=r"[a-z]{3}-[0-9]{2}") for i in range(40)])
    assert all(re.fullmatch(r"[a-z]{3}-[0-9]{2}", o.text) for o in outs)
    assert len({o.text for o in outs}) > 20
