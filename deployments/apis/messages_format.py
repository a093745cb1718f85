"""Anthropic's Messages API answers (``/v1/messages``), whole or streamed, from the chat
format's parsed output (``ChatFormat``: reasoning and tool parsers).

The answer (``MessagesFormat``): content blocks in order: ``thinking`` (what the reasoning
parser split off, whenever the model thought), ``text``, ``tool_use`` (each parsed call, its
``input`` the parsed arguments); ``stop_reason`` ``tool_use`` (it ended after calls),
``max_tokens``, ``stop_sequence`` (with the string) or ``end_turn``; ``usage`` with
``input_tokens`` (those not served from the prefix cache), ``cache_read_input_tokens`` and
``output_tokens``. Streamed, the same as Anthropic's events: ``message_start``, ``ping``, per
block ``content_block_start`` / ``content_block_delta`` (``thinking_delta``, ``text_delta``,
``input_json_delta``) / ``content_block_stop``, then ``message_delta`` (stop reason, output
tokens) and ``message_stop``; a failure mid-stream is an ``error`` event. Errors on these routes
come in Anthropic's shape (``deployments/ingress/errors.py``).
"""

from __future__ import annotations

import json
from typing import Any

from deployments.apis.openai_format import ChatFormat, new_id
from nvray.outputs import RequestOutput


def _stop_reason(out: RequestOutput, called: bool) -> tuple[str, str | None]:
    """Anthropic's stop reason (and stop sequence) of a finished output."""
    if out.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(out.stop_reason, str):
        return "stop_sequence", out.stop_reason
    return "end_turn", None


def _usage(out: RequestOutput) -> dict[str, int]:
    prompt, cached = len(out.prompt_token_ids), out.num_cached_tokens
    return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": len(out.token_ids)}


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"] or "{}")}


def _event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"


class MessagesFormat:
    """A /v1/messages answer, whole or as Anthropic's events (one per response: it keeps the
    stream's open block). Streams through the server's SSE loop as the chat formats do: its
    ``first_chunks``, ``chunk`` and ``sse`` give already encoded events."""

    done = ""  # no [DONE] line: message_stop ends the stream

    def __init__(self, chat: ChatFormat, show_thinking: bool = True) -> None:
        self.chat = chat
        self.show_thinking = show_thinking  # thinking.display "omitted": empty thinking blocks
        self.id = new_id("msg").replace("-", "_")
        self.block: str | None = None  # the open content block's type
        self.num_blocks = 0
        self.num_calls = 0

    def _message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
                 usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.chat.model,
                "content": content, "stop_reason": stop[0], "stop_sequence": stop[1],
                "usage": usage}

    def full(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        out = outputs[0]
        message = self.chat.message(out.text)
        content: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            content.append({"type": "thinking", "signature": "",
                            "thinking": message["reasoning_content"] if self.show_thinking
                            else ""})
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        calls = message.get("tool_calls") or []
        content += [_tool_use(call) for call in calls]
        return self._message(content, _stop_reason(out, bool(calls)), _usage(out))

    # ----------------------------------------------------------- streaming
    def first_chunks(self, num_choices: int, prompt_tokens: list[int] | None = None
                     ) -> list[str]:
        usage = {"input_tokens": (prompt_tokens or [0])[0], "cache_creation_input_tokens": 0,
                 "cache_read_input_tokens": 0, "output_tokens": 0}
        return [_event("message_start", message=self._message([], (None, None), usage))
                + _event("ping")]

    def sse(self, chunk: str) -> str:
        return chunk

    def chunk(self, index: int, out: RequestOutput,
              usage: dict[str, int] | None = None) -> str | None:
        delta = self.chat.delta(index, out)
        events = []
        if delta.get("reasoning_content"):
            events += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            if self.show_thinking:
                events.append(self._delta({"type": "thinking_delta",
                                           "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            events += self._open("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or ():
            events += self._open("tool_use", {**_tool_use(call), "input": {}}, always=True)
            events.append(self._delta({"type": "input_json_delta",
                                       "partial_json": call["function"]["arguments"] or "{}"}))
            self.num_calls += 1
        if out.finished:
            events += self._close()
            stop = _stop_reason(out, self.num_calls > 0)
            events.append(_event("message_delta",
                                 delta={"stop_reason": stop[0], "stop_sequence": stop[1]},
                                 usage={"output_tokens": len(out.token_ids)}))
            events.append(_event("message_stop"))
        return "".join(events) or None

    def _open(self, kind: str, block: dict[str, Any], always: bool = False) -> list[str]:
        """Events that end the open block and start one of ``kind`` (unless it is open and
        may go on: a tool call is a block of its own)."""
        if self.block == kind and not always:
            return []
        events = self._close()
        self.block = kind
        events.append(_event("content_block_start", index=self.num_blocks, content_block=block))
        return events

    def _close(self) -> list[str]:
        if self.block is None:
            return []
        self.block = None
        self.num_blocks += 1
        return [_event("content_block_stop", index=self.num_blocks - 1)]

    def _delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", index=self.num_blocks, delta=delta)

    def usage_chunk(self, outputs: list[RequestOutput]) -> str:
        return ""

    def error_event(self, error: Any) -> str:
        return error.anthropic_sse()
