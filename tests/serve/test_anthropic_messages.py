"""Anthropic's Messages API with the real ``anthropic`` client, against an app whose model is
scripted to think then answer (``serve_helpers.build_scripted_thinker``) behind an API key sent
as ``x-api-key``: text with a system prompt, thinking blocks, stop sequences and ``max_tokens``;
an output format (JSON schema) and omitted thinking; a stream whose events reassemble to the same
message; tools with ``tool_choice`` ``any`` and a
named tool (inputs valid against the schema, streamed as ``input_json_delta``); a tool result
sent back; ``count_tokens`` equal to the prompt's tokens; errors in Anthropic's shape; langchain's
``ChatAnthropic`` pointed at the app."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
import requests
from serve_helpers import (CONTENT, PICK_SCHEMA, REASONING, SYSTEM, THINKER_KEY, THINKER_MODEL,
                           USER)

MODEL, KEY = THINKER_MODEL, THINKER_KEY
THINK = {"type": "enabled", "budget_tokens": 1024}
PICK = {"name": "pick", "description": "Pick a digit", "input_schema": PICK_SCHEMA}


@pytest.fixture(scope="module")
def messages_url(thinker_url) -> str:
    return thinker_url


@pytest.fixture(scope="module")
def claude(messages_url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=messages_url, api_key=KEY, max_retries=0, timeout=120)


GREEDY = {"temperature": 0}  # not in Anthropic's SDK any more: sent as older clients send it


def _ask(**extra) -> dict:
    return dict(model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": USER}],
                max_tokens=64, extra_body=GREEDY, thinking=THINK, **extra)


def test_a_message_with_thinking_then_text(claude):
    message = claude.messages.create(**_ask())
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert (message.content[0].thinking, message.content[1].text) == (REASONING, CONTENT)
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.role == "assistant" and message.model == MODEL
    assert message.usage.output_tokens > 0
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == \
        claude.messages.count_tokens(model=MODEL, system=SYSTEM, thinking=THINK,
                                     messages=[{"role": "user", "content": USER}]).input_tokens


def test_stop_sequences_and_max_tokens_end_the_message(claude):
    stopped = claude.messages.create(**_ask(stop_sequences=["world", "zebra"]))
    assert stopped.content[-1].text == "Hello "
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "world")
    cut = claude.messages.create(**{**_ask(), "max_tokens": 2})
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2


def test_an_output_format_and_omitted_thinking(claude):
    """``output_config.format`` constrains the text to the schema (the grammar path); thinking
    with ``display: omitted`` comes as empty thinking blocks."""
    shaped = claude.messages.create(**{**_ask(), "max_tokens": 160,
                                       "thinking": {"type": "disabled"},
                                       "output_config": {"format": {"type": "json_schema",
                                                                    "schema": PICK_SCHEMA}}})
    [text] = [b for b in shaped.content if b.type == "text"]
    jsonschema.validate(json.loads(text.text), PICK_SCHEMA)
    hidden = claude.messages.create(**{**_ask(), "thinking": {**THINK, "display": "omitted"}})
    assert [(b.type, getattr(b, "thinking", None)) for b in hidden.content][0] == ("thinking", "")
    assert hidden.content[-1].text == CONTENT


def test_a_stream_reassembles_to_the_message(claude):
    whole = claude.messages.create(**_ask())
    with claude.messages.stream(**_ask()) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]
    assert streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 2


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "pick"}])
def test_a_required_tool_call_is_a_tool_use_block_valid_for_its_schema(claude, choice):
    asked = _ask(tools=[PICK], tool_choice={**choice, "disable_parallel_tool_use": True})
    message = claude.messages.create(**{**asked, "max_tokens": 160})
    assert message.stop_reason == "tool_use"
    calls = [b for b in message.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "pick" and calls[0].id
    jsonschema.validate(calls[0].input, PICK_SCHEMA)
    with claude.messages.stream(**{**asked, "max_tokens": 160}) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert "input_json_delta" in deltas
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [calls[0].input]


def test_a_tool_result_goes_back_to_the_model(claude):
    history = [{"role": "user", "content": USER},
               {"role": "assistant", "content": [
                   {"type": "thinking", "thinking": REASONING, "signature": ""},
                   {"type": "tool_use", "id": "toolu_1", "name": "pick", "input": {"n": 3}}]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": "toolu_1", "content": "3"},
                   {"type": "text", "text": "Thanks"}]}]
    message = claude.messages.create(model=MODEL, system=SYSTEM, messages=history, tools=[PICK],
                                     max_tokens=4, extra_body=GREEDY)
    assert message.stop_reason in ("end_turn", "max_tokens", "tool_use")
    counted = claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=history,
                                           tools=[PICK]).input_tokens
    alone = claude.messages.count_tokens(model=MODEL, system=SYSTEM,
                                         messages=history[:1]).input_tokens
    assert counted > alone  # the tools, the call and its result are in the prompt


def test_errors_come_in_anthropics_shape(claude, messages_url):
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(**{**_ask(), "model": "claude-unknown"})
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as image:
        claude.messages.create(**{**_ask(), "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}]}]})
    assert "messages.0.content.0" in image.value.body["error"]["message"]
    assert "image" in image.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="temperature"):
        claude.messages.create(**{**_ask(), "extra_body": {"temperature": 1.5}})
    # the ends of Anthropic's range are served: 1.0 is its clients' default
    for edge in (0.0, 1.0):
        message = claude.messages.create(**{**_ask(), "extra_body": {"temperature": edge}})
        assert message.stop_reason in ("end_turn", "max_tokens"), message
    plain = {k: v for k, v in _ask().items() if k != "extra_body"}
    no_key = requests.post(f"{messages_url}/v1/messages", json=plain, timeout=60)
    assert no_key.status_code == 401
    assert no_key.json()["type"] == "error"
    assert no_key.json()["error"]["type"] == "authentication_error"
    unknown = requests.post(f"{messages_url}/v1/messages", json={**plain, "colour": "red"},
                            headers={"x-api-key": KEY}, timeout=60)
    assert unknown.status_code == 400 and "colour" in unknown.json()["error"]["message"]


def test_langchains_chat_anthropic_invokes_and_binds_tools(messages_url):
    langchain_anthropic = pytest.importorskip("langchain_anthropic")
    chat = langchain_anthropic.ChatAnthropic(model=MODEL, base_url=messages_url, api_key=KEY,
                                             max_tokens=160, max_retries=0, timeout=120,
                                             thinking=THINK, model_kwargs={"extra_body": GREEDY})
    answer = chat.invoke([("system", SYSTEM), ("human", USER)])
    assert answer.text == CONTENT
    plain = langchain_anthropic.ChatAnthropic(  # a forced tool choice goes without thinking
        model=MODEL, base_url=messages_url, api_key=KEY, max_tokens=160, max_retries=0,
        timeout=120, model_kwargs={"extra_body": GREEDY})
    called = plain.bind_tools([PICK], tool_choice="pick").invoke([("system", SYSTEM),
                                                                 ("human", USER)])
    [call] = called.tool_calls
    assert call["name"] == "pick"
    jsonschema.validate(call["args"], PICK_SCHEMA)
