"""The Qwen3 reasoning parser: each output text's expected (reasoning, content) is written by
hand from the text, and the streamed parser must give the same split for every way of cutting
the text into deltas (one cut anywhere, two cuts anywhere, one character at a time)."""

from __future__ import annotations

import itertools

import pytest

from nvray.reasoning import Qwen3ReasoningParser, reasoning_parser_for

# (output text, reasoning_content, content)
CASES = [
    ("<think>R</think>C", "R", "C"),
    ("<think>\nI should greet.\n</think>\n\nHello!", "I should greet.", "Hello!"),
    ("Hello, no thinking here.", None, "Hello, no thinking here."),
    ("", None, ""),
    ("<think>\nstill thinking when max_tokens cut it", "still thinking when max_tokens cut it", ""),
    ("<think></think>", "", ""),
    ("<think>\n\n</think>\n\nAnswer\n", "", "Answer\n"),
    ("<think>a</think>b</think>c", "a", "b</think>c"),
    (" <think>x</think>y", None, " <think>x</think>y"),
    ("\n<think>x</think>y", None, "\n<think>x</think>y"),
    ("<thin", None, "<thin"),
    ("<think", None, "<think"),
    ("<think>a\n</thin", "a\n</thin", ""),
    ("<think>a\n\n</think", "a\n\n</think", ""),
    ("<think>x < y and\n\nz</think>\n\n<think>again</think>", "x < y and\n\nz",
     "<think>again</think>"),
    ("<think>\n\nline one\n\nline two\n\n</think>", "line one\n\nline two", ""),
    ("<think>思考中…</think>答え🙂", "思考中…", "答え🙂"),
    ("<think>R</think>\n\n", "R", ""),
    ("<think><</think>>", "<", ">"),
    ("<think></thinker></think>done", "</thinker>", "done"),
    ("<think>\n</think>\nA\n\nB", "", "A\n\nB"),
    ("<think>no end\n\n", "no end", ""),
    ("<<think>x</think>", None, "<<think>x</think>"),
    # only newlines are dropped at the sections' edges: spaces, tabs and letters stay
    ("<think> spaced \t</think>  answer ", " spaced \t", "  answer "),
    ("<think>X marks\nX</think>X-ray", "X marks\nX", "X-ray"),
]


def streamed(pieces: list[str]) -> tuple[str, str]:
    stream = Qwen3ReasoningParser().stream()
    parts = [stream.feed(p) for p in pieces] + [stream.finish()]
    return "".join(p.reasoning for p in parts), "".join(p.content for p in parts)


def cut(text: str, at: tuple[int, ...]) -> list[str]:
    bounds = [0, *at, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("text,reasoning,content", CASES)
def test_extract_splits_as_written(text, reasoning, content):
    assert tuple(Qwen3ReasoningParser().extract(text)) == (reasoning, content)


@pytest.mark.parametrize("text,reasoning,content", CASES)
def test_every_way_of_streaming_gives_the_same_split(text, reasoning, content):
    expected = (reasoning or "", content)
    assert streamed([text]) == expected
    assert streamed(list(text)) == expected
    for points in itertools.chain(itertools.combinations(range(len(text) + 1), 1),
                                  itertools.combinations(range(len(text) + 1), 2)):
        assert streamed(cut(text, points)) == expected, (text, points)


def test_a_stream_sends_reasoning_before_the_think_block_closes():
    stream = Qwen3ReasoningParser().stream()
    assert stream.feed("<think>\nfirst").reasoning == "first"
    assert stream.feed(" thought\n</thi") == (" thought", "")
    assert stream.feed("nk>\n\nthe answer") == ("", "the answer")


def test_a_stream_without_a_think_block_is_content_at_once():
    stream = Qwen3ReasoningParser().stream()
    assert stream.feed("Hi") == ("", "Hi")  # no longer a prefix of <think>
    assert stream.feed(" <think>") == ("", " <think>")


def test_parser_names():
    assert reasoning_parser_for(None) is None
    assert isinstance(reasoning_parser_for("qwen3"), Qwen3ReasoningParser)
    with pytest.raises(ValueError, match="reasoning_parser='deepseek_r1'.*qwen3"):
        reasoning_parser_for("deepseek_r1")
