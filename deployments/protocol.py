"""The OpenAI request schema nvray accepts, and its translation to engine requests.

Requests are pydantic models; fields OpenAI defines but nvray does not implement are accepted
only at their neutral value (e.g. ``n=1``, ``echo=false``) and otherwise rejected with a 400
that names them. Unknown extra fields are ignored, as OpenAI clients send many.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nvray.sampling_params import SamplingParams

TokenIds = list[int]


class UnsupportedParameter(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: running token counts in every chunk


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

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
    ignore_eos: bool = False
    min_tokens: int = 0
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None

    def check_supported(self) -> None:
        if self.n != 1:
            raise UnsupportedParameter("n", f"n={self.n} is not supported: only n=1 (parallel "
                                            "sampling has not landed yet)")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise UnsupportedParameter(name, f"{name} is not supported")
        if self.logit_bias:
            raise UnsupportedParameter("logit_bias", "logit_bias is not supported")

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        values: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": self.ignore_eos,
                                  "min_tokens": self.min_tokens, "seed": self.seed,
                                  "stop": self.stop, "stop_token_ids": self.stop_token_ids}
        for name in ("temperature", "top_p", "top_k", "min_p"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        return SamplingParams(**values)

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
        if self.echo:
            raise UnsupportedParameter("echo", "echo is not supported")
        if self.logprobs is not None:
            raise UnsupportedParameter("logprobs", "logprobs is not supported")
        if self.best_of not in (None, 1):
            raise UnsupportedParameter("best_of", "best_of > 1 is not supported")
        if self.suffix:
            raise UnsupportedParameter("suffix", "suffix is not supported")

    def prompts(self) -> list[str | TokenIds]:
        """The prompt as a list of prompts (a string, token ids, or a batch of either)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        if not p:
            raise UnsupportedParameter("prompt", "prompt is empty")
        return list(p)  # type: ignore[arg-type]


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart]

    def as_template_message(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs:
            raise UnsupportedParameter("logprobs", "logprobs is not supported")
        if self.tools:
            raise UnsupportedParameter("tools", "tools are not supported")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise UnsupportedParameter("response_format", "only response_format type 'text' "
                                                          "is supported")

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        return [m.as_template_message() for m in self.messages]
