"""Tool calling over HTTP with the real openai client: ``required`` and a named function give
calls whose arguments validate against the function's schema, streamed calls reassemble to the
non-streamed ones, a tool result round-trips through the chat template, and bad tool requests
are 400s naming the field."""

from __future__ import annotations

import concurrent.futures
import json
import re
from types import SimpleNamespace

import jsonschema
import openai
import pytest
import requests

WEATHER = {"type": "object", "required": ["city", "days"], "additionalProperties": False,
           "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
ADD = {"type": "object", "required": ["a", "b"], "additionalProperties": False,
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                      "b": {"type": "integer", "minimum": 0, "maximum": 99}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "What will the weather be in Paris?"}]


@pytest.fixture(scope="module")
def base_url(long_base_url):
    return long_base_url


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client, max_tokens=600, **kw):
    """Random weights may chain several calls: room for them, after a ~800-token prompt."""
    return client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                          max_tokens=max_tokens, **kw)


def assert_valid_calls(calls, names=("get_weather", "add")):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", [1, 2])
def test_required_tool_choice_gives_calls_whose_arguments_follow_the_schema(client, seed):
    reply = ask(client, tool_choice="required", seed=seed)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert_valid_calls(choice.message.tool_calls)


def test_a_named_function_is_the_one_called(client):
    reply = ask(client, seed=4, tool_choice={"type": "function", "function": {"name": "add"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    assert_valid_calls(choice.message.tool_calls, names=("add",))


def test_streamed_tool_calls_reassemble_to_the_unstreamed_ones(client):
    full = ask(client, tool_choice="required", seed=5, parallel_tool_calls=False)
    expected = [(c.function.name, c.function.arguments) for c in full.choices[0].message.tool_calls]
    calls, reasons = {}, []
    for chunk in ask(client, tool_choice="required", seed=5, parallel_tool_calls=False,
                     stream=True):
        if not chunk.choices:
            continue
        for delta in chunk.choices[0].delta.tool_calls or ():
            entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == expected
    assert len(expected) == 1 and reasons[-1] == "tool_calls"


def test_auto_answers_with_text_or_well_formed_calls(client):
    for seed in range(3):
        choice = ask(client, tool_choice="auto", seed=seed, max_tokens=40).choices[0]
        if choice.message.tool_calls:
            assert_valid_calls(choice.message.tool_calls)
        else:
            assert choice.finish_reason in ("stop", "length")
            assert "<tool_call>" not in (choice.message.content or "") or \
                choice.finish_reason == "length"  # a call cut short by max_tokens stays text


def test_a_tool_result_round_trips_through_the_chat_template(base_url, client):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}
    history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    reply = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                           max_tokens=5, seed=6)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    tokens = requests.post(f"{base_url}/tokenize", json={"messages": history},
                           timeout=60).json()["tokens"]
    text = requests.post(f"{base_url}/detokenize", json={"tokens": tokens}, timeout=60).json()
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
            '</tool_call>') in text["prompt"]
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response>" in text["prompt"]


@pytest.mark.parametrize("extra,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_tool_requests_are_400s_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5,
                                       extra_body=extra)
    assert error.value.body["param"].startswith(param), error.value.body


CALL_BLOCK = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)
MANY_SEEDS = range(100, 116)


def _answer(client, choice, seed, stream):
    """(content, calls, finish_reason) of one answer at temperature 1, streamed or not."""
    kw = {"tool_choice": choice, "seed": seed, "temperature": 1.0, "max_tokens": 160}
    if not stream:
        reply = ask(client, **kw).choices[0]
        return reply.message.content or "", reply.message.tool_calls or [], reply.finish_reason
    content, calls, reason = "", {}, None
    for chunk in ask(client, stream=True, **kw):
        if not chunk.choices:
            continue
        delta, reason = chunk.choices[0].delta, chunk.choices[0].finish_reason or reason
        content += delta.content or ""
        for part in delta.tool_calls or ():
            entry = calls.setdefault(part.index, {"name": "", "arguments": ""})
            entry["name"] += part.function.name or ""
            entry["arguments"] += part.function.arguments or ""
    return content, [SimpleNamespace(type="function", id="call_", function=SimpleNamespace(**c))
                     for _, c in sorted(calls.items())], reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", ["required", "named", "auto"])
def test_over_many_seeds_every_complete_call_is_a_tool_call_never_content(client, choice, stream):
    """Temperature 1 over many seeds: each complete ``<tool_call>`` block comes back in
    ``tool_calls`` with arguments strict JSON readers accept; only a call cut by ``max_tokens``
    stays content; ``required`` and a named function answer with calls unless cut."""
    tool_choice = {"type": "function", "function": {"name": "add"}} if choice == "named" else choice
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda s: _answer(client, tool_choice, s, stream), MANY_SEEDS))
    for content, calls, reason in answers:
        assert not CALL_BLOCK.search(content), content
        for call in calls:
            json.loads(call.function.arguments)  # strict: no raw control characters
        if calls:
            assert_valid_calls(calls, names=("add",) if choice == "named" else ("get_weather", "add"))
        if choice != "auto":
            assert reason == "length" or (calls and reason == "tool_calls"), (content, reason)
    assert sum(bool(calls) for _, calls, _ in answers) >= len(answers) // 2 or choice == "auto"


def test_parallel_tool_calls_unset_allows_several_calls_as_openai_does(client):
    """OpenAI's default is parallel_tool_calls true: unset, a required choice may chain calls,
    token for token as with true (the same seed, the same constraint)."""
    chained = 0
    for seed in (1, 2, 3):
        unset = ask(client, tool_choice="required", seed=seed).choices[0].message.tool_calls
        allowed = ask(client, tool_choice="required", seed=seed,
                      parallel_tool_calls=True).choices[0].message.tool_calls
        assert [(c.function.name, c.function.arguments) for c in unset] == \
            [(c.function.name, c.function.arguments) for c in allowed]
        chained += len(unset) > 1
    assert chained  # some seed chained calls: with one call only, the default is not seen
