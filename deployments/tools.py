"""Tool calling: OpenAI's ``tools`` / ``tool_choice`` in, Qwen3's ``<tool_call>`` blocks out.

Request side: ``Tool`` and ``NamedToolChoice`` (OpenAI's shapes); ``tool_constraint`` turns
``tool_choice`` into the structural tag that constrains the output (xgrammar's ``qwen_3``
format): ``required`` (calls separated by newlines, nothing else) and a named function make the
output one or more well-formed calls whose
arguments follow the function's ``parameters`` schema; ``auto`` leaves text free until the model
opens ``<tool_call>``, and from there the call is constrained too, so a started call is never
malformed; ``none`` constrains nothing (and the tools are not rendered).

Response side: ``ToolCallStream`` finds ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
blocks in the text, incrementally: ``feed(delta)`` returns the content outside blocks that is
certain so far and the calls whose blocks closed; ``finish()`` the rest. Whitespace next to a
block is dropped; a block whose JSON is malformed, or that never closes, stays content (never
dropped). ``parse_tool_calls(text)`` is the same parser fed once, so a streamed answer
reassembles to the non-streamed one wherever the chunks were split.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

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
                    reasoning: bool = False) -> StructuredOutputsParams | None:
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
        "qwen_3", tools=template_tools(tools),
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


def _call_of(body: str) -> dict[str, Any] | None:
    """A call's OpenAI form from a block's JSON (None when it is not a call)."""
    try:  # strict=False: a raw control character in a string is read, and escaped on output
        value = json.loads(body, strict=False)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", {})
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"],
                         "arguments": args if isinstance(args, str)
                         else json.dumps(args, ensure_ascii=False)}}


class ToolCallStream:
    def __init__(self) -> None:
        self.buf = ""  # text not yet resolved: a block in progress or a possible OPEN prefix
        self.held = ""  # whitespace that goes out only if content (not a block) follows
        self.after_block = False  # whitespace right after a call is dropped
        self.num_calls = 0

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        self.buf += delta
        content, calls = [], []
        while True:
            if not self.buf.startswith(OPEN):
                start = self.buf.find(OPEN)
                cut = start if start >= 0 else len(self.buf) - _open_prefix_len(self.buf)
                content.append(self._outside(self.buf[:cut]))
                self.buf = self.buf[cut:]
                if start < 0:
                    break
                continue
            end = self.buf.find(CLOSE)
            if end < 0:
                break  # the block is still being written
            block, self.buf = self.buf[:end + len(CLOSE)], self.buf[end + len(CLOSE):]
            call = _call_of(block[len(OPEN):-len(CLOSE)])
            if call is None:  # malformed: it stays content
                content.append(self._outside(block))
                continue
            self.held, self.after_block = "", True
            self.num_calls += 1
            calls.append(call)
        return "".join(content), calls

    def finish(self) -> str:
        """The rest: an unclosed block or a partial ``<tool_call`` is content."""
        rest = self._outside(self.buf) + self.held
        self.buf = self.held = ""
        return rest

    def _outside(self, text: str) -> str:
        """Content outside blocks: what can go out now; trailing whitespace is held."""
        if self.after_block:
            text = text.lstrip()
            if not text:
                return ""
            self.after_block = False
        body = text.rstrip()
        if not body:
            self.held += text
            return ""
        out, self.held = self.held + body, text[len(body):]
        return out


def _open_prefix_len(text: str) -> int:
    """Length of the longest suffix of ``text`` that begins ``<tool_call>``."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, calls) of a whole answer; content is None when only calls were made."""
    stream = ToolCallStream()
    content, calls = stream.feed(text)
    content += stream.finish()
    return (content or None) if calls else content, calls
