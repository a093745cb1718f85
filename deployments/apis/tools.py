"""Tool calling: OpenAI's ``tools`` / ``tool_choice`` in, the model family's calls out:
Hermes/Qwen ``<tool_call>`` blocks of JSON (``HERMES``), Qwen3.5's ``<tool_call>`` blocks of XML
(``QWEN3_XML``: ``<function=NAME>`` then ``<parameter=KEY>VALUE</parameter>`` each, a value
read as its parameter's schema type says) or Llama 3.1's JSON objects (``LLAMA3_JSON``:
``{"name": ..., "parameters": {...}}``, after ``<|python_tag|>`` or not, ``;``-separated);
``tool_parser_for`` picks the app's (``tool_call_parser``, default by architecture).

Request side: ``Tool`` and ``NamedToolChoice`` (OpenAI's shapes); ``tool_constraint`` turns
``tool_choice`` into the structural tag that constrains the output (xgrammar's ``qwen_3``
format, or ``llama``): ``required`` (calls separated by newlines, nothing else) and a named function make the
output one or more well-formed calls whose
arguments follow the function's ``parameters`` schema; ``auto`` leaves text free until the model
opens ``<tool_call>``, and from there the call is constrained too, so a started call is never
malformed; ``none`` constrains nothing (and the tools are not rendered).

Response side: ``ToolCallStream`` finds ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
blocks in the text, incrementally: ``feed(delta)`` returns the content outside blocks that is
certain so far and the calls whose blocks closed; ``finish()`` the rest (content, calls). Whitespace next to a
block is dropped; a block whose JSON is malformed, or that never closes, stays content (never
dropped). ``parse_tool_calls(text)`` is the same parser fed once, so a streamed answer
reassembles to the non-streamed one wherever the chunks were split.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nvray.architectures import ARCHITECTURES
from nvray.structured_outputs import StructuredOutputsParams, canonical_schema

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: ToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def template_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """The tools as the chat template renders them (OpenAI's shape, unset fields left out)."""
    return [t.model_dump(exclude_none=True) for t in tools]


def tool_constraint(tools: list[Tool], choice: ToolChoice, parallel: bool,
                    reasoning: bool = False, xgrammar_format: str = "qwen_3"
                    ) -> StructuredOutputsParams | None:
    """The structural tag that keeps calls well-formed (None for ``tool_choice="none"``).
    ``reasoning``: a Qwen3 think block (``<think>...</think>`` then a blank line) may come first,
    unconstrained inside, and the calls (or text) after it."""
    if choice == "none":
        return None
    import xgrammar as xgr  # noqa: PLC0415 - the first request with tools loads it

    for i, tool in enumerate(tools):  # what xgrammar would not enforce is refused, by name
        if tool.function.parameters is not None:
            canonical_schema(tool.function.parameters, f"tools.{i}.function.parameters")

    tag = xgr.get_model_structural_tag(
        xgrammar_format, tools=template_tools(tools),
        tool_choice=choice if isinstance(choice, str) else choice.model_dump(),
        reasoning="auto" if reasoning else "disabled", parallel_tool_calls=parallel)
    spec = _compact_arguments(tag.model_dump(mode="json"), xgr)
    if choice == "required":  # calls only: no free text before, between or after them
        parent, key = (spec["format"]["elements"], -1) if reasoning else (spec, "format")
        calls = parent[key]["tags"]
        parent[key] = {"type": "tags_with_separator", "tags": calls, "separator": "\n",
                       "at_least_one": True, "stop_after_first": not parallel}
    return StructuredOutputsParams(structural_tag=spec, origin="tools")


def _compact_arguments(node: Any, xgr: Any) -> Any:
    """``node`` with each call's arguments (a ``json_schema`` format) as the grammar of compact
    JSON: ``", "`` and ``": "`` between tokens, no other whitespace, and strings without raw
    control characters, as ``response_format`` JSON is generated. xgrammar's own JSON format
    in a structural tag lets any whitespace character (``\\r``, ``\\n``, ``\\t``) stand
    between tokens."""
    if isinstance(node, list):
        return [_compact_arguments(value, xgr) for value in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and node.get("style", "json") == "json":
        schema = json.dumps(node["json_schema"])
        grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
        return {"type": "grammar", "grammar": str(grammar)}
    return {key: _compact_arguments(value, xgr) for key, value in node.items()}


def _openai_call(value: Any) -> dict[str, Any] | None:
    """A call's OpenAI form from a decoded block (None when it is not a call): a ``name`` and
    its ``arguments`` (Hermes/Qwen) or ``parameters`` (Llama 3.1)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"],
                         "arguments": args if isinstance(args, str)
                         else json.dumps(args, ensure_ascii=False)}}


def _call_of(body: str) -> dict[str, Any] | None:
    """A call's OpenAI form from a block's JSON (None when it is not a call)."""
    try:  # strict=False: a raw control character in a string is read, and escaped on output
        value = json.loads(body, strict=False)
    except json.JSONDecodeError:
        return None
    return _openai_call(value)


class ToolCallStream:
    """The incremental parser (module docstring) of Hermes/Qwen ``<tool_call>`` blocks; a
    subclass finds another format's blocks (``_block_start`` / ``_block_end``)."""

    separators = ""  # characters dropped between a call and what follows, besides whitespace

    def __init__(self, schemas: dict[str, dict[str, Any]] | None = None) -> None:
        self.schemas = schemas or {}  # each function's parameters schema (the XML format's)
        self.buf = ""  # text not yet resolved: a block in progress or a possible block start
        self.held = ""  # whitespace that goes out only if content (not a block) follows
        self.after_block = False  # whitespace right after a call is dropped
        self.num_calls = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        self.buf += delta
        content, calls = [], []
        while self.buf:
            start, hold = self._block_start(self.buf)
            if start != 0:
                cut = start if start > 0 else (len(self.buf) if final else hold)
                content.append(self._outside(self.buf[:cut]))
                self.buf = self.buf[cut:]
                if start < 0:
                    break
                continue
            end, call = self._block_end(self.buf, final)
            if end is None:
                break  # the block is still being written
            block, self.buf = self.buf[:end], self.buf[end:]
            if call is None:  # malformed: it stays content
                content.append(self._outside(block))
                continue
            self.held, self.after_block = "", True
            self.num_calls += 1
            calls.append(call)
        return "".join(content), calls

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The rest: blocks that end with the text, and content (an unclosed block, a partial
        start)."""
        content, calls = self.feed("", final=True)
        rest = content + self._outside(self.buf) + self.held
        self.buf = self.held = ""
        return rest, calls

    def _block_start(self, buf: str) -> tuple[int, int]:
        """(where the next block starts, -1: none; where a block may be starting: text from
        there is held)."""
        return buf.find(OPEN), len(buf) - _open_prefix_len(buf)

    def _block_end(self, buf: str, final: bool) -> tuple[int | None, dict[str, Any] | None]:
        """(the end of the block at the start of ``buf``, None: not written yet; its call, None:
        malformed). ``final``: nothing more comes."""
        end = buf.find(CLOSE)
        if end < 0:
            return (len(buf), None) if final else (None, None)
        return end + len(CLOSE), self._call(buf[len(OPEN):end])

    def _call(self, body: str) -> dict[str, Any] | None:
        """A block's call (None: malformed)."""
        return _call_of(body)

    def _outside(self, text: str) -> str:
        """Content outside blocks: what can go out now; trailing whitespace is held."""
        if self.after_block:
            text = text.lstrip(" \t\r\n" + self.separators)
            if not text:
                return ""
            self.after_block = False
        body = text.rstrip()
        if not body:
            self.held += text
            return ""
        out, self.held = self.held + body, text[len(body):]
        return out


_XML_CALL = re.compile(r"\s*<function=([^>\n]+)>\n?(.*?)\n?</function>\s*", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


class XmlToolCallStream(ToolCallStream):
    """Qwen3.5's calls: ``<tool_call>`` blocks holding ``<function=NAME>`` and its
    ``<parameter=KEY>VALUE</parameter>`` (whitespace around each value dropped); a block that
    holds anything else is malformed (it stays content)."""

    def _call(self, body: str) -> dict[str, Any] | None:
        return _xml_call(body, self.schemas)


def _xml_call(body: str, schemas: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    found = _XML_CALL.fullmatch(body)
    if found is None:
        return None
    name, inner = found.group(1).strip(), found.group(2)
    properties = (schemas.get(name) or {}).get("properties") or {}
    arguments, at = {}, 0
    for parameter in _XML_PARAMETER.finditer(inner):
        if inner[at:parameter.start()].strip():
            return None  # text between parameters: not a call
        key = parameter.group(1).strip()
        arguments[key] = _xml_value(parameter.group(2), properties.get(key))
        at = parameter.end()
    if inner[at:].strip():
        return None
    return _openai_call({"name": name, "arguments": arguments})


def _xml_value(text: str, schema: Any) -> Any:
    """A parameter's text as its schema's type: a string as written (also where the schema
    names no type, or the parameter is unknown); a number, boolean, null, object or array from
    its JSON, or as written where it is not valid JSON. Whitespace around a value is the
    format's (the template's newlines; the grammar lets a model put more there), not the
    value's."""
    text = text.strip()
    types = schema.get("type") if isinstance(schema, dict) else None
    types = [types] if isinstance(types, str) else list(types or [])
    if not types or "string" in types:
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


_PYTHON_TAG = "<|python_tag|>"
_JSON_CALL = re.compile(r'(?:<\|python_tag\|>\s*)?\{\s*"name"\s*:')
_DECODER = json.JSONDecoder(strict=False)


class JsonToolCallStream(ToolCallStream):
    """Llama 3.1's JSON tool calls: ``{"name": ..., "parameters": {...}}`` objects in the text
    (after ``<|python_tag|>`` or not, several separated by ``;`` or newlines). A call is
    complete when its object is: a stream gives it then."""

    separators = ";"

    def _block_start(self, buf: str) -> tuple[int, int]:
        found = _JSON_CALL.search(buf)
        if found is not None:
            return found.start(), found.start()
        starts = [i for i in (buf.rfind("<|"), buf.rfind("{")) if i >= 0]
        held = [i for i in sorted(starts) if _could_begin_call(buf[i:])]
        return -1, held[0] if held else len(buf)

    def _block_end(self, buf: str, final: bool) -> tuple[int | None, dict[str, Any] | None]:
        brace = buf.index("{")
        try:
            value, end = _DECODER.raw_decode(buf, brace)
        except json.JSONDecodeError:
            # not complete yet; at the end, the opening brace is content and the search goes on
            return (brace + 1, None) if final else (None, None)
        return end, _openai_call(value)


def _could_begin_call(tail: str) -> bool:
    """Whether more text could make ``tail`` (from a ``<|`` or ``{``) the start of a call."""
    if tail.startswith("<|"):
        if len(tail) <= len(_PYTHON_TAG) or not tail.startswith(_PYTHON_TAG):
            return _PYTHON_TAG.startswith(tail)
        tail = tail[len(_PYTHON_TAG):].lstrip()
        if not tail:
            return True
    if not tail.startswith("{"):
        return False
    rest = tail[1:].lstrip()
    if len(rest) <= len('"name"'):
        return '"name"'.startswith(rest)
    return rest.startswith('"name"') and not rest[len('"name"'):].strip()


def _open_prefix_len(text: str) -> int:
    """Length of the longest suffix of ``text`` that begins ``<tool_call>``."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def parse_tool_calls(text: str, parser: "ToolParser | None" = None,
                     schemas: dict[str, dict[str, Any]] | None = None
                     ) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, calls) of a whole answer; content is None when only calls were made."""
    stream = (parser or HERMES).stream(schemas)
    content, calls = stream.feed(text)
    rest, last = stream.finish()
    content, calls = content + rest, calls + last
    return (content or None) if calls else content, calls


@dataclass(frozen=True)
class ToolParser:
    """A model family's tool-call format: how xgrammar names it (the constraint) and the
    parser of its answers."""

    name: str
    xgrammar_format: str
    stream_class: type[ToolCallStream]

    def stream(self, schemas: dict[str, dict[str, Any]] | None = None) -> ToolCallStream:
        """A parser of one answer; ``schemas``: each function's parameters schema."""
        return self.stream_class(schemas)


HERMES = ToolParser("hermes", "qwen_3", ToolCallStream)
QWEN3_XML = ToolParser("qwen3_xml", "qwen_3_coder", XmlToolCallStream)
LLAMA3_JSON = ToolParser("llama3_json", "llama", JsonToolCallStream)
TOOL_PARSERS = {p.name: p for p in (HERMES, QWEN3_XML, LLAMA3_JSON)}
def tool_parser_for(name: str | None, architecture: str) -> ToolParser:
    """The app's ``tool_call_parser``, or (None) the architecture's: Llama 3.x's JSON calls,
    Qwen3.5's XML calls, Hermes ``<tool_call>`` blocks for the others (Qwen's)."""
    known = ARCHITECTURES.get(architecture)  # what its chat template asks its model to write
    return TOOL_PARSERS[name or (known.tool_call_format if known is not None else "hermes")]
