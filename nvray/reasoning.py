"""Reasoning parsers: split a model's output text into ``reasoning_content`` and ``content``.

One parser for now, ``"qwen3"``: Qwen3 thinks inside ``<think>…</think>`` at the very start of
its output. For an output text ``T``:

- ``T`` does not start with ``<think>``: no reasoning (None); all of ``T`` is content
  (e.g. ``enable_thinking=false``, where the prompt already closed an empty think block);
- ``T`` starts with ``<think>`` and contains ``</think>``: the reasoning is the text between
  them, the content everything after the first ``</think>``;
- ``T`` starts with ``<think>`` and never closes it (cut by ``max_tokens``): all of it after
  ``<think>`` is reasoning, the content is empty.

Newlines around the reasoning, and at the start of the content after ``</think>``, are dropped
(Qwen3 writes ``<think>\\nR\\n</think>\\n\\nC``). The last rule differs from vLLM's non-streamed
qwen3 parser, which calls an unclosed think block content: with that rule a stream could not
send reasoning until ``</think>`` came (or never), and the streamed and non-streamed answers
would disagree. Here ``Qwen3ReasoningStream`` splits a stream of text deltas exactly as
``extract`` splits their concatenation, wherever the chunk boundaries fall — inside a tag
included — holding back only what is still undecided: a proper prefix of ``<think>`` at the
start, and newlines or a partial ``</think>`` at the end of the reasoning so far.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

THINK_START = "<think>"
THINK_END = "</think>"
REASONING_PARSERS = ("qwen3",)


class Split(NamedTuple):
    """Text split into reasoning (None: the output has no think block) and content."""

    reasoning: str | None
    content: str


class Delta(NamedTuple):
    """What one streamed text delta adds to the reasoning and to the content ("" if nothing)."""

    reasoning: str
    content: str


class ReasoningStream(Protocol):
    def feed(self, delta: str) -> Delta: ...

    def finish(self) -> Delta: ...


class ReasoningParser(Protocol):
    def extract(self, text: str) -> Split: ...

    def stream(self) -> ReasoningStream: ...


class Qwen3ReasoningParser:
    def extract(self, text: str) -> Split:
        if not text.startswith(THINK_START):
            return Split(None, text)
        reasoning, closed, content = text[len(THINK_START):].partition(THINK_END)
        return Split(reasoning.strip("\n"), content.lstrip("\n") if closed else "")

    def stream(self) -> "Qwen3ReasoningStream":
        return Qwen3ReasoningStream()


def _undecided_tail(text: str) -> int:
    """Where the reasoning's undecided tail starts: trailing newlines (maybe the last before
    ``</think>``) and a partial ``</think>`` after them."""
    end = len(text)
    for k in range(min(len(THINK_END) - 1, len(text)), 0, -1):
        if text.endswith(THINK_END[:k]):
            end -= k
            break
    return len(text[:end].rstrip("\n"))


class Qwen3ReasoningStream:
    """``feed`` each text delta, then ``finish``: the concatenated reasoning and content
    parts equal ``Qwen3ReasoningParser().extract`` of the whole text (its None reasoning
    streams as nothing)."""

    def __init__(self) -> None:
        self.state = "start"  # start -> reasoning -> content, or start -> content
        self.pending = ""  # text received but not yet given out
        self.at_section_start = True  # newlines here are dropped (reasoning's or content's)

    def feed(self, delta: str) -> Delta:
        self.pending += delta
        if self.state == "start":
            self._decide_start()
        reasoning = self._take_reasoning() if self.state == "reasoning" else ""
        content = self._take_content() if self.state == "content" else ""
        return Delta(reasoning, content)

    def finish(self) -> Delta:
        """The rest, once the output is complete."""
        rest, self.pending = self.pending, ""
        if self.state == "reasoning":
            return Delta(rest.rstrip("\n"), "")
        return Delta("", rest)  # start: a partial "<think>" that never completed is content

    def _decide_start(self) -> None:
        if self.pending.startswith(THINK_START):
            self.pending = self.pending[len(THINK_START):]
            self.state = "reasoning"
        elif not THINK_START.startswith(self.pending):
            self.state, self.at_section_start = "content", False

    def _drop_leading_newlines(self) -> None:
        if self.at_section_start:
            self.pending = self.pending.lstrip("\n")
            self.at_section_start = not self.pending

    def _take_reasoning(self) -> str:
        self._drop_leading_newlines()
        reasoning, closed, after = self.pending.partition(THINK_END)
        if closed:
            self.pending, self.state, self.at_section_start = after, "content", True
            return reasoning.rstrip("\n")
        cut = _undecided_tail(self.pending)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def _take_content(self) -> str:
        self._drop_leading_newlines()
        out, self.pending = self.pending, ""
        return out


def reasoning_parser_for(name: str | None) -> ReasoningParser | None:
    """The parser called ``name`` (None: no parsing)."""
    if name is None:
        return None
    if name == "qwen3":
        return Qwen3ReasoningParser()
    raise ValueError(f"reasoning_parser={name!r} is not supported; supported: "
                     f"{', '.join(REASONING_PARSERS)}")
