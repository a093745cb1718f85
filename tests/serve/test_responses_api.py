"""OpenAI's Responses API with the real ``openai`` client, against the "thinker" app (its model
is scripted to think then answer; ``serve_helpers.build_scripted_thinker``): reasoning and
message items with token counts equal to ``/tokenize``'s; the output limit ending a response
as incomplete; a stream whose events reassemble to the same response; a JSON-schema text
format; function tools with a required and a named choice (arguments valid against the
schema), a function call's output sent back; ``previous_response_id`` replaying the
conversation; stored responses read and deleted; errors for hosted tools, media and unknown
ids; langchain-openai's Responses mode. (The store shared by two replicas: test_prefix_routing.)
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import requests
from serve_helpers import (CONTENT, PICK_SCHEMA, REASONING, SYSTEM, THINKER_KEY, THINKER_MODEL,
                           USER)

PICK = {"type": "function", "name": "pick", "description": "Pick a digit",
        "parameters": PICK_SCHEMA}
HEADERS = {"Authorization": f"Bearer {THINKER_KEY}"}


@pytest.fixture(scope="module")
def client(thinker_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{thinker_url}/v1", api_key=THINKER_KEY, max_retries=0,
                         timeout=120)


def _ask(**extra) -> dict:
    return {"model": THINKER_MODEL, "instructions": SYSTEM, "input": USER, "temperature": 0,
            "max_output_tokens": 64, **extra}


def _count(url: str, **body) -> int:
    answer = requests.post(f"{url}/tokenize", json=body, headers=HEADERS, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["count"]


def test_a_response_with_reasoning_then_text(client, thinker_url):
    response = client.responses.create(**_ask())
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert [c.text for c in response.output[0].content] == [REASONING]
    assert response.output_text == CONTENT
    assert response.status == "completed" and response.model == THINKER_MODEL
    prompt = _count(thinker_url, messages=[{"role": "system", "content": SYSTEM},
                                           {"role": "user", "content": USER}])
    assert response.usage.input_tokens == prompt
    thought = _count(thinker_url, prompt=f"<think>{REASONING}</think>")
    assert response.usage.output_tokens_details.reasoning_tokens == thought
    answer = _count(thinker_url, prompt=CONTENT)
    assert response.usage.output_tokens == thought + answer + 1  # and the end of the turn
    cut = client.responses.create(**_ask(max_output_tokens=2))
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 2


def test_a_stream_reassembles_to_the_response(client):
    whole = client.responses.create(**_ask())
    with client.responses.stream(**_ask()) as stream:
        events = list(stream)
        streamed = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == CONTENT
    assert "".join(e.delta for e in events
                   if e.type == "response.reasoning_text.delta") == REASONING
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done")
    assert streamed.output_text == whole.output_text
    assert [i.model_dump(exclude={"id"}, exclude_none=True) for i in streamed.output] == \
        [i.model_dump(exclude={"id"}, exclude_none=True) for i in whole.output]
    assert streamed.usage == whole.usage
    assert client.responses.retrieve(streamed.id).output_text == CONTENT  # kept when it ended


def test_a_json_schema_text_format(client):
    shaped = client.responses.create(**_ask(
        max_output_tokens=160, reasoning={"effort": "none"},
        text={"format": {"type": "json_schema", "name": "pick", "schema": PICK_SCHEMA,
                         "strict": True}}))
    jsonschema.validate(json.loads(shaped.output_text), PICK_SCHEMA)
    assert [item.type for item in shaped.output] == ["message"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "pick"}])
def test_a_required_function_call_is_valid_for_its_schema(client, choice):
    asked = _ask(tools=[PICK], tool_choice=choice, parallel_tool_calls=False,
                 max_output_tokens=160)
    response = client.responses.create(**asked)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "pick" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), PICK_SCHEMA)
    with client.responses.stream(**asked) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    assert [i.arguments for i in streamed.output if i.type == "function_call"] == \
        [calls[0].arguments]


def test_allowed_tools_narrows_the_tools_the_model_sees_and_may_call(client):
    """An ``allowed_tools`` choice: the model is shown (the prompt, counted in usage) and may
    call only the tools it names, as if the others were not given."""
    other = {**PICK, "name": "choose", "description": "Choose a digit instead"}
    narrowed = client.responses.create(**_ask(
        tools=[PICK, other], max_output_tokens=160, parallel_tool_calls=False,
        tool_choice={"type": "allowed_tools", "mode": "required",
                     "tools": [{"type": "function", "name": "choose"}]}))
    alone = client.responses.create(**_ask(tools=[other], tool_choice="required",
                                           max_output_tokens=160, parallel_tool_calls=False))
    both = client.responses.create(**_ask(tools=[PICK, other], tool_choice="required",
                                          max_output_tokens=16, parallel_tool_calls=False))
    assert narrowed.usage.input_tokens == alone.usage.input_tokens < both.usage.input_tokens
    calls = [item for item in narrowed.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["choose"]
    assert [(c.name, c.arguments) for c in calls] == \
        [(i.name, i.arguments) for i in alone.output if i.type == "function_call"]


def test_a_function_calls_output_goes_back_to_the_model(client):
    first = client.responses.create(**_ask(tools=[PICK], tool_choice="required",
                                           max_output_tokens=160))
    [call] = [item for item in first.output if item.type == "function_call"]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "3"}
    replayed = client.responses.create(**_ask(
        tools=[PICK], max_output_tokens=4,
        input=[{"role": "user", "content": USER}, *[i.model_dump() for i in first.output],
               output]))
    chained = client.responses.create(**_ask(tools=[PICK], max_output_tokens=4, input=[output],
                                             previous_response_id=first.id))
    # the same conversation either way: the user turn, the call and its output
    assert replayed.usage.input_tokens == chained.usage.input_tokens > first.usage.input_tokens


def test_previous_response_id_replays_the_conversation(client, thinker_url):
    first = client.responses.create(**_ask())
    again = client.responses.create(**_ask(input="Again", previous_response_id=first.id,
                                           max_output_tokens=2))
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER},
               {"role": "assistant", "content": CONTENT, "reasoning_content": REASONING},
               {"role": "user", "content": "Again"}]
    assert again.usage.input_tokens == _count(thinker_url, messages=history)
    assert again.previous_response_id == first.id


def test_stored_responses_are_read_and_deleted(client):
    response = client.responses.create(**_ask())
    assert client.responses.retrieve(response.id).output_text == CONTENT
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    unstored = client.responses.create(**_ask(store=False))
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as unknown:
        client.responses.create(**_ask(previous_response_id=unstored.id))
    assert unknown.value.body["param"] == "previous_response_id"


def test_a_stored_responses_input_items_are_listed(client):
    """``input_items``: the response's own input (not the conversation before it), as items,
    newest first by default, paged."""
    first = client.responses.create(**_ask())
    items = [{"role": "user", "content": "Again"},
             {"role": "user", "content": [{"type": "input_text", "text": "and again"}]}]
    second = client.responses.create(**_ask(input=items, previous_response_id=first.id,
                                            max_output_tokens=2))
    listed = client.responses.input_items.list(second.id, order="asc")
    assert [(i.type, i.role, [c.text for c in i.content]) for i in listed.data] == \
        [("message", "user", ["Again"]), ("message", "user", ["and again"])]
    newest = client.responses.input_items.list(second.id, limit=1)
    assert [c.text for c in newest.data[0].content] == ["and again"] and newest.has_more
    rest = client.responses.input_items.list(second.id, limit=5, after=newest.data[0].id)
    assert [c.text for c in rest.data[0].content] == ["Again"] and not rest.has_more
    only = client.responses.input_items.list(first.id)
    assert [[c.text for c in i.content] for i in only.data] == [[USER]]


def test_what_nvray_does_not_serve_is_refused_by_name(client, thinker_url):
    with pytest.raises(openai.BadRequestError) as hosted:
        client.responses.create(**_ask(tools=[{"type": "web_search"}]))
    assert "web_search" in hosted.value.body["message"]
    with pytest.raises(openai.BadRequestError) as image:
        client.responses.create(**_ask(input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/a.png"}]}]))
    assert image.value.body["param"] == "input.0.content.0"
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.create(**_ask(background=True))
    no_key = requests.post(f"{thinker_url}/v1/responses", json=_ask(), timeout=60)
    assert no_key.status_code == 401
    unknown = requests.post(f"{thinker_url}/v1/responses", json={**_ask(), "colour": "red"},
                            headers=HEADERS, timeout=60)
    assert unknown.status_code == 400 and "colour" in unknown.json()["error"]["message"]


def test_langchains_responses_mode_invokes_and_binds_tools(thinker_url):
    langchain_openai = pytest.importorskip("langchain_openai")
    chat = langchain_openai.ChatOpenAI(model=THINKER_MODEL, base_url=f"{thinker_url}/v1",
                                       api_key=THINKER_KEY, use_responses_api=True,
                                       temperature=0, max_tokens=160, max_retries=0,
                                       timeout=120)
    answer = chat.invoke([("system", SYSTEM), ("human", USER)])
    assert answer.text == CONTENT
    called = chat.bind_tools([PICK], tool_choice="pick").invoke([("system", SYSTEM),
                                                                ("human", USER)])
    [call] = called.tool_calls
    assert call["name"] == "pick"
    jsonschema.validate(call["args"], PICK_SCHEMA)
