"""IncrementalDetokenizer: turns a growing list of token ids into text deltas.

A token can end in the middle of a multi-byte character; its text is held back until the
character is complete, so deltas never contain U+FFFD halves and their concatenation equals
the text of all tokens. A few prompt tokens serve as left context so tokenizers that strip a
leading space decode the first output token right: the longest tail of the prompt's last
tokens that decodes to whole characters (a context ending in half a character would leak into
the output, or swallow the output's first bytes).

With a Rust ("fast") tokenizer the deltas come from the tokenizers library's ``DecodeStream``:
one call into Rust per step, about a quarter of the cost of decoding a window of ids twice from
Python, which a streaming request pays for every token on the engine's step loop. Special
tokens that are skipped never reach the stream (it would keep them in its window, and every
later step would decode them again). Any other tokenizer decodes a sliding window twice per
step. Either way ``flush`` decodes what is still held back at the end.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

_CONTEXT_TOKENS = 4
_REPLACEMENT = "\ufffd"


@lru_cache(maxsize=8)
def _special_ids(tokenizer: Any) -> frozenset[int]:
    return frozenset(getattr(tokenizer, "all_special_ids", ()) or ())


def _decode_stream(backend: Any, skip_special_tokens: bool, context: list[int]) -> Any:
    """A DecodeStream primed with the context ids (their text is not output), or None where
    there is none to use."""
    try:
        from tokenizers.decoders import DecodeStream  # noqa: PLC0415
    except ImportError:  # tokenizers older than 0.21
        return None
    if backend is None:
        return None
    stream = DecodeStream(skip_special_tokens=skip_special_tokens)
    if context:
        stream.step(backend, context)
    return stream


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        # the Rust tokenizer behind a "fast" HF tokenizer decodes ~10x faster than the wrapper
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.skip_special_tokens = skip_special_tokens
        # the context, then the outputs
        self.ids: list[int] = self._whole_tail(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)  # ids[:read_offset] are in the text
        self.stream = _decode_stream(self.backend, skip_special_tokens, self.ids)
        self.skipped = _special_ids(tokenizer) if skip_special_tokens else frozenset()

    def _whole_tail(self, context: list[int]) -> list[int]:
        """The longest tail of ``context`` that decodes to whole characters."""
        for start in range(len(context)):
            if not self._decode(context[start:]).endswith(_REPLACEMENT):
                return list(context[start:])
        return []

    def _decode(self, ids: list[int]) -> str:
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, token_ids: list[int]) -> str:
        """Append tokens; return the new complete text (may be empty while a char is split)."""
        nothing_held = self.read_offset == len(self.ids)
        self.ids.extend(token_ids)
        if self.stream is None:
            delta = self._window_step()
        else:
            delta = self._stream_step(token_ids, nothing_held)
        return delta

    def _stream_step(self, token_ids: list[int], nothing_held: bool) -> str:
        kept = [t for t in token_ids if t not in self.skipped]
        if not kept:  # only skipped special tokens: they add no text
            if nothing_held:
                self._mark_read()
            return ""
        piece = self.stream.step(self.backend, kept if len(kept) > 1 else kept[0])
        if piece is None:
            return ""  # a character is still split: wait for its next bytes
        self._mark_read()
        return piece

    def _mark_read(self) -> None:
        """All ids are in the text; ``flush`` would decode from a few ids back."""
        self.read_offset = len(self.ids)
        self.prefix_offset = max(0, self.read_offset - _CONTEXT_TOKENS)

    def _window_step(self) -> str:
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        if full_text.endswith(_REPLACEMENT):
            return ""  # a character is still split: wait for its next bytes
        # tokens that decode to nothing (skipped special tokens) still move the window on,
        # so it never grows
        delta = full_text[len(prefix_text):] if full_text.startswith(prefix_text) else ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return delta

    def flush(self) -> str:
        """At the end: emit whatever is held back (an incomplete character decodes as U+FFFD)."""
        if self.read_offset == len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        delta = full_text[len(prefix_text):] if full_text.startswith(prefix_text) else ""
        self.read_offset = len(self.ids)
        return delta
