"""The grammar that constrains tool calls, on the tiny model's tokenizer: arguments are compact
JSON that strict readers accept (single spaces between tokens, no raw control characters in
strings), in every ``tool_choice`` mode that constrains."""

from __future__ import annotations

import json

import pytest

from deployments.apis.tools import NamedToolChoice, Tool, tool_constraint
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


def accepts_xml(compiler, choice, text: str) -> bool:
    spec = tool_constraint(TOOLS, choice, parallel=True, xgrammar_format="qwen_3_coder").spec()
    return compiler.matcher(compiler.compile(spec)).accept_string(text)


def xml_call(unit: str) -> str:
    return ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            f"<parameter=unit>\n{unit}\n</parameter>\n</function>\n</tool_call>")


@pytest.mark.parametrize("choice", ["required", NAMED, "auto"])
def test_qwen3_5_xml_calls_are_constrained_to_their_own_format(compiler, choice):
    """What the constraint lets Qwen3.5 write is what its parser reads back as the call."""
    from deployments.apis.tools import QWEN3_XML, parse_tool_calls

    assert accepts_xml(compiler, choice, xml_call("c"))
    assert not accepts_xml(compiler, choice, xml_call("kelvin"))  # outside the enum
    if choice != "auto":  # (auto: text that opens no XML call is text)
        assert not accepts_xml(compiler, choice, call('{"city": "Paris", "unit": "c"}'))
    _, calls = parse_tool_calls(xml_call("c"), QWEN3_XML, {"get_weather": WEATHER})
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"})]
