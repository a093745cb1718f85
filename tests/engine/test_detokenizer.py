"""Incremental detokenization: deltas are whole characters and add up to the full text."""

from __future__ import annotations

import random

import pytest

from nvray.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_path)


@pytest.mark.parametrize("text", ["Hello world!", " naïve café 你好，世界 🙂✨ Привет", "a🙂b\n\n  c"])
def test_deltas_concatenate_to_the_text_and_never_split_a_character(tokenizer, text,
                                                                    detokenizer_kind):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt:", add_special_tokens=False))
    deltas = [detok.add_tokens([t]) for t in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_special_tokens_are_skipped(tokenizer, detokenizer_kind):
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    detok = IncrementalDetokenizer(tokenizer, [5])
    ids = tokenizer.encode("ok", add_special_tokens=False) + [end]
    assert "".join(detok.add_tokens([t]) for t in ids) + detok.flush() == "ok"


@pytest.fixture(params=["decode_stream", "window"])
def detokenizer_kind(request, monkeypatch):
    """Both paths: the tokenizers library's DecodeStream, and the window decoded twice a step
    (a tokenizer without one)."""
    if request.param == "window":
        monkeypatch.setattr("nvray.engine.detokenizer._decode_stream", lambda *a: None)
    return request.param


def test_tokens_that_decode_to_nothing_do_not_grow_the_window(tokenizer, detokenizer_kind):
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    detok = IncrementalDetokenizer(tokenizer, [5])
    assert (detok.stream is not None) == (detokenizer_kind == "decode_stream")
    for _ in range(50):
        assert detok.add_tokens([end]) == ""
        assert detok.read_offset == len(detok.ids)  # nothing held back for a later step
    assert detok.read_offset - detok.prefix_offset <= 4
    assert detok.add_tokens(tokenizer.encode("ok", add_special_tokens=False)) == "ok"


def test_random_tokens_stream_to_the_tokenizers_own_decode(tokenizer, detokenizer_kind):
    """Any id sequence (split characters, special tokens, several ids a step): the deltas
    add up to what the tokenizer decodes from the whole sequence."""
    rng = random.Random(7)
    ids = [rng.randrange(len(tokenizer)) for _ in range(600)]
    detok = IncrementalDetokenizer(tokenizer, [5, 6, 7])
    deltas, at = [], 0
    while at < len(ids):
        take = rng.choice((1, 1, 1, 2, 3))
        deltas.append(detok.add_tokens(ids[at:at + take]))
        at += take
    deltas.append(detok.flush())
    context = tokenizer.decode([5, 6, 7], skip_special_tokens=True)
    whole = tokenizer.decode([5, 6, 7] + ids, skip_special_tokens=True)
    assert whole.startswith(context)
    assert "".join(deltas) == whole[len(context):]


def test_a_prompt_ending_in_half_a_character_leaks_nothing_into_the_output(tokenizer,
                                                                         detokenizer_kind):
    """The prompt's last tokens are context only: when they end in the middle of a character,
    none of their text may come out with the output."""
    rng = random.Random(3)
    prompts = ([rng.randrange(len(tokenizer)) for _ in range(4)] for _ in range(10_000))
    split = [p for p in prompts if tokenizer.decode(p, skip_special_tokens=True).endswith("\ufffd")]
    assert len(split) >= 5
    outputs = tokenizer.encode(" ok then", add_special_tokens=False)
    for prompt in split[:5]:
        detok = IncrementalDetokenizer(tokenizer, prompt)
        text = "".join(detok.add_tokens([t]) for t in outputs) + detok.flush()
        assert text == " ok then", (prompt, text)


@pytest.mark.parametrize("step", [1, 2], ids=["a-token-a-step", "the-end-in-one-step"])
def test_a_stream_ending_in_half_a_character_then_a_skipped_special_token(
        tokenizer, detokenizer_kind, step):
    """The output's last real token ends mid-character, then a special token (skipped) ends it:
    the held-back bytes still come out at the end, as the tokenizer decodes the whole."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("ok 🙂", add_special_tokens=False)
    cut = ids[:-1] + [end]  # the emoji's last byte never comes
    assert tokenizer.decode(ids[:-1], skip_special_tokens=True).endswith("\ufffd")
    detok = IncrementalDetokenizer(tokenizer, [5])
    deltas = [detok.add_tokens(cut[i:i + step]) for i in range(0, len(cut), step)]
    deltas.append(detok.flush())
    context = tokenizer.decode([5], skip_special_tokens=True)
    whole = tokenizer.decode([5] + cut, skip_special_tokens=True)
    assert "".join(deltas) == whole[len(context):]
    assert "".join(deltas).startswith("ok ") and "\ufffd" in "".join(deltas)
