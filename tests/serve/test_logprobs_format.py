"""Log-probabilities in OpenAI's two shapes (``deployments/apis/logprobs_format.py``) from
nvray's per-token log-probabilities, with the tiny model's real tokenizer: every token's text is
that token decoded alone; the completions shape's ``text_offset`` runs on across the chunks of a
stream and its ``top_logprobs`` object holds the chosen token too; an echoed prompt's first
token has ``null``s; the chat shape gives each token's UTF-8 bytes. (The HTTP tests,
``test_openai_sampling.py``, check the same bodies through the app.)"""

from __future__ import annotations

import pytest

from deployments.apis.logprobs_format import CompletionLogprobs, TokenTexts, chat_logprobs
from nvray.outputs import TokenLogprobs


@pytest.fixture(scope="module")
def tokenizer(tiny_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_path)


@pytest.fixture(scope="module")
def ids(tokenizer) -> list[int]:
    ids = tokenizer.encode("Hi café 🙂 ok", add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)  # a split character among them
    return ids


def _logprobs(ids: list[int]) -> list[TokenLogprobs]:
    """Made-up log-probabilities: each token's own, and two alternatives (the next ids)."""
    return [TokenLogprobs(-0.25 * (i + 1), [t + 1, t + 2], [-1.0 - i, -2.0 - i])
            for i, t in enumerate(ids)]


def test_completion_logprobs_name_each_token_with_its_offset_and_its_top_tokens(
        tokenizer, ids) -> None:
    texts = TokenTexts(tokenizer)
    lps = _logprobs(ids)
    body = CompletionLogprobs(texts).render(ids, lps)
    pieces = [tokenizer.decode([t]) for t in ids]
    assert body["tokens"] == pieces
    assert body["token_logprobs"] == [lp.logprob for lp in lps]
    starts = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
    assert body["text_offset"] == starts
    for t, lp, top in zip(ids, lps, body["top_logprobs"]):
        alternatives = {tokenizer.decode([i]): v for i, v in zip(lp.top_ids, lp.top_logprobs)}
        assert top == {**alternatives, tokenizer.decode([t]): lp.logprob}  # the chosen one too


def test_a_streams_offsets_continue_from_chunk_to_chunk(tokenizer, ids) -> None:
    """Chunk by chunk, the offsets are those of the whole text, not of each chunk."""
    whole = CompletionLogprobs(TokenTexts(tokenizer)).render(ids, _logprobs(ids))
    streamed = CompletionLogprobs(TokenTexts(tokenizer))
    offsets: list[int] = []
    for start in range(0, len(ids), 2):
        chunk = ids[start:start + 2]
        offsets += streamed.render(chunk, _logprobs(ids)[start:start + 2])["text_offset"]
    assert offsets == whole["text_offset"] and offsets[-1] > 0


def test_an_echoed_prompts_first_token_has_null_logprobs(tokenizer, ids) -> None:
    lps: list[TokenLogprobs | None] = [None, *_logprobs(ids)[1:]]
    body = CompletionLogprobs(TokenTexts(tokenizer)).render(ids, lps)
    assert body["token_logprobs"][0] is None and body["top_logprobs"][0] is None
    assert body["tokens"][0] == tokenizer.decode([ids[0]])
    assert body["token_logprobs"][1:] == [lp.logprob for lp in lps[1:]]
    assert all(top is not None for top in body["top_logprobs"][1:])


def test_chat_logprobs_give_each_tokens_text_bytes_and_alternatives(tokenizer, ids) -> None:
    lps = _logprobs(ids)
    body = chat_logprobs(TokenTexts(tokenizer), ids, lps)
    assert list(body) == ["content"] and len(body["content"]) == len(ids)
    for t, lp, entry in zip(ids, lps, body["content"]):
        piece = tokenizer.decode([t])
        assert entry["token"] == piece and entry["logprob"] == lp.logprob
        assert entry["bytes"] == list(piece.encode("utf-8"))
        assert entry["top_logprobs"] == [
            {"token": tokenizer.decode([i]), "logprob": v,
             "bytes": list(tokenizer.decode([i]).encode("utf-8"))}
            for i, v in zip(lp.top_ids, lp.top_logprobs)]


def test_a_tokens_text_is_decoded_once_per_id(tokenizer) -> None:
    class Counting:
        def __init__(self) -> None:
            self.calls = 0

        def decode(self, ids):  # noqa: ANN001, ANN202
            self.calls += 1
            return tokenizer.decode(ids)

    counting = Counting()
    texts = TokenTexts(counting)
    assert [texts.text(7), texts.text(7), texts.text(8)] == [tokenizer.decode([7]),
                                                             tokenizer.decode([7]),
                                                             tokenizer.decode([8])]
    assert counting.calls == 2


def test_the_token_text_cache_is_bounded_at_65536_ids() -> None:
    """A replica serves many requests: the cache keeps the 65,536 ids used last, so memory
    stays bounded, and an id pushed out is decoded again when it comes back."""
    class Counting:
        def __init__(self) -> None:
            self.calls = 0

        def decode(self, ids):  # noqa: ANN001, ANN202
            self.calls += 1
            return f"<{ids[0]}>"

    counting = Counting()
    texts = TokenTexts(counting)
    for i in range(65_536):
        texts.text(i)
    texts.text(0)  # still cached: 65,536 ids fit
    assert counting.calls == 65_536
    texts.text(65_536)  # one more pushes out the one used longest ago (1)
    texts.text(1)
    assert counting.calls == 65_538
