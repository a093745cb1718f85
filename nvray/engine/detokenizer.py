"""IncrementalDetokenizer: turns a growing list of token ids into text deltas.

A token can end in the middle of a multi-byte character; its text is held back until the
character is complete, so deltas never contain U+FFFD halves and their concatenation equals
the text of all tokens. A few prompt tokens serve as left context so tokenizers that strip a
leading space decode the first output token right.
"""

from __future__ import annotations

from typing import Any

_CONTEXT_TOKENS = 4
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        # the Rust tokenizer behind a "fast" HF tokenizer decodes ~10x faster than the wrapper
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, token_ids: list[int]) -> str:
        """Append tokens; return the new complete text (may be empty while a char is split)."""
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        if full_text.endswith(_REPLACEMENT):
            return ""  # a character is still split: wait for its next bytes
        # tokens that decode to nothing (skipped special tokens) still move the window on,
        # so it never grows
        delta = full_text[len(prefix_text):] if full_text.startswith(prefix_text) else ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end: emit whatever is held back (an incomplete character decodes as U+FFFD)."""
        if self.read_offset == len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        delta = full_text[len(prefix_text):] if full_text.startswith(prefix_text) else ""
        self.read_offset = len(self.ids)
        self.text += delta
        return delta
