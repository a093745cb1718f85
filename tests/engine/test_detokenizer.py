"""Incremental detokenization: deltas are whole characters and add up to the full text."""

from __future__ import annotations

import pytest

from nvray.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_path)


@pytest.mark.parametrize("text", ["Hello world!", " naïve café 你好，世界 🙂✨ Привет", "a🙂b\n\n  c"])
def test_deltas_concatenate_to_the_text_and_never_split_a_character(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt:", add_special_tokens=False))
    deltas = [detok.add_tokens([t]) for t in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_special_tokens_are_skipped(tokenizer):
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    detok = IncrementalDetokenizer(tokenizer, [5])
    ids = tokenizer.encode("ok", add_special_tokens=False) + [end]
    assert "".join(detok.add_tokens([t]) for t in ids) + detok.flush() == "ok"


def test_tokens_that_decode_to_nothing_do_not_grow_the_window(tokenizer):
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    detok = IncrementalDetokenizer(tokenizer, [5])
    for _ in range(50):
        assert detok.add_tokens([end]) == ""
    assert detok.read_offset - detok.prefix_offset <= 1
    assert detok.add_tokens(tokenizer.encode("ok", add_special_tokens=False)) == "ok"
