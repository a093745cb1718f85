"""Structured outputs over HTTP with the real openai client: ``chat.completions.parse`` with a
pydantic model, ``response_format`` json_object / json_schema, vLLM's ``structured_outputs``
and ``guided_*`` fields, streamed and not; constraints that cannot be enforced are a 400 naming
the field and the feature."""

from __future__ import annotations

import json
import logging
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


class Person(BaseModel):
    name: str = Field(pattern="^[a-z]{1,6}$")
    age: int = Field(ge=0, le=120)
    tags: list[Literal["red", "green"]] = Field(min_length=1, max_length=3)


PERSON_SCHEMA = {"type": "object", "required": ["name", "age"], "additionalProperties": False,
                 "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


def test_parse_with_a_pydantic_model_returns_the_parsed_object(client):
    for seed in range(2):
        completion = client.chat.completions.parse(model="tiny", messages=MESSAGES,
                                                   response_format=Person, max_tokens=200,
                                                   seed=seed)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Person)
        assert Person.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_mode_answers_a_json_object(client):
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=300,
                                           seed=4, response_format={"type": "json_object"})
    choice = reply.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # random weights may write a long object; what there is opens one
        assert choice.finish_reason == "length" and choice.message.content.startswith("{")


def test_a_streamed_json_schema_answer_equals_the_unstreamed_one(client):
    fmt = {"type": "json_schema",
           "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}
    full = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200,
                                          seed=5, response_format=fmt)
    text = full.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON_SCHEMA)
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200,
                                            seed=5, response_format=fmt, stream=True)
    chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(chunks) == text and len([c for c in chunks if c]) > 1


def test_vllm_fields_constrain_completions_and_chat(client):
    choice = client.completions.create(model="tiny", prompt="yes or no?", max_tokens=10, seed=6,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")
    regex = client.completions.create(model="tiny", prompt="a code", max_tokens=20, seed=7,
                                      extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}})
    assert len(regex.choices[0].text) == 6 and regex.choices[0].text[2] == "-"
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200,
                                          seed=8, extra_body={"guided_json": PERSON_SCHEMA})
    jsonschema.validate(json.loads(chat.choices[0].message.content), PERSON_SCHEMA)


@pytest.mark.parametrize("extra,param,named", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"not": {"type": "string"}}}}},
     "response_format", "keyword 'not'"),
    ({"guided_regex": "a(b"}, "guided_regex", "parenthesis"),
    ({"guided_grammar": "root ::= nowhere"}, "guided_grammar", 'Rule "nowhere"'),
    ({"structured_outputs": {"json": {"type": "strin"}}}, "structured_outputs",
     'Unsupported type "strin"'),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex", "not both"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"use_beam_search": True, "n": 2, "temperature": 0, "guided_choice": ["a"]},
     "guided_choice", "use_beam_search"),
])
def test_a_constraint_that_cannot_be_enforced_is_a_400_naming_it(client, extra, param, named):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20,
                                       extra_body=extra)
    body = error.value.body
    assert body["param"] == param or body["param"].startswith(param), body
    assert named in body["message"], body


def test_an_expected_400_is_answered_by_its_handler_with_one_log_line(caplog):
    """Starlette re-raises what a catch-all ``Exception`` handler answered (a traceback in the
    replica's log, an exception for Serve's proxy to unpickle); a 400 has its own handler. A
    real server (uvicorn on 127.0.0.1) logs an exception that escapes the app."""
    import socket
    import threading
    import time

    import requests
    import uvicorn
    from fastapi import FastAPI

    from deployments.ingress.errors import install_error_handlers
    from deployments.apis.openai_api import UnsupportedParameter

    app = FastAPI()
    install_error_handlers(app)

    @app.get("/bad")
    async def bad() -> None:
        raise UnsupportedParameter("response_format", "response_format: not this one")

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="info"))
    thread = threading.Thread(target=server.run, daemon=True)
    with caplog.at_level(logging.INFO):
        thread.start()
        for _ in range(100):
            if server.started:
                break
            time.sleep(0.05)
        reply = requests.get(f"http://127.0.0.1:{port}/bad", timeout=10)
        server.should_exit = True
        thread.join(timeout=10)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "response_format"
    ours = [r for r in caplog.records if r.name == "deployments.ingress.errors"]
    assert len(ours) == 1 and ours[0].exc_info is None
    assert not [r for r in caplog.records if r.exc_info is not None]  # nothing escaped the app
