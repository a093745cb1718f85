"""OpenAI response bodies and SSE chunks built from nvray RequestOutputs.

A streamed chunk carries one choice's delta, which may hold several tokens when the client
reads slower than the engine steps; with ``stream_options.continuous_usage_stats`` (vLLM's
extension) each chunk also carries that choice's running token counts."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from nvray.outputs import RequestOutput

DONE = "data: [DONE]\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_of(outputs: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(o.token_ids) for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def with_usage(chunk: dict[str, Any], usage: dict[str, int] | None) -> dict[str, Any]:
    """A streamed chunk, with the running token counts when the client asked for them."""
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class CompletionFormat:
    """/v1/completions bodies."""

    def __init__(self, model: str) -> None:
        self.model, self.id, self.created = model, new_id("cmpl"), int(time.time())

    def full(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices = [{"index": i, "text": o.text, "logprobs": None, "finish_reason": o.finish_reason}
                   for i, o in enumerate(outputs)]
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices, "usage": usage_of(outputs)}

    def chunk(self, index: int, out: RequestOutput,
              usage: dict[str, int] | None = None) -> dict[str, Any]:
        choice = {"index": index, "text": out.delta_text, "logprobs": None,
                  "finish_reason": out.finish_reason if out.finished else None}
        return with_usage({"id": self.id, "object": "text_completion", "created": self.created,
                           "model": self.model, "choices": [choice]}, usage)

    def usage_chunk(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": [], "usage": usage_of(outputs)}

    def first_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        return []


class ChatFormat:
    """/v1/chat/completions bodies."""

    def __init__(self, model: str) -> None:
        self.model, self.id, self.created = model, new_id("chatcmpl"), int(time.time())

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices = [{"index": i, "message": {"role": "assistant", "content": o.text},
                    "logprobs": None, "finish_reason": o.finish_reason}
                   for i, o in enumerate(outputs)]
        return {**self._envelope("chat.completion"), "choices": choices, "usage": usage_of(outputs)}

    def first_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        return [{**self._envelope("chat.completion.chunk"),
                 "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}]}
                for i in range(num_choices)]

    def chunk(self, index: int, out: RequestOutput,
              usage: dict[str, int] | None = None) -> dict[str, Any]:
        delta = {"content": out.delta_text} if out.delta_text or not out.finished else {}
        choice = {"index": index, "delta": delta, "logprobs": None,
                  "finish_reason": out.finish_reason if out.finished else None}
        return with_usage({**self._envelope("chat.completion.chunk"), "choices": [choice]}, usage)

    def usage_chunk(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        return {**self._envelope("chat.completion.chunk"), "choices": [], "usage": usage_of(outputs)}
