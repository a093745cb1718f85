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


class _PythonTokenizer:
    """A tokenizer without a Rust backend (a slow tokenizer's interface: ``decode`` and its
    special ids), as some checkpoints ship: the window path decodes through it."""

    def __init__(self, tokenizer, special_ids=None) -> None:
        self._tokenizer = tokenizer
        self.all_special_ids = tokenizer.all_special_ids if special_ids is None else special_ids

    def __len__(self) -> int:
        return len(self._tokenizer)

    def decode(self, ids, skip_special_tokens=False):
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class _UnlistedSpecials:
    """A fast tokenizer whose ``all_special_ids`` misses its special tokens (an added token
    marked special in tokenizer.json only): its Rust backend still knows them."""

    def __init__(self, tokenizer) -> None:
        self.backend_tokenizer = tokenizer.backend_tokenizer
        self.all_special_ids = []


@pytest.mark.parametrize("skip_special_tokens", [True, False], ids=["skip", "keep"])
@pytest.mark.parametrize("kind", ["fast", "python", "unlisted-specials"])
def test_every_tokenizer_kind_streams_the_tokenizers_own_decode(tokenizer, kind,
                                                                 skip_special_tokens):
    """Random ids with special tokens among them, one or several a step, through a fast
    tokenizer, one without a Rust backend and one whose special-id list is empty; special
    tokens skipped or kept as asked: the deltas add up to the tokenizer's own decode."""
    wrapped = {"fast": tokenizer, "python": _PythonTokenizer(tokenizer),
               "unlisted-specials": _UnlistedSpecials(tokenizer)}[kind]
    rng = random.Random(11)
    specials = tokenizer.all_special_ids
    ids = [rng.choice(specials) if rng.random() < 0.2 else rng.randrange(len(tokenizer))
           for _ in range(300)]
    detok = IncrementalDetokenizer(wrapped, [5, 6, 7], skip_special_tokens)
    assert (detok.stream is None) == (kind == "python")
    deltas, at = [], 0
    while at < len(ids):
        take = rng.choice((1, 1, 2, 3))
        deltas.append(detok.add_tokens(ids[at:at + take]))
        at += take
    deltas.append(detok.flush())
    context = tokenizer.decode([5, 6, 7], skip_special_tokens=skip_special_tokens)
    whole = tokenizer.decode([5, 6, 7] + ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == whole[len(context):]
    if not skip_special_tokens:
        assert "<|im_end|>" in "".join(deltas) or "<|endoftext|>" in "".join(deltas)


@pytest.fixture(scope="module")
def metaspace_tokenizer():
    """A SentencePiece-style tokenizer (``▁`` for a space, dropped at the start of a text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "▁Hello": 2, "▁world": 3, "!": 4, "▁ok": 5}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")


@pytest.mark.parametrize("prompt", [[2], [2, 3, 4]], ids=["one-token", "three-tokens"])
def test_the_first_output_token_keeps_the_space_a_tokenizer_drops_at_a_texts_start(
        metaspace_tokenizer, detokenizer_kind, prompt):
    """The prompt's last tokens are the output's left context: "▁world" after a prompt is
    " world", though it decodes alone to "world"."""
    assert metaspace_tokenizer.decode([3]) == "world"
    detok = IncrementalDetokenizer(metaspace_tokenizer, prompt)
    text = "".join(detok.add_tokens([t]) for t in (3, 5, 4)) + detok.flush()
    assert text == " world ok!"


def test_an_output_token_that_completes_the_prompts_split_character_leaks_nothing(
        tokenizer, detokenizer_kind):
    """The prompt ends in half a character and the first output token holds that character's
    other bytes and more text: no prompt text comes out, and the output is its tokens' own
    text (the bytes without a start come out as U+FFFD), on both paths."""
    rng = random.Random(5)
    vocab = len(tokenizer)
    found = None
    for _ in range(20_000):
        prompt = [rng.randrange(vocab) for _ in range(4)]
        if not tokenizer.decode(prompt).endswith("\ufffd"):
            continue
        for first in rng.sample(range(vocab), 400):
            own = tokenizer.decode([first])
            if (own.startswith("\ufffd") and own.strip("\ufffd")
                    and not tokenizer.decode(prompt + [first]).endswith("\ufffd")
                    and tokenizer.decode(prompt + [first]) != tokenizer.decode(prompt) + own):
                found = prompt, first
                break
        if found:
            break
    assert found, "no prompt ending mid-character completed by a token with more text"
    prompt, first = found
    outputs = [first] + tokenizer.encode(" ok then", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    text = "".join(detok.add_tokens([t]) for t in outputs) + detok.flush()
    assert text == tokenizer.decode(outputs), (prompt, first, text)
