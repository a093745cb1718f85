"""Anthropic's Messages API (``POST /v1/messages`` and ``/v1/messages/count_tokens``) on the
chat-completions machinery.

A request (``MessagesRequest``) becomes a ``ChatCompletionRequest``: ``system`` a system message;
a user turn's ``tool_result`` blocks tool messages (in their order, before its text); an
assistant turn's ``thinking`` its ``reasoning_content`` and its ``tool_use`` blocks tool calls
(``input`` as JSON arguments); ``tools`` functions (``input_schema`` their parameters);
``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` OpenAI's ``auto`` / ``required`` / a
named function / ``none`` (``disable_parallel_tool_use``: one call); ``stop_sequences`` stop
strings; ``thinking`` ``enabled`` (or ``adaptive``, ``between_tools``) / ``disabled`` the chat
template's ``enable_thinking`` (``budget_tokens`` is accepted, not enforced: ``max_tokens``
bounds thinking and answer together; ``display: omitted`` empties the thinking blocks);
``output_config.format`` (a JSON schema) a structured output through the grammar
(``effort`` accepted, changing nothing); ``temperature``, ``top_p``, ``top_k`` (no longer
in Anthropic's SDK, sent by older clients or ``extra_body``) as chat's; ``metadata.user_id`` the
request's ``user``; ``cache_control``, ``service_tier``, ``speed``, ``inference_geo``,
``diagnostics``, ``user_profile_id``, ``workspace_id`` accepted, changing nothing. So sampling, the chat template, the
reasoning and tool parsers and the tool grammar are the ones chat completions use.

The answers, whole and streamed, are ``deployments/apis/messages_format.py``'s. Image blocks are
refused by name (a 400): nvray serves text.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import Field

from deployments.apis.openai_api import ChatCompletionRequest, StrictModel, UnsupportedParameter

# Anthropic's temperature range (OpenAI's is [0, 2])
MAX_TEMPERATURE = 1.0


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # prompt caching is automatic here
    citations: list[dict[str, Any]] | None = None


class ImageBlock(StrictModel):
    type: Literal["image"]
    source: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[Union[TextBlock, ImageBlock], Field(discriminator="type")]] = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(StrictModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(StrictModel):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[Union[TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock,
                        RedactedThinkingBlock], Field(discriminator="type")]


class Message(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(StrictModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(StrictModel):
    type: Literal["enabled", "adaptive", "between_tools", "disabled"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None


class JsonOutputFormat(StrictModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(StrictModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class Metadata(StrictModel):
    user_id: str | None = None


class MessagesRequest(StrictModel):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    metadata: Metadata | None = None
    # accepted, changing nothing here: prompt caching is automatic, one speed, one tier
    cache_control: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: str | None = None
    diagnostics: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    @property
    def shows_thinking(self) -> bool:
        return self.thinking is None or self.thinking.display != "omitted"

    def to_chat(self) -> ChatCompletionRequest:
        """The same request as a chat completion (see the module docstring)."""
        if self.temperature is not None and not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise UnsupportedParameter("temperature", f"temperature={self.temperature} is "
                                       f"invalid: must be in [0, {MAX_TEMPERATURE:g}]")
        body: dict[str, Any] = {
            "model": self.model, "messages": self._chat_messages(),
            "max_tokens": self.max_tokens, "stop": self.stop_sequences,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "stream": self.stream, "user": self.metadata.user_id if self.metadata else None}
        if self.tools:
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.input_schema}}
                for t in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = self._chat_tool_choice()
            body["parallel_tool_calls"] = not self.tool_choice.disable_parallel_tool_use
        if self.thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": self.thinking.type != "disabled"}
        if self.output_config is not None and self.output_config.format is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": self.output_config.format.schema_}}
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None})

    def _chat_tool_choice(self) -> Any:
        choice = self.tool_choice
        assert choice is not None
        if choice.type == "tool":
            if not choice.name:
                raise UnsupportedParameter("tool_choice.name", "tool_choice of type 'tool' "
                                                               "needs the tool's name")
            return {"type": "function", "function": {"name": choice.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[choice.type]

    def _chat_messages(self) -> list[dict[str, Any]]:
        messages = []
        if self.system:
            messages.append({"role": "system", "content": _text_of(self.system, "system")})
        for i, message in enumerate(self.messages):
            blocks = ([TextBlock(type="text", text=message.content)]
                      if isinstance(message.content, str) else message.content)
            where = f"messages.{i}.content"
            if message.role == "user":
                messages += _user_turn(blocks, where)
            else:
                messages.append(_assistant_turn(blocks, where))
        return messages


def _text_of(blocks: str | list[Any], where: str) -> str:
    """The text of a string or of text blocks; an image block is refused by name."""
    if isinstance(blocks, str):
        return blocks
    for j, block in enumerate(blocks):
        if isinstance(block, ImageBlock):
            raise UnsupportedParameter(f"{where}.{j}", f"{where}.{j}: image blocks are not "
                                       "supported: nvray serves text")
    return "".join(b.text for b in blocks if isinstance(b, TextBlock))


def _user_turn(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """A user turn: its tool results as tool messages, then its text as a user message."""
    turn, text = [], []
    for j, block in enumerate(blocks):
        if isinstance(block, ToolResultBlock):
            turn.append({"role": "tool", "tool_call_id": block.tool_use_id,
                         "content": _text_of(block.content, f"{where}.{j}.content")})
        elif isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ImageBlock):
            _text_of([block], where)
        else:
            raise UnsupportedParameter(f"{where}.{j}", f"{where}.{j}: a user turn holds text "
                                       f"and tool_result blocks, not {block.type}")
    if text or not turn:
        turn.append({"role": "user", "content": "".join(text)})
    return turn


def _assistant_turn(blocks: list[Any], where: str) -> dict[str, Any]:
    """An assistant turn: its text, thinking (reasoning_content) and tool calls."""
    text, thinking, calls = [], [], []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thinking.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, RedactedThinkingBlock):
            continue  # another provider's encrypted thinking: nothing a template can show
        else:
            raise UnsupportedParameter(f"{where}.{j}", f"{where}.{j}: an assistant turn holds "
                                       f"text, thinking and tool_use blocks, not {block.type}")
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text or not calls
                            else None}
    if thinking:
        turn["reasoning_content"] = "".join(thinking)
    if calls:
        turn["tool_calls"] = calls
    return turn


class CountTokensRequest(MessagesRequest):
    """``POST /v1/messages/count_tokens``: a request's prompt as ``/v1/messages`` renders it
    (``max_tokens`` not needed)."""

    max_tokens: int = Field(1, ge=1)
