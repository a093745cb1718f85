"""A model family other than Qwen3 served over HTTP by ``serve run``'s app (Llama 3's layout,
HF-written random weights), with the real openai client: ``/v1/models`` names its architecture,
chat works through the checkpoint's template, and tool calls come back as ``tool_calls`` in
Llama 3.1's JSON format (the parser the architecture picks; the grammar keeps the calls
well-formed), streamed or not; an app args' ``hf_overrides`` reach the engine. Qwen3.5 (a
hybrid) the same way in its XML call format, and an image part is refused naming it."""

from __future__ import annotations

import json

import openai
import pytest
import requests
from ray import serve

from deployments import build_app

WEATHER = {"type": "object", "required": ["city"], "additionalProperties": False,
           "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def required_calls(client: openai.OpenAI, model: str, stream: bool, max_tokens: int
                   ) -> tuple[list, str]:
    """The tool calls and finish reason of a ``tool_choice="required"`` weather request,
    streamed (the deltas' calls, the last finish reason) or not."""
    kwargs = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                  max_tokens=max_tokens, seed=3, parallel_tool_calls=False)
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.tool_calls, choice.finish_reason
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    calls = [c for chunk in chunks for choice in chunk.choices
             for c in (choice.delta.tool_calls or [])]
    return calls, [choice.finish_reason for chunk in chunks for choice in chunk.choices][-1]


@pytest.fixture(scope="module")
def llama_url(serve_http, family_path):
    path = family_path("llama3-tied")
    serve.run(build_app({"model": path, "served_model_name": "llama", "num_cpus_per_rank": 0.5,
                         "hf_overrides": '{"max_position_embeddings": 2048}'}),
              name="llama", route_prefix="/llama")
    try:
        yield f"{serve_http}/llama"
    finally:
        serve.delete("llama")


@pytest.fixture(scope="module")
def client(llama_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{llama_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_model_card_names_the_architecture(client):
    [card] = client.models.list().data
    assert card.id == "llama"
    assert card.model_dump()["architecture"] == "LlamaForCausalLM"
    # the checkpoint says 1,024 positions; hf_overrides (a JSON string, as on the command line)
    # reached the engine: its default max_model_len is the overridden length
    assert card.model_dump()["max_model_len"] == 2048


def test_chat_without_tools_answers_text(client):
    reply = client.chat.completions.create(model="llama", messages=MESSAGES, max_tokens=8,
                                           temperature=0)
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_calls_come_back_in_llama_json_format_as_tool_calls(client, stream):
    calls, finish = required_calls(client, "llama", stream, max_tokens=120)
    assert finish == "tool_calls"
    assert [c.function.name for c in calls] == ["get_weather"]
    import jsonschema
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)


def test_a_length_past_the_overridden_one_is_refused(llama_url):
    resp = requests.post(f"{llama_url}/v1/completions", timeout=60, json={
        "model": "llama", "prompt": "hi", "max_tokens": 2100})
    assert resp.status_code == 400, resp.text


@pytest.fixture(scope="module")
def qwen3_5_url(serve_http, family_path):
    path = family_path("qwen3_5")
    serve.run(build_app({"model": path, "served_model_name": "qwen35", "num_cpus_per_rank": 0.5,
                         "max_model_len": 1024}), name="qwen35", route_prefix="/qwen35")
    try:
        yield f"{serve_http}/qwen35"
    finally:
        serve.delete("qwen35")


@pytest.mark.parametrize("stream", [False, True])
def test_qwen3_5_tool_calls_come_back_from_its_xml_format(qwen3_5_url, stream):
    """Qwen3.5 writes calls as <tool_call><function=...><parameter=...>: the architecture picks
    that parser (and the grammar that format), and the calls come back as ``tool_calls``."""
    client = openai.OpenAI(base_url=f"{qwen3_5_url}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    calls, finish = required_calls(client, "qwen35", stream, max_tokens=300)
    assert finish == "tool_calls"
    assert [c.function.name for c in calls] == ["get_weather"]
    import jsonschema
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)


def test_an_image_part_is_refused_naming_it(qwen3_5_url):
    resp = requests.post(f"{qwen3_5_url}/v1/chat/completions", timeout=60, json={
        "model": "qwen35", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "http://127.0.0.1/a.png"}}]}]})
    assert resp.status_code == 400, resp.text
    assert "image_url" in resp.json()["error"]["message"]
