"""The OpenAI request schema nvray accepts, and its translation to engine requests.

Requests are pydantic models; fields OpenAI defines but nvray does not implement are accepted
only at their neutral value (e.g. ``best_of=1``, no ``suffix``, no ``tools``) and otherwise
rejected with a 400 that names them. Besides OpenAI's, vLLM's extensions are accepted:
``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``allowed_token_ids``, ``bad_words``, ``use_beam_search`` (``n`` is the beam
width) with ``length_penalty``, ``priority`` and ``chat_template_kwargs``; and nvray's
``speculate``. Structured outputs
come from OpenAI's ``response_format`` (``json_object``, ``json_schema`` with ``strict``) or
vLLM's ``structured_outputs`` object and its older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` fields (one of them per request). Unknown fields are rejected too (``extra="forbid"``: a 400 whose ``param``
names them), never silently dropped: a field nvray accepts is listed here, harmless ones that
OpenAI clients send included (``user``, ``stream_options``, ``parallel_tool_calls``, a message's
``name``). Also the bodies of ``/tokenize`` and ``/detokenize`` (vLLM's shapes).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from nvray.chat_template import ChatPrompt
from nvray.sampling_params import MAX_LOGPROBS, BeamSearchParams, SamplingParams
from nvray.structured_outputs import ResponseFormat, StructuredOutputsParams

from deployments.apis.tools import (NamedToolChoice, Tool, ToolChoice, template_tools,
                                    tool_constraint)

TokenIds = list[int]
# OpenAI's range for temperature, which its API refuses above (vLLM's HTTP API takes any value
# >= 0); the Python SamplingParams takes up to 100
MAX_HTTP_TEMPERATURE = 2


class UnsupportedParameter(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple:
        return UnsupportedParameter, (self.param, str(self))


class StrictModel(BaseModel):
    """A request body (or part of one) that rejects fields it does not list."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: running token counts in every chunk
    include_obfuscation: bool = False  # OpenAI's SDK may send it; nvray pads nothing


class SamplingFields(StrictModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    speculate: bool = True  # nvray: False decodes a token a step in a speculating engine
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    priority: StrictInt = 0  # lower runs first under the app's scheduling_policy="priority"
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def check_supported(self) -> None:
        if self.temperature is not None and not 0 <= self.temperature <= MAX_HTTP_TEMPERATURE:
            raise UnsupportedParameter("temperature", f"temperature={self.temperature} is "
                                       f"invalid: must be in [0, {MAX_HTTP_TEMPERATURE}]")
        if self.use_beam_search:
            self._check_beam_search()
            if self._constraint_fields():
                raise UnsupportedParameter(self._constraint_fields()[0], "structured outputs "
                                           "do not apply to use_beam_search")

    def _constraint_fields(self) -> list[str]:
        named = [name for name in ("structured_outputs", "guided_json", "guided_regex",
                                   "guided_choice", "guided_grammar")
                 if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            named.insert(0, "response_format")
        return named

    def constraint(self, reasoning: bool = False, tool_format: str = "qwen_3"
                   ) -> StructuredOutputsParams | None:
        """What the output must follow, from whichever field gave it (at most one); a
        structured output applies from the first token, think block or not."""
        named = self._constraint_fields()
        if not named:
            return None
        if len(named) > 1:
            raise UnsupportedParameter(named[1], f"give one of {' or '.join(named)}, not both")
        field = named[0]
        try:
            if field == "response_format":
                return self.response_format.constraint()  # type: ignore[union-attr]
            if field == "structured_outputs":
                return StructuredOutputsParams.coerce(self.structured_outputs, field)
            kind = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                    "guided_grammar": "grammar"}[field]
            return StructuredOutputsParams(**{kind: getattr(self, field)}, origin=field)
        except ValueError as e:
            raise UnsupportedParameter(field, str(e)) from None

    def _check_beam_search(self) -> None:
        """Beam search ranks beams by the raw log-probabilities: sampling fields don't apply."""
        widest = MAX_LOGPROBS // 2
        if not 1 <= self.n <= widest:
            raise UnsupportedParameter("n", f"n={self.n} is invalid: with use_beam_search n is "
                                            f"the beam width, in [1, {widest}]")
        if self.stream:
            raise UnsupportedParameter("stream", "use_beam_search returns the best beams at the "
                                                 "end: stream must be false")
        for name in ("top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words",
                     "stop", "stop_token_ids"):
            if getattr(self, name) not in (None, [], {}):
                raise UnsupportedParameter(name, f"{name} does not apply to use_beam_search")
        if self.temperature not in (None, 0, 0.0):
            raise UnsupportedParameter("temperature", "use_beam_search needs temperature 0 "
                                                      "(or none)")
        if self.min_tokens:
            raise UnsupportedParameter("min_tokens", "min_tokens does not apply to "
                                                     "use_beam_search")

    def report_logprobs(self) -> int | None:
        """Top log-probabilities per output token to report (None: none)."""
        return None

    def sampling_params(self, max_tokens: int | None, prompt_logprobs: int | None = None,
                        reasoning: bool = False, tool_format: str = "qwen_3"
                        ) -> SamplingParams | BeamSearchParams:
        """``reasoning``: the answer may open with a think block that the app's reasoning
        parser takes apart (tool calls are constrained after it); ``tool_format``: the
        xgrammar name of the model's tool-call format (``deployments/apis/tools.py``)."""
        if self.use_beam_search:
            return self.beam_search_params(max_tokens)
        values: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": self.ignore_eos,
                                  "min_tokens": self.min_tokens, "seed": self.seed,
                                  "stop": self.stop, "stop_token_ids": self.stop_token_ids,
                                  "n": self.n, "logit_bias": self.logit_bias,
                                  "allowed_token_ids": self.allowed_token_ids,
                                  "bad_words": self.bad_words,
                                  "logprobs": self.report_logprobs(),
                                  "prompt_logprobs": prompt_logprobs,
                                  "structured_outputs": self.constraint(reasoning, tool_format),
                                  "speculate": self.speculate}
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        return SamplingParams(**values)

    def beam_search_params(self, max_tokens: int | None) -> BeamSearchParams:
        if max_tokens is None:
            raise UnsupportedParameter("max_tokens", "use_beam_search needs max_tokens")
        return BeamSearchParams(beam_width=self.n, max_tokens=max_tokens,
                                ignore_eos=self.ignore_eos, length_penalty=self.length_penalty)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream and self.stream_options
                    and self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens == 0 and not self.echo:
            raise UnsupportedParameter("max_tokens", "max_tokens=0 generates nothing: it is only "
                                                     "valid with echo (to score the prompt)")
        if self.use_beam_search and (self.echo or self.logprobs is not None):
            raise UnsupportedParameter("echo" if self.echo else "logprobs",
                                       "use_beam_search reports no log-probabilities or echo")
        if self.best_of not in (None, 1):
            raise UnsupportedParameter("best_of", "best_of > 1 is not supported")
        if self.suffix:
            raise UnsupportedParameter("suffix", "suffix is not supported")

    def report_logprobs(self) -> int | None:
        return self.logprobs

    def completion_params(self) -> SamplingParams | BeamSearchParams:
        """With ``echo`` and ``logprobs``, the prompt tokens are scored too."""
        return self.sampling_params(self.max_tokens, self.logprobs if self.echo else None)

    def prompts(self) -> list[str | TokenIds]:
        """The prompt as a list of prompts (a string, token ids, or a batch of either)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        if not p:
            raise UnsupportedParameter("prompt", "prompt is empty")
        return list(p)  # type: ignore[arg-type]


class ContentPart(StrictModel):
    type: Literal["text"]
    text: str


class ToolCallFunction(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class MessageToolCall(StrictModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None  # None: an assistant turn of tool calls
    # passed to the chat template when given (Qwen3's reads reasoning_content of past turns)
    name: str | None = None
    reasoning_content: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[MessageToolCall] | None = None

    def as_template_message(self, index: int = 0) -> dict[str, Any]:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise UnsupportedParameter(f"messages.{index}.content",
                                       f"messages.{index}.content: a {self.role} message needs "
                                       "content (only an assistant's tool calls may come without)")
        content = self.content or ""
        text = content if isinstance(content, str) else "".join(p.text for p in content)
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": text}
        for name in ("name", "reasoning_content", "tool_call_id"):
            if getattr(self, name) is not None:
                message[name] = getattr(self, name)
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return message


class ChatTemplateFields(StrictModel):
    """How messages become a prompt: shared by chat completions and ``/tokenize``."""

    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}

    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool = True
                    ) -> ChatPrompt:
        return ChatPrompt([m.as_template_message(i) for i, m in enumerate(messages)],
                          dict(self.chat_template_kwargs or {}), add_generation_prompt)


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, "none" without
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.output_limit() == 0:
            raise UnsupportedParameter("max_tokens", "max_tokens must be at least 1")
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedParameter("top_logprobs", "top_logprobs needs logprobs: true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise UnsupportedParameter("top_logprobs", f"top_logprobs={self.top_logprobs} is "
                                                       f"invalid: must be in [0, {MAX_LOGPROBS}]")
        if self.use_beam_search and self.logprobs:
            raise UnsupportedParameter("logprobs", "use_beam_search reports no log-probabilities")
        self._check_tools()

    def _check_tools(self) -> None:
        choice = self.effective_tool_choice
        if choice != "none" and not self.tools:
            raise UnsupportedParameter("tool_choice", f"tool_choice {_choice_name(choice)!r} "
                                                      "needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {
                t.function.name for t in self.tools or ()}:
            raise UnsupportedParameter("tool_choice", f"tool_choice names the function "
                                       f"{choice.function.name!r}, which is not in tools")
        if choice != "none" and self.use_beam_search:
            raise UnsupportedParameter("tools", "tools do not apply to use_beam_search")

    @property
    def effective_tool_choice(self) -> ToolChoice:
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def calls_tools(self) -> bool:
        """Whether the answer may hold tool calls (parsed into ``tool_calls``)."""
        return bool(self.tools) and self.effective_tool_choice != "none"

    def tool_schemas(self) -> dict[str, dict[str, Any]]:
        """Each tool's parameters schema by function name (XML calls' values are typed by it)."""
        return {t.function.name: t.function.parameters or {} for t in self.tools or []}

    @property
    def thinks(self) -> bool:
        """Whether the prompt leaves the model free to think (Qwen3's ``enable_thinking``)."""
        return (self.chat_template_kwargs or {}).get("enable_thinking") is not False

    def constraint(self, reasoning: bool = False, tool_format: str = "qwen_3"
                   ) -> StructuredOutputsParams | None:
        if not self.calls_tools:
            return super().constraint()
        if self._constraint_fields():
            raise UnsupportedParameter(self._constraint_fields()[0],
                                       "give tools or a structured output, not both")
        return tool_constraint(self.tools or [], self.effective_tool_choice,
                               self.parallel_tool_calls is not False, reasoning and self.thinks,
                               tool_format)

    def report_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def prompt(self) -> ChatPrompt:
        prompt = self.chat_prompt(self.messages)
        if not self.calls_tools:
            return prompt
        return dataclasses.replace(prompt, tools=template_tools(self.tools or []))


class TokenizeRequest(ChatTemplateFields):
    """``POST /tokenize``: exactly one of ``prompt`` (text) or ``messages`` (a chat)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True

    def to_tokenize(self) -> str | ChatPrompt:
        if (self.prompt is None) == (self.messages is None):
            raise UnsupportedParameter("prompt", "give exactly one of prompt (a string) or "
                                                 "messages (a chat)")
        if self.messages is None:
            return self.prompt  # type: ignore[return-value]
        return self.chat_prompt(self.messages, self.add_generation_prompt)


class DetokenizeRequest(StrictModel):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[StrictInt]


def _choice_name(choice: ToolChoice) -> str:
    return choice if isinstance(choice, str) else f"function {choice.function.name}"


class LoadLoRARequest(StrictModel):
    """``POST /v1/load_lora_adapter`` (vLLM's)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRARequest(StrictModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's; ``lora_int_id`` is accepted and unused)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None
