"""OpenAI's Responses API answers (``/v1/responses``), whole or streamed, from the chat
format's parsed output (``ChatFormat``: reasoning and tool parsers).

A response's ``output`` holds items in order: a ``reasoning`` item (what the reasoning parser
split off, as ``reasoning_text`` content; no summary), a ``message`` item (its text as one
``output_text`` part), a ``function_call`` item per parsed call (``call_id``, ``name``,
``arguments`` as JSON text). ``status`` is ``completed``, or ``incomplete`` with
``incomplete_details.reason`` ``max_output_tokens`` when the output limit cut it. ``usage`` has
``input_tokens`` (with ``input_tokens_details.cached_tokens``, those served from the prefix
cache), ``output_tokens`` (with ``output_tokens_details.reasoning_tokens``: the tokens up to
the end of the think block) and ``total_tokens``; the request's settings are echoed as OpenAI
echoes them.

Streamed, OpenAI's events, each with its ``sequence_number``: ``response.created``,
``response.in_progress``; per item ``response.output_item.added``, then for a message
``response.content_part.added``, ``response.output_text.delta`` …, ``response.output_text.done``,
``response.content_part.done``; for reasoning the same with ``response.reasoning_text.*``; for a
function call ``response.function_call_arguments.delta`` and ``.done``; then
``response.output_item.done``; last ``response.completed`` (or ``response.incomplete``) with
the whole response. A failure mid-stream is an ``error`` event. When the response ends,
``final`` holds it and ``assistant_turn()`` its output as a chat message (what a later
``previous_response_id`` continues from). ``input_items_page`` pages a stored response's input
items (``GET /v1/responses/{id}/input_items``).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from deployments.apis.openai_format import ChatFormat
from deployments.apis.responses_api import ResponsesRequest
from nvray.outputs import RequestOutput


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [_output_text(text)] if text is not None else []}


def input_items_page(items: list[dict[str, Any]], limit: int, order: str,
                     after: str | None) -> dict[str, Any]:
    """A page of a stored response's input items, as OpenAI lists them (``desc``: newest
    first; ``after``: the items past that id in this order)."""
    ordered = list(reversed(items)) if order == "desc" else list(items)
    if after is not None:
        ids = [item.get("id") for item in ordered]
        ordered = ordered[ids.index(after) + 1:] if after in ids else []
    page = ordered[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > limit}


def _call_item(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"] or "{}",
            "status": status}


class ResponsesFormat:
    """A /v1/responses answer, whole or as OpenAI's events (one per response: it keeps the
    stream's open item). Streams through the server's SSE loop as the chat formats do."""

    done = ""  # no [DONE] line: response.completed ends the stream

    def __init__(self, chat: ChatFormat, request: ResponsesRequest,
                 think_end_id: int | None = None) -> None:
        self.chat, self.request = chat, request
        self.think_end_id = think_end_id  # the token that ends a think block, if one does
        self.id = _id("resp")
        self.created = int(time.time())
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # output items, the last maybe still open
        self.open: str | None = None  # the open item's type
        self.message: dict[str, Any] = {"role": "assistant", "content": None}
        self.final: dict[str, Any] | None = None

    # ----------------------------------------------------------- the response
    def _response(self, status: str, usage: dict[str, Any] | None) -> dict[str, Any]:
        request = self.request
        text = request.text.model_dump(by_alias=True, exclude_none=True) if request.text \
            else {"format": {"type": "text"}}
        reasoning = request.reasoning.model_dump(exclude_none=True) if request.reasoning \
            else {}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.chat.model, "output": self.items, "usage": usage, "error": None,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "previous_response_id": request.previous_response_id, "store": request.store,
            "temperature": request.temperature, "top_p": request.top_p,
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "tool_choice": request.tool_choice or "auto", "tools": request.tools or [],
            "text": text, "reasoning": {"effort": None, "summary": None, **reasoning},
            "truncation": request.truncation or "disabled", "metadata": request.metadata or {},
            "user": request.user, "background": False, "service_tier": "default"}

    def _usage(self, out: RequestOutput) -> dict[str, Any]:
        prompt, output = len(out.prompt_token_ids), len(out.token_ids)
        return {"input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                "output_tokens": output,
                "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens(out)},
                "total_tokens": prompt + output}

    def _reasoning_tokens(self, out: RequestOutput) -> int:
        """Output tokens up to the end of the think block (all of them when it never ended)."""
        if not self.message.get("reasoning_content"):
            return 0
        if self.think_end_id in out.token_ids:
            return out.token_ids.index(self.think_end_id) + 1
        answered = self.message.get("content") or self.message.get("tool_calls")
        return 0 if answered else len(out.token_ids)  # all thought, or the end tag not one token

    def _finish(self, out: RequestOutput) -> dict[str, Any]:
        status = "incomplete" if out.finish_reason == "length" else "completed"
        self.final = self._response(status, self._usage(out))
        return self.final

    def assistant_turn(self) -> dict[str, Any]:
        """The output as a chat message, for the conversation a later response continues."""
        turn = {"role": "assistant", "content": self.message.get("content") or ""}
        if self.message.get("reasoning_content"):
            turn["reasoning_content"] = self.message["reasoning_content"]
        if self.message.get("tool_calls"):
            turn["tool_calls"] = self.message["tool_calls"]
        return turn

    def full(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        out = outputs[0]
        self.message = self.chat.message(out.text)
        if self.message.get("reasoning_content"):
            self.items.append(_reasoning_item(_id("rs"), self.message["reasoning_content"],
                                              "completed"))
        if self.message.get("content"):
            self.items.append(_message_item(_id("msg"), self.message["content"], "completed"))
        self.items += [_call_item(_id("fc"), call, "completed")
                       for call in self.message.get("tool_calls") or ()]
        return self._finish(out)

    # ----------------------------------------------------------- streaming
    def _event(self, kind: str, **fields: Any) -> str:
        self.sequence += 1
        payload = {"type": kind, "sequence_number": self.sequence - 1, **fields}
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def first_chunks(self, num_choices: int, prompt_tokens: list[int] | None = None
                     ) -> list[str]:
        response = self._response("in_progress", None)
        return [self._event("response.created", response=response)
                + self._event("response.in_progress", response=response)]

    def sse(self, chunk: str) -> str:
        return chunk

    def chunk(self, index: int, out: RequestOutput,
              usage: dict[str, int] | None = None) -> str | None:
        delta = self.chat.delta(index, out)
        events: list[str] = []
        if delta.get("reasoning_content"):
            events += self._text_delta("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text_delta("message", delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._call(call)
        if out.finished:
            events += self._close()
            final = self._finish(out)
            kind = "response.incomplete" if final["status"] == "incomplete" \
                else "response.completed"
            events.append(self._event(kind, response=final))
        return "".join(events) or None

    def _text_delta(self, kind: str, text: str) -> list[str]:
        """Events that add ``text`` to the open item of ``kind`` (opened first if need be)."""
        events = [] if self.open == kind else self._close() + self._start(kind)
        key = "reasoning_content" if kind == "reasoning" else "content"
        self.message[key] = (self.message.get(key) or "") + text
        name = "response.reasoning_text.delta" if kind == "reasoning" \
            else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self._event(name, item_id=self.items[-1]["id"],
                                  output_index=len(self.items) - 1, content_index=0,
                                  delta=text, **extra))
        return events

    def _start(self, kind: str) -> list[str]:
        item = (_reasoning_item(_id("rs"), "", "in_progress") if kind == "reasoning"
                else _message_item(_id("msg"), None, "in_progress"))
        self.items.append(item)
        self.open = kind
        part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else _output_text("")
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        return [self._event("response.output_item.added", output_index=where["output_index"],
                            item=item),
                self._event("response.content_part.added", **where, content_index=0,
                            part=part)]

    def _close(self) -> list[str]:
        """Events that end the open reasoning or message item."""
        if self.open is None:
            return []
        kind, self.open = self.open, None
        index = len(self.items) - 1
        item_id = self.items[index]["id"]
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        if kind == "reasoning":
            text = self.message["reasoning_content"]
            item = self.items[index] = _reasoning_item(item_id, text, "completed")
            part = {"type": "reasoning_text", "text": text}
            done = self._event("response.reasoning_text.done", **where, text=text)
        else:
            text = self.message["content"]
            item = self.items[index] = _message_item(item_id, text, "completed")
            part = _output_text(text)
            done = self._event("response.output_text.done", **where, text=text, logprobs=[])
        return [done, self._event("response.content_part.done", **where, part=part),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _call(self, call: dict[str, Any]) -> list[str]:
        """A whole parsed call: its item added, its arguments in one delta, its item done."""
        events = self._close()
        self.message.setdefault("tool_calls", []).append(
            {"id": call["id"], "type": "function", "function": call["function"]})
        item = _call_item(_id("fc"), call, "in_progress")
        index = len(self.items)
        self.items.append({**item, "status": "completed"})
        where = {"item_id": item["id"], "output_index": index}
        return events + [
            self._event("response.output_item.added", output_index=index,
                        item={**item, "arguments": ""}),
            self._event("response.function_call_arguments.delta", **where,
                        delta=item["arguments"]),
            self._event("response.function_call_arguments.done", **where, name=item["name"],
                        arguments=item["arguments"]),
            self._event("response.output_item.done", output_index=index,
                        item=self.items[index])]

    def usage_chunk(self, outputs: list[RequestOutput]) -> str:
        return ""

    def error_event(self, error: Any) -> str:
        return self._event("error", code=error.code, message=error.message, param=error.param)
