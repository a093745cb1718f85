"""OpenAI's Responses API request (``POST /v1/responses``) on the chat-completions machinery.

A request (``ResponsesRequest``) becomes a ``ChatCompletionRequest`` (``to_chat``): its
``instructions`` a system message first (never carried over from a previous response, as
OpenAI's); then the conversation kept for ``previous_response_id`` (chat messages,
``deployments/apis/response_store.py``); then ``input``: a string is a user message; items are read
in order: ``message`` items (roles ``user``, ``system``, ``developer``, ``assistant``; text
parts ``input_text`` / ``output_text``, a ``refusal`` as its text) chat messages; a
``reasoning`` item the ``reasoning_content`` of the assistant turn after it; ``function_call``
items tool calls of the assistant turn they follow (or a turn of their own);
``function_call_output`` items tool messages. Images, files, audio, item references and the
items of hosted tools are refused by name (a 400). ``tools`` are function tools only (a hosted
tool, ``web_search`` or any other, is a 400 naming it); ``tool_choice`` ``auto`` /
``required`` / ``none`` / a named function / ``allowed_tools`` (the tools narrowed to those,
``mode`` auto or required); ``text.format`` ``json_schema`` / ``json_object`` a structured
output through the grammar; ``reasoning.effort`` ``none`` turns the chat template's thinking off
(others leave it on; ``summary`` is accepted: the reasoning comes whole, not summarised);
``max_output_tokens`` the output limit; ``temperature``, ``top_p`` and vLLM's ``top_k``,
``min_p``, ``repetition_penalty``, ``seed``, ``priority`` and ``chat_template_kwargs`` as chat's.
``store`` (default true), ``metadata``, ``user``, ``safety_identifier``, ``prompt_cache_key``,
``prompt_cache_retention``, ``prompt_cache_options``, ``service_tier``, ``include``,
``max_tool_calls`` (it bounds hosted tools' calls: none here) and ``text.verbosity`` are
accepted; ``background``, ``conversation``, ``prompt`` (stored prompts), ``truncation: auto``
and ``include: message.output_text.logprobs`` are refused by name. The answer is
``deployments/apis/responses_format.py``'s.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from deployments.apis.openai_api import ChatCompletionRequest, StrictModel, UnsupportedParameter

_SUPPORTED_TOOL = "nvray runs function tools only (type 'function')"
# the chat request's field names as a Responses client knows them
_PARAM_NAMES = {"response_format": "text.format", "max_tokens": "max_output_tokens",
                "max_completion_tokens": "max_output_tokens", "messages": "input"}


class _Item(BaseModel):
    """An input item: fields the SDK may send back from an output item are accepted."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None
    caller: dict[str, Any] | None = None
    async_: bool | None = Field(None, alias="async")


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]
    name: str | None = None
    namespace: str | None = None
    caller: dict[str, Any] | None = None


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None


_ITEMS: dict[str, type[_Item]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                  "function_call_output": FunctionCallOutputItem,
                                  "reasoning": ReasoningItem}


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    # newer SDK fields, changing nothing here
    defer_loading: bool | None = None
    output_schema: dict[str, Any] | None = None
    allowed_callers: list[str] | None = None


class TextFormat(StrictModel):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(StrictModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesStreamOptions(StrictModel):
    include_obfuscation: bool = False  # nvray pads nothing


class ResponsesRequest(StrictModel):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    # accepted, changing nothing here: one tier, prompt caching is automatic
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    priority: StrictInt = 0
    chat_template_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        refused = {"background": bool(self.background), "conversation": self.conversation,
                   "prompt": self.prompt, "truncation": self.truncation == "auto",
                   "top_logprobs": self.top_logprobs}
        for name, value in refused.items():
            if value:
                raise UnsupportedParameter(name, f"{name} is not supported: " + {
                    "background": "responses run in the foreground",
                    "conversation": "chain responses with previous_response_id",
                    "prompt": "send the prompt's text as instructions and input",
                    "truncation": "a conversation longer than the model's context is refused",
                    "top_logprobs": "log-probabilities come through chat completions"}[name])
        if "message.output_text.logprobs" in (self.include or ()):
            raise UnsupportedParameter("include", "include 'message.output_text.logprobs' is "
                                       "not supported: log-probabilities come through chat "
                                       "completions")

    # ------------------------------------------------------------ translation
    def input_messages(self) -> list[dict[str, Any]]:
        """``input`` as chat messages (see the module docstring)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        if not self.input:
            raise UnsupportedParameter("input", "input is empty")
        return _ItemReader().read(self.input)

    def input_items(self) -> list[dict[str, Any]]:
        """``input`` as the items ``GET /v1/responses/{id}/input_items`` lists: a string as a
        user message item; every item with its ``type`` and an ``id``."""
        if isinstance(self.input, str):
            return [{"id": _item_id("message"), "type": "message", "role": "user",
                     "status": "completed",
                     "content": [{"type": "input_text", "text": self.input}]}]
        items = []
        for raw in self.input:
            item = {"type": "message", **raw}
            if isinstance(item.get("content"), str) and item["type"] == "message":
                kind = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": kind, "text": item["content"]}]
            item["id"] = item.get("id") or _item_id(item["type"])
            items.append(item)
        return items

    def to_chat(self, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The same request as a chat completion over ``conversation``: the kept conversation
        that ``previous_response_id`` continues, then ``input_messages()``."""
        self.check_supported()
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions
                    else []) + conversation
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "max_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
            "seed": self.seed, "priority": self.priority, "stream": self.stream,
            "user": self.user, "parallel_tool_calls": self.parallel_tool_calls,
            "chat_template_kwargs": self._template_kwargs()}
        tools = self._function_tools()
        if tools:
            body["tools"], body["tool_choice"] = self._chat_tools(tools)
        elif self.tool_choice not in (None, "none", "auto"):
            raise UnsupportedParameter("tool_choice", f"tool_choice {self.tool_choice!r} needs "
                                                      "tools")
        if self.text is not None and self.text.format is not None:
            body["response_format"] = _response_format(self.text.format)
        try:
            return ChatCompletionRequest.model_validate(
                {k: v for k, v in body.items() if v is not None})
        except ValidationError as e:
            first = e.errors()[0]
            raise UnsupportedParameter("input", f"input: {first['msg']}") from None

    def _template_kwargs(self) -> dict[str, Any] | None:
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning is not None and self.reasoning.effort == "none":
            kwargs.setdefault("enable_thinking", False)
        return kwargs or None

    def _function_tools(self) -> list[FunctionTool]:
        tools = []
        for i, tool in enumerate(self.tools or ()):
            kind = tool.get("type")
            if kind != "function":
                raise UnsupportedParameter(f"tools.{i}.type", f"tools.{i}: the hosted tool "
                                           f"{kind!r} is not supported: {_SUPPORTED_TOOL}")
            tools.append(_validated(FunctionTool, tool, f"tools.{i}"))
        return tools

    def _chat_tools(self, tools: list[FunctionTool]) -> tuple[list[dict[str, Any]], Any]:
        """Chat's ``tools`` and ``tool_choice`` (an ``allowed_tools`` choice narrows the tools)."""
        choice: Any = self.tool_choice
        if isinstance(choice, dict):
            kind = choice.get("type")
            if kind == "function" and isinstance(choice.get("name"), str):
                choice = {"type": "function", "function": {"name": choice["name"]}}
            elif kind == "allowed_tools":
                allowed = {t.get("name") for t in choice.get("tools") or ()
                           if isinstance(t, dict) and t.get("type") == "function"}
                tools = [t for t in tools if t.name in allowed]
                if not tools:
                    raise UnsupportedParameter("tool_choice.tools", "tool_choice.tools names no "
                                               "function in tools")
                choice = choice.get("mode", "auto")
                if choice not in ("auto", "required"):
                    raise UnsupportedParameter("tool_choice.mode", "tool_choice.mode must be "
                                                                   "'auto' or 'required'")
            else:
                raise UnsupportedParameter("tool_choice", f"tool_choice {choice!r} is not "
                                           f"supported: {_SUPPORTED_TOOL}")
        chat_tools = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.parameters,
            "strict": t.strict}} for t in tools]
        return chat_tools, choice

    def chat_error(self, error: UnsupportedParameter) -> UnsupportedParameter:
        """A chat request's error, its parameter named as this request names it."""
        head, _, rest = error.param.partition(".")
        if head not in _PARAM_NAMES:
            return error
        param = _PARAM_NAMES[head] + (f".{rest}" if rest and head != "messages" else "")
        message = str(error).replace(error.param, param, 1)
        return UnsupportedParameter(param, message)


_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                "reasoning": "rs"}


def _item_id(kind: str) -> str:
    return f"{_ID_PREFIXES.get(kind, 'item')}_{uuid.uuid4().hex}"


def _validated(model: type[BaseModel], value: dict[str, Any], where: str) -> Any:
    try:
        return model.model_validate(value)
    except ValidationError as e:
        first = e.errors()[0]
        path = ".".join(str(p) for p in (where, *first["loc"]))
        raise UnsupportedParameter(path, f"{path}: {first['msg']}") from None


def _response_format(fmt: TextFormat) -> dict[str, Any]:
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    if fmt.schema_ is None:
        raise UnsupportedParameter("text.format.schema", "text.format of type 'json_schema' "
                                                         "needs a schema")
    return {"type": "json_schema", "json_schema": {
        "name": fmt.name or "output", "schema": fmt.schema_, "strict": fmt.strict,
        "description": fmt.description}}


def _part_text(parts: str | list[dict[str, Any]], where: str) -> str:
    """The text of a string or of text parts; media parts are refused by name."""
    if isinstance(parts, str):
        return parts
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            texts.append(str(part.get("text", "")))
        elif kind == "refusal":
            texts.append(str(part.get("refusal", "")))
        else:
            raise UnsupportedParameter(f"{where}.{j}", f"{where}.{j}: {kind!r} parts are not "
                                       "supported: nvray serves text")
    return "".join(texts)


class _ItemReader:
    """Input items to chat messages, in order: a reasoning item waits for its assistant turn,
    a function call joins the assistant turn it follows."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.reasoning: list[str] = []
        self.open_turn: dict[str, Any] | None = None  # an assistant turn calls may join

    def read(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, raw in enumerate(items):
            if not isinstance(raw, dict):
                raise UnsupportedParameter(f"input.{i}", f"input.{i}: an item is an object")
            kind = raw.get("type", "message")
            if kind not in _ITEMS:
                raise UnsupportedParameter(f"input.{i}.type", f"input.{i}: {kind!r} items are "
                                           "not supported: nvray reads message, reasoning, "
                                           "function_call and function_call_output items")
            getattr(self, f"_{kind}")(_validated(_ITEMS[kind], raw, f"input.{i}"), f"input.{i}")
        if self.reasoning:
            self._assistant_turn(None)
        return self.messages

    def _message(self, item: MessageItem, where: str) -> None:
        text = _part_text(item.content, f"{where}.content")
        if item.role == "assistant":
            self._assistant_turn(text)
        else:
            self.open_turn = None
            self.messages.append({"role": item.role, "content": text})

    def _reasoning(self, item: ReasoningItem, where: str) -> None:
        self.open_turn = None
        self.reasoning.append(_part_text(item.content if item.content is not None
                                         else item.summary, f"{where}.content"))

    def _function_call(self, item: FunctionCallItem, where: str) -> None:
        if self.open_turn is None or self.reasoning:
            self._assistant_turn(None)
        assert self.open_turn is not None
        self.open_turn.setdefault("tool_calls", []).append(
            {"id": item.call_id, "type": "function",
             "function": {"name": item.name, "arguments": item.arguments}})

    def _function_call_output(self, item: FunctionCallOutputItem, where: str) -> None:
        self.open_turn = None
        self.messages.append({"role": "tool", "tool_call_id": item.call_id,
                              "content": _part_text(item.output, f"{where}.output")})

    def _assistant_turn(self, text: str | None) -> None:
        turn: dict[str, Any] = {"role": "assistant", "content": text or ""}
        if self.reasoning:
            turn["reasoning_content"] = "".join(self.reasoning)
            self.reasoning = []
        self.messages.append(turn)
        self.open_turn = turn

