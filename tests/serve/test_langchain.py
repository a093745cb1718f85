"""langchain-openai against the app, as agent frameworks use it: ``with_structured_output``
(json_schema, json_mode and function_calling) returns parsed objects, and ``bind_tools`` +
``invoke`` returns tool calls whose arguments follow their schema."""

from __future__ import annotations

import jsonschema
import pytest
from pydantic import BaseModel, Field

langchain_openai = pytest.importorskip("langchain_openai")


class City(BaseModel):
    """A city and its rank."""

    name: str = Field(pattern="^[A-Z][a-z]{1,8}$")
    rank: int = Field(ge=1, le=9)


@pytest.fixture(scope="module")
def chat(long_base_url):
    return langchain_openai.ChatOpenAI(model="tiny", base_url=f"{long_base_url}/v1", api_key="unused",
                                       max_tokens=600, temperature=1.0, seed=3, max_retries=0,
                                       timeout=120)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_returns_the_parsed_model(chat, method):
    structured = chat.with_structured_output(City, method=method)
    result = structured.invoke("Name a city.")
    assert isinstance(result, City)


def test_json_mode_returns_a_dict(chat):
    structured = chat.with_structured_output(method="json_mode")
    result = structured.invoke("Answer with a JSON object.")
    assert isinstance(result, dict)


def test_bind_tools_and_invoke_give_calls_that_follow_the_schema(chat):
    def lookup_city(name: str, rank: int) -> str:
        """Look a city up by its name and rank."""
        return name

    message = chat.bind_tools([City, lookup_city], tool_choice="any").invoke("Find Paris.")
    assert message.tool_calls
    for call in message.tool_calls:
        assert call["name"] in ("City", "lookup_city")
        if call["name"] == "City":
            City.model_validate(call["args"])
        else:
            jsonschema.validate(call["args"], {"type": "object", "required": ["name", "rank"]})
