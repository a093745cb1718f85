"""Log-probabilities in OpenAI's two shapes, from nvray's ``TokenLogprobs``.

- Completions (legacy): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, with
  each position's top log-probabilities as a ``{token text: logprob}`` object that also holds
  the chosen token (as vLLM does); with ``echo`` the prompt's tokens come first, the first one
  with ``null`` log-probabilities.
- Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``.

A token's text is the tokenizer's decoding of that token alone (a piece of a multi-byte
character decodes as U+FFFD, as in vLLM); ``TokenTexts`` caches it per id.
"""

from __future__ import annotations

import functools
from typing import Any

from nvray.outputs import TokenLogprobs


class TokenTexts:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.text = functools.lru_cache(maxsize=65536)(self._decode)

    def _decode(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


class CompletionLogprobs:
    """One choice's completions-shape log-probabilities, built chunk by chunk (``text_offset``
    continues from one chunk to the next)."""

    def __init__(self, texts: TokenTexts) -> None:
        self.texts = texts
        self.offset = 0

    def render(self, token_ids: list[int], logprobs: list[TokenLogprobs | None]) -> dict[str, Any]:
        text = self.texts.text
        tokens, offsets = [], []
        for token_id in token_ids:
            tokens.append(text(token_id))
            offsets.append(self.offset)
            self.offset += len(tokens[-1])
        top = [None if lp is None else
               {**{text(i): v for i, v in zip(lp.top_ids, lp.top_logprobs)}, text(t): lp.logprob}
               for t, lp in zip(token_ids, logprobs)]
        return {"tokens": tokens, "token_logprobs": [None if lp is None else lp.logprob
                                                     for lp in logprobs],
                "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(texts: TokenTexts, token_ids: list[int],
                  logprobs: list[TokenLogprobs]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        piece = texts.text(token_id)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}

    return {"content": [{**entry(t, lp.logprob),
                         "top_logprobs": [entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs)]}
                        for t, lp in zip(token_ids, logprobs)]}
