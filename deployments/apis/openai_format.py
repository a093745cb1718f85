"""OpenAI response bodies and SSE chunks built from nvray RequestOutputs.

A streamed chunk carries one choice's delta, which may hold several tokens when the client
reads slower than the engine steps; with ``stream_options.continuous_usage_stats`` (vLLM's
extension) each chunk also carries that choice's running token counts. ``chunk`` returns None
when an output adds nothing a client can see (text held back: a partial character, a possible
stop string, or an undecided reasoning tag).

Usage counts each prompt's tokens once, whatever its number of choices (``n``), and
``prompt_tokens_details.cached_tokens`` the prompt tokens served from the prefix cache (whole
KV blocks), summed the same way. Where speculative decoding verified drafts for the outputs,
``completion_tokens_details`` counts them as OpenAI's predicted outputs do:
``accepted_prediction_tokens`` (drafts the target confirmed) and ``rejected_prediction_tokens``
(the others; not part of ``completion_tokens``). Log-probabilities (``logprobs_format.py``) and completions'
``echo`` go with each choice's text; a chunk whose text is held back keeps its tokens'
log-probabilities for the next chunk that goes out. With a
reasoning parser (app option ``reasoning_parser``) a chat message carries
``reasoning_content`` besides ``content`` (null when the output has no think block), and each
streamed delta the part of either that it adds."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Protocol

from deployments.apis.logprobs_format import CompletionLogprobs, TokenTexts, chat_logprobs
from deployments.apis.tools import ToolParser, parse_tool_calls
from nvray.outputs import RequestOutput, TokenLogprobs
from nvray.reasoning import Delta, ReasoningParser, ReasoningStream

DONE = "data: [DONE]\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_of(outputs: list[RequestOutput]) -> dict[str, Any]:
    firsts = [o for o in outputs if o.index == 0]  # one per prompt: its choices share it
    prompt = sum(len(o.prompt_token_ids) for o in firsts)
    completion = sum(len(o.token_ids) for o in outputs)
    cached = sum(o.num_cached_tokens for o in firsts)
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion,
                             "prompt_tokens_details": {"cached_tokens": cached}}
    drafted = sum(o.num_draft_tokens for o in outputs)
    if drafted:
        accepted = sum(o.num_accepted_draft_tokens for o in outputs)
        usage["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                              "rejected_prediction_tokens": drafted - accepted}
    return usage


def with_usage(chunk: dict[str, Any], usage: dict[str, Any] | None) -> dict[str, Any]:
    """A streamed chunk, with the running token counts when the client asked for them."""
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _Pending:
    """A streamed choice's tokens whose log-probabilities have not gone out yet."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.logprobs: list[TokenLogprobs | None] = []

    def add(self, ids: list[int], logprobs: list[TokenLogprobs | None] | None) -> None:
        if logprobs is not None:
            self.ids += ids
            self.logprobs += logprobs

    def take(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        taken = (self.ids, self.logprobs)
        self.ids, self.logprobs = [], []
        return taken


class StreamFormat(Protocol):
    """What the server's SSE loop needs of an answer's format: the events before any token,
    each output's events (None when it adds nothing a client sees), the usage at the end, the
    encoding of one event, a failure's event and the closing line (empty for none)."""

    done: str

    def first_chunks(self, num_choices: int, prompt_tokens: list[int] | None = None
                     ) -> list[Any]: ...

    def chunk(self, index: int, out: RequestOutput,
              usage: dict[str, int] | None = None) -> Any: ...

    def usage_chunk(self, outputs: list[RequestOutput]) -> Any: ...

    def sse(self, chunk: Any) -> str: ...

    def error_event(self, error: Any) -> str: ...


class OpenAIEvents:
    """How an OpenAI format's streamed chunks go out: ``data:`` lines, ``[DONE]`` last, a
    failure as an error chunk (``MessagesFormat`` has Anthropic's events instead)."""

    done = DONE

    def sse(self, chunk: dict[str, Any]) -> str:
        return sse(chunk)

    def error_event(self, error: Any) -> str:
        return error.sse()


class CompletionFormat(OpenAIEvents):
    """/v1/completions bodies (one per response: it keeps each streamed choice's state).

    ``echo_texts[i]``: choice ``i``'s prompt text when the request echoes it; ``texts``: token
    texts, when the request asked for log-probabilities."""

    def __init__(self, model: str, texts: TokenTexts | None = None,
                 echo_texts: list[str] | None = None) -> None:
        self.model, self.id, self.created = model, new_id("cmpl"), int(time.time())
        self.texts, self.echo_texts = texts, echo_texts
        self.logprobs: dict[int, CompletionLogprobs] = {}
        self.pending: dict[int, _Pending] = {}

    def full(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for i, o in enumerate(outputs):
            text, logprobs = o.text, None
            if self.echo_texts is not None:
                text = self.echo_texts[i] + text
            if self.texts is not None and o.logprobs is not None:
                ids, lps = self._with_prompt(o, o.token_ids, o.logprobs)
                logprobs = CompletionLogprobs(self.texts).render(ids, lps)
            choices.append({"index": i, "text": text, "logprobs": logprobs,
                            "finish_reason": o.finish_reason})
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices, "usage": usage_of(outputs)}

    def _with_prompt(self, out: RequestOutput, ids: list[int],
                     logprobs: list[TokenLogprobs | None]
                     ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Echo: the prompt's tokens and log-probabilities first."""
        if self.echo_texts is None or out.prompt_logprobs is None:
            return ids, logprobs
        return out.prompt_token_ids + ids, out.prompt_logprobs + logprobs

    def chunk(self, index: int, out: RequestOutput,
              usage: dict[str, int] | None = None) -> dict[str, Any] | None:
        first = index not in self.pending
        pending = self.pending.setdefault(index, _Pending())
        if first and self.echo_texts is not None:
            pending.add(*self._with_prompt(out, [], []))
        pending.add(out.delta_token_ids, out.delta_logprobs)
        echo = self.echo_texts[index] if first and self.echo_texts is not None else ""
        text = echo + out.delta_text  # an echo is never empty: the first output goes out
        if not text and not out.finished:
            return None
        logprobs = None
        if self.texts is not None:
            lp = self.logprobs.setdefault(index, CompletionLogprobs(self.texts))
            logprobs = lp.render(*pending.take())
        choice = {"index": index, "text": text, "logprobs": logprobs,
                  "finish_reason": out.finish_reason if out.finished else None}
        return with_usage({"id": self.id, "object": "text_completion", "created": self.created,
                           "model": self.model, "choices": [choice]}, usage)

    def usage_chunk(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": [], "usage": usage_of(outputs)}

    def first_chunks(self, num_choices: int, prompt_tokens: list[int] | None = None
                     ) -> list[dict[str, Any]]:
        return []


class ChatFormat(OpenAIEvents):
    """/v1/chat/completions bodies (one per response: it keeps each streamed choice's
    reasoning-parser state)."""

    def __init__(self, model: str, reasoning: ReasoningParser | None = None,
                 texts: TokenTexts | None = None, tools: ToolParser | None = None,
                 tool_schemas: dict[str, dict[str, Any]] | None = None) -> None:
        self.model, self.id, self.created = model, new_id("chatcmpl"), int(time.time())
        self.reasoning = reasoning
        self.texts = texts  # token texts, when the request asked for log-probabilities
        self.tools = tools  # the answer may hold tool calls of this format (tools.py)
        self.tool_schemas = tool_schemas  # each function's parameters schema (XML calls' types)
        self.streams: dict[int, ReasoningStream] = {}  # choice index -> its parser state
        self.calls: dict[int, ToolCallStream] = {}  # choice index -> its tool-call parser
        self.pending: dict[int, _Pending] = {}

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def message(self, text: str) -> dict[str, Any]:
        if self.reasoning is None:
            message: dict[str, Any] = {"role": "assistant", "content": text}
        else:
            reasoning, content = self.reasoning.extract(text)
            message = {"role": "assistant", "reasoning_content": reasoning,
                       "content": content if content or reasoning is None else None}
        if self.tools and message["content"]:
            message["content"], calls = parse_tool_calls(message["content"], self.tools,
                                                         self.tool_schemas)
            if calls:
                message["tool_calls"] = calls
        return message

    def full(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for i, o in enumerate(outputs):
            message = self.message(o.text)
            choices.append({"index": i, "message": message,
                            "logprobs": self._logprobs(o.token_ids, o.logprobs),
                            "finish_reason": _with_calls(o.finish_reason,
                                                         bool(message.get("tool_calls")))})
        return {**self._envelope("chat.completion"), "choices": choices, "usage": usage_of(outputs)}

    def _logprobs(self, ids: list[int], logprobs: list[TokenLogprobs] | None
                  ) -> dict[str, Any] | None:
        if self.texts is None or logprobs is None:
            return None
        return chat_logprobs(self.texts, ids, logprobs)

    def delta(self, index: int, out: RequestOutput) -> dict[str, Any]:
        """What choice ``index``'s new output adds: reasoning, content and whole tool calls."""
        if self.reasoning is None:
            part = Delta("", out.delta_text)
        else:
            stream = self.streams.setdefault(index, self.reasoning.stream())
            part = stream.feed(out.delta_text)
            if out.finished:
                tail = stream.finish()
                part = Delta(part.reasoning + tail.reasoning, part.content + tail.content)
        delta: dict[str, Any] = {"reasoning_content": part.reasoning} if part.reasoning else {}
        content = part.content
        if self.tools:
            calls = self.calls.setdefault(index, self.tools.stream(self.tool_schemas))
            first = calls.num_calls
            content, new = calls.feed(content)
            if out.finished:
                rest, last = calls.finish()
                content, new = content + rest, new + last
            if new:
                delta["tool_calls"] = [{"index": first + k, **call} for k, call in enumerate(new)]
        if content:
            delta["content"] = content
        return delta

    def first_chunks(self, num_choices: int, prompt_tokens: list[int] | None = None
                     ) -> list[dict[str, Any]]:
        return [{**self._envelope("chat.completion.chunk"),
                 "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}]}
                for i in range(num_choices)]

    def chunk(self, index: int, out: RequestOutput,
              usage: dict[str, int] | None = None) -> dict[str, Any] | None:
        pending = self.pending.setdefault(index, _Pending())
        pending.add(out.delta_token_ids, out.delta_logprobs)
        delta = self.delta(index, out)
        if not delta and not out.finished:
            return None
        ids, logprobs = pending.take()
        called = self.tools and self.calls[index].num_calls > 0
        choice = {"index": index, "delta": delta,
                  "logprobs": self._logprobs(ids, logprobs) if logprobs else None,
                  "finish_reason": _with_calls(out.finish_reason, called) if out.finished
                  else None}
        return with_usage({**self._envelope("chat.completion.chunk"), "choices": [choice]}, usage)

    def usage_chunk(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        return {**self._envelope("chat.completion.chunk"), "choices": [], "usage": usage_of(outputs)}


def _with_calls(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish reason: an answer that ended on its own after tool calls ends with them."""
    return "tool_calls" if called and reason == "stop" else reason
