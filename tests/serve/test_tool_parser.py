"""The tool-call parser on crafted answers: calls, text around them, malformed blocks kept as
content, and the streamed parse equal to the whole one at every split."""

from __future__ import annotations

import json

import pytest

from deployments.apis.tools import QWEN3_XML, ToolCallStream, parse_tool_calls

CALL_A = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_B = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, 3]}}\n</tool_call>'
ANSWERS = [
    "plain text, no call at all",
    CALL_A,
    CALL_A + "\n" + CALL_B,
    "Let me check.\n" + CALL_A + "\n\nDone.",
    'Bad: <tool_call>\n{"name": "x", "arguments": {oops}\n</tool_call> then ' + CALL_B,
    "an unclosed <tool_call>\n{\"name\": \"x\"",
    "a <tool_c that is not one, and <tool_call> words </tool_call>",
    "  spaces around  ",
]


def streamed(stream: ToolCallStream, pieces: list[str]) -> tuple[str, list]:
    """(content, calls) of an answer fed to ``stream`` piece by piece, then finished."""
    content, calls = "", []
    for piece in pieces:
        part, new = stream.feed(piece)
        content, calls = content + part, calls + new
    rest, last = stream.finish()
    return content + rest, calls + last


def names(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_calls_become_openai_tool_calls_and_the_text_around_stays_content():
    content, calls = parse_tool_calls(CALL_A + "\n" + CALL_B)
    assert content is None
    assert names(calls) == [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": [2, 3]})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    content, calls = parse_tool_calls("Let me check.\n" + CALL_A + "\n\nDone.")
    assert content == "Let me check.Done." and names(calls) == [("get_weather", {"city": "Paris"})]


def test_malformed_and_unclosed_blocks_are_left_as_content_never_dropped():
    text = 'Bad: <tool_call>\n{"name": "x", "arguments": {oops}\n</tool_call> then ' + CALL_B
    content, calls = parse_tool_calls(text)
    assert names(calls) == [("add", {"a": 1, "b": [2, 3]})]
    assert content == 'Bad: <tool_call>\n{"name": "x", "arguments": {oops}\n</tool_call> then'
    unclosed = "an unclosed <tool_call>\n{\"name\": \"x\""
    assert parse_tool_calls(unclosed) == (unclosed, [])
    not_a_call = "a <tool_c that is not one, and <tool_call> words </tool_call>"
    assert parse_tool_calls(not_a_call) == (not_a_call, [])
    assert parse_tool_calls("  spaces around  ") == ("  spaces around  ", [])


@pytest.mark.parametrize("text", ANSWERS)
def test_a_streamed_answer_split_anywhere_parses_as_the_whole_one(text):
    whole_content, whole_calls = parse_tool_calls(text)
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], list(text) if cut == 0 else None):
            if pieces is None:
                continue
            content, calls = streamed(ToolCallStream(), pieces)
            assert names(calls) == names(whole_calls), (text, cut)
            assert (content or None if calls else content) == whole_content, (text, cut)


def test_a_raw_control_character_in_an_argument_is_read_and_escaped_not_left_as_content():
    raw = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "q\x05z\ty"}}\n</tool_call>'
    content, calls = parse_tool_calls(raw + "\n" + CALL_B)
    assert content is None
    assert names(calls) == [("get_weather", {"city": "q\x05z\ty"}), ("add", {"a": 1, "b": [2, 3]})]
    assert "\x05" not in calls[0]["function"]["arguments"]  # escaped: strict JSON readers take it


def test_complete_calls_before_a_cut_one_are_calls_and_only_the_cut_one_is_content():
    cut = '<tool_call>\n{"name": "add", "arguments": {"a": 1'
    content, calls = parse_tool_calls(CALL_A + "\n" + CALL_B + "\n" + cut)
    assert names(calls) == [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": [2, 3]})]
    assert content == cut


# ----------------------------------------------------------------- Llama 3.1's JSON calls
from deployments.apis.tools import HERMES, LLAMA3_JSON, tool_parser_for  # noqa: E402

LLAMA_A = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_B = '{"name": "get_time", "parameters": {"zone": "UTC"}}'


def llama_parse(text: str):
    return parse_tool_calls(text, LLAMA3_JSON)


@pytest.mark.parametrize("text, content, calls", [
    (LLAMA_A, None, [("get_weather", {"city": "Paris"})]),
    ("<|python_tag|>" + LLAMA_A, None, [("get_weather", {"city": "Paris"})]),
    (LLAMA_A + "; " + LLAMA_B, None, [("get_weather", {"city": "Paris"}),
                                      ("get_time", {"zone": "UTC"})]),
    (LLAMA_A + "\n" + LLAMA_B, None, [("get_weather", {"city": "Paris"}),
                                      ("get_time", {"zone": "UTC"})]),
    ("Let me check. " + LLAMA_A, "Let me check.", [("get_weather", {"city": "Paris"})]),
    ('{"name": "f", "arguments": {"x": 1}}', None, [("f", {"x": 1})]),
    ('The answer is {"a": 1}.', 'The answer is {"a": 1}.', []),
    ('{"name": "get_weather", "parameters": {"city": ', '{"name": "get_weather", "parameters": {"city": ', []),
    ('{"name": 3}', '{"name": 3}', []),
    ("Paris, {in} brief { \"na", "Paris, {in} brief { \"na", []),
])
def test_llama_json_calls_are_parsed(text, content, calls):
    got_content, got_calls = llama_parse(text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls


@pytest.mark.parametrize("text", [LLAMA_A + "; " + LLAMA_B, "Hi { there. " + LLAMA_A,
                                  '{"name": "x", "parameters": {"s": "}{"}} tail'])
def test_llama_json_calls_stream_to_what_the_whole_answer_gives(text):
    whole_content, whole_calls = llama_parse(text)
    for cut in range(len(text) + 1):
        content, calls = streamed(LLAMA3_JSON.stream(), [text[:cut], text[cut:]])
        assert [c["function"] for c in calls] == [c["function"] for c in whole_calls], cut
        assert (content or None if calls else content) == whole_content, cut


def test_the_parser_follows_the_architecture_unless_the_app_names_one():
    assert tool_parser_for(None, "LlamaForCausalLM") is LLAMA3_JSON
    assert tool_parser_for(None, "Qwen3_5ForConditionalGeneration") is QWEN3_XML
    assert tool_parser_for(None, "Qwen3_5MoeForCausalLM") is QWEN3_XML
    assert tool_parser_for(None, "Qwen3ForCausalLM") is HERMES
    assert tool_parser_for("hermes", "LlamaForCausalLM") is HERMES
    assert tool_parser_for("llama3_json", "Qwen3ForCausalLM") is LLAMA3_JSON


# Qwen3.5's XML calls, as its chat template writes them
XML_A = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
XML_B = ("<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n[2, 3]\n"
         "</parameter>\n<parameter=note>\n42\n</parameter>\n</function>\n</tool_call>")
XML_SCHEMAS = {"get_weather": {"type": "object", "properties": {
                   "city": {"type": "string"}, "days": {"type": "integer"}}},
               "add": {"type": "object", "properties": {
                   "a": {"type": "number"}, "b": {"type": "array"}, "note": {"type": "string"}}}}
XML_ANSWERS = [
    XML_A,
    "Checking.\n" + XML_A + "\n" + XML_B + "\nDone.",
    "<tool_call>\n<function=add>\nstray text\n<parameter=a>\n1\n</parameter>\n</function>\n"
    "</tool_call> then " + XML_A,
    "<tool_call>\n<function=add>\n<parameter=a>\n1\n",
]


def test_qwen3_5_xml_calls_take_their_parameters_types_from_the_schema():
    content, calls = parse_tool_calls("Checking.\n" + XML_A + "\n" + XML_B + "\nDone.",
                                      QWEN3_XML, XML_SCHEMAS)
    assert content == "Checking.Done."
    # a string parameter stays a string even where it reads as a number; others are JSON
    assert names(calls) == [("get_weather", {"city": "Paris", "days": 3}),
                            ("add", {"a": 1, "b": [2, 3], "note": "42"})]
    # without the function's schema every value is the text written
    assert names(parse_tool_calls(XML_A, QWEN3_XML)[1]) == [("get_weather",
                                                             {"city": "Paris", "days": "3"})]


def test_qwen3_5_xml_blocks_with_other_text_or_unclosed_stay_content():
    malformed, unclosed = XML_ANSWERS[2], XML_ANSWERS[3]
    content, calls = parse_tool_calls(malformed, QWEN3_XML, XML_SCHEMAS)
    assert names(calls) == [("get_weather", {"city": "Paris", "days": 3})]
    assert content == malformed[:malformed.index(" then") + len(" then")]
    assert parse_tool_calls(unclosed, QWEN3_XML, XML_SCHEMAS) == (unclosed, [])
    # and a Hermes JSON block is no XML call
    assert parse_tool_calls(CALL_A, QWEN3_XML) == (CALL_A, [])


@pytest.mark.parametrize("text", XML_ANSWERS)
def test_a_streamed_xml_answer_split_anywhere_parses_as_the_whole_one(text):
    whole_content, whole_calls = parse_tool_calls(text, QWEN3_XML, XML_SCHEMAS)
    for cut in range(len(text) + 1):
        content, calls = streamed(QWEN3_XML.stream(XML_SCHEMAS), [text[:cut], text[cut:]])
        assert names(calls) == names(whole_calls), (text, cut)
        assert (content or None if calls else content) == whole_content, (text, cut)
