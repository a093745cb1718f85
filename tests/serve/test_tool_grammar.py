"""The grammar that constrains tool calls, on the tiny model's tokenizer: arguments are compact
JSON that strict readers accept (single spaces between tokens, no raw control characters in
strings), in every ``tool_choice`` mode that constrains."""

from __future__ import annotations

import json

import pytest

from deployments.tools import NamedToolChoice, Tool, tool_constraint
from nvray.grammar import grammar_compiler
from nvray.models.tiny import tiny_model_path

WEATHER = {"type": "object", "required": ["city", "unit"],
           "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}}
TOOLS = [Tool.model_validate({"type": "function",
                              "function": {"name": "get_weather", "parameters": WEATHER}})]
NAMED = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}})


def call(arguments: str) -> str:
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'


@pytest.fixture(scope="module")
def compiler():
    path = tiny_model_path()
    with open(f"{path}/config.json") as f:
        return grammar_compiler(path, json.load(f)["vocab_size"])


def accepts(compiler, choice, text: str) -> bool:
    grammar = compiler.compile(tool_constraint(TOOLS, choice, parallel=True).spec())
    matcher = compiler.matcher(grammar)
    return matcher.accept_string(text)


@pytest.mark.parametrize("choice", ["required", NAMED, "auto"])
def test_compact_arguments_are_accepted(compiler, choice):
    assert accepts(compiler, choice, call('{"city": "P\\u0005aris", "unit": "c"}'))


@pytest.mark.parametrize("choice", ["required", NAMED, "auto"])
@pytest.mark.parametrize("arguments", [
    '{"city": "P\x05aris", "unit": "c"}',      # a raw control character: json.loads refuses it
    '{"city"\n: "Paris", "unit": "c"}',         # whitespace other than one space between tokens
    '{"city":\r"Paris", "unit": "c"}',
    '{\t"city": "Paris", "unit": "c"}',
    '{"city": "Paris", "unit": "c", "x": 1}',  # a property the schema does not list
])
def test_arguments_that_strict_json_readers_refuse_or_that_break_the_schema_are_not(
        compiler, choice, arguments):
    assert not accepts(compiler, choice, call(arguments))


def accepts_llama(compiler, choice, text: str) -> bool:
    spec = tool_constraint(TOOLS, choice, parallel=True, xgrammar_format="llama").spec()
    return compiler.matcher(compiler.compile(spec)).accept_string(text)


@pytest.mark.parametrize("choice", ["required", NAMED, "auto"])
def test_llama_json_calls_are_constrained_to_their_own_format(compiler, choice):
    llama = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'
    assert accepts_llama(compiler, choice, llama)
    assert not accepts_llama(compiler, choice, call('{"city": "Paris", "unit": "c"}'))
    assert not accepts_llama(compiler, choice, llama.replace('"c"', '"kelvin"'))
