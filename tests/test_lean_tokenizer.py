"""The engine's tokenizer (nvray.lean_tokenizer, no transformers) against transformers' own
AutoTokenizer on the same files: ids, text, special tokens and rendered chat templates.

Three checkpoints' worth of tokenizer files: the tiny model's (what transformers saves), a
Qwen-style directory written the way Qwen3's checkpoints lay theirs out (the template inside
tokenizer_config.json, ``added_tokens_decoder``, ``Qwen2Tokenizer`` as the class, an NFC
normalizer and a split regex before the byte-level step), and a word-piece one whose config asks
for transformers' space clean-up on decode.
"""

from __future__ import annotations

import enum
import json
import os
import random
import subprocess
import sys
import typing

import jinja2
import numpy
import pytest

from nvray.lean_tokenizer import LeanTokenizer
from nvray.models.tiny import CHAT_TEMPLATE, tiny_model_path
from nvray.tokenizer import load_tokenizer

TEXTS = ["Hello, nvray.", "  two  spaces\tand a tab\n\nnew lines\r\n", "Héllo wörld, naïve café",
         "你好，世界。こんにちは。", "emoji 🙂✨ and ZWJ 👩‍👩‍👧", "<|im_start|>user\nhi<|im_end|>",
         "a<think>b</think>c", "x" * 300, "ﬁ ligature, Å (A + ring) vs Å", "it 's , don 't ."]
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
              r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# a template that calls what Hub templates call: namespace, loop controls, tojson with options,
# dict(), the generation tag, the special-token variables and the reasoning aliases
FEATURE_TEMPLATE = (
    "{% set ns = namespace(n=0) %}{{ bos_token or '' }}{{ eos_token }}"
    "{% for m in messages %}{% if loop.index > 4 %}{% break %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}[{{ m.role }}|{{ m.content }}|{{ m.reasoning_content or '' }}"
    "|{{ m.thinking or '' }}|{{ m.name is defined }}]{% if m.role == 'assistant' %}{% generation %}<gen>{{ m.content }}"
    "{% endgeneration %}{% endif %}{% endfor %}{{ ns.n }}"
    "{{ dict(a=1, b=[1, 2]) | tojson(indent=2, sort_keys=True) }}{{ 'é' | tojson }}"
    "{% if tools %}{{ tools | tojson }}{% endif %}{{ strftime_now('%Y') }}{{ extra }}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "add them"},
            {"role": "user", "content": "and 3+3?", "name": None}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add <two> numbers",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "number"}}}}}]
TOOL_TURNS = [{"role": "user", "content": "add 1 and 2"},
              {"role": "assistant", "content": "", "tool_calls": [
                  {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}},
                  {"type": "function", "function": {"name": "add", "arguments": '{"a": 3}'}}]},
              {"role": "tool", "content": "3"}]


def _hf(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _random_ids(n_vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(n_vocab) for _ in range(rng.randint(1, 40))] for _ in range(40)]


def _train(model: str, normalizer, pre_tokenizer, decoder, specials: list[str]):
    from tokenizers import Tokenizer, models, trainers

    corpus = [t for t in TEXTS for _ in range(3)] + ["The quick brown fox's 12 jumps. " * 4]
    if model == "bpe":
        from tokenizers import pre_tokenizers

        tok = Tokenizer(models.BPE())
        trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=specials,
                                            show_progress=False)
    tok.normalizer, tok.pre_tokenizer, tok.decoder = normalizer, pre_tokenizer, decoder
    tok.train_from_iterator(corpus, trainer)
    return tok


@pytest.fixture(scope="module")
def qwen_style_dir(tmp_path_factory) -> str:
    """Tokenizer files laid out as Qwen3's checkpoints lay them out."""
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers

    path = str(tmp_path_factory.mktemp("qwen-style"))
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = _train("bpe", normalizers.NFC(), pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
        decoders.ByteLevel(), specials)
    plain = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    tok.save(os.path.join(path, "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                       "rstrip": False, "single_word": False,
                                       "special": t in specials} for t in specials + plain}
    config = {"add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
              "additional_special_tokens": specials[1:], "bos_token": None,
              "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
              "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": 131072,
              "pad_token": "<|endoftext|>", "split_special_tokens": False,
              "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
              "tool_start_token": "<tool_call>"}  # a model's own named token (transformers 5)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return path


@pytest.fixture(scope="module")
def wordpiece_dir(tmp_path_factory) -> str:
    """A word-piece tokenizer whose config asks for transformers' space clean-up on decode."""
    from tokenizers import decoders, normalizers, pre_tokenizers

    path = str(tmp_path_factory.mktemp("wordpiece"))
    specials = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[IMG]"]
    tok = _train("wordpiece", normalizers.BertNormalizer(lowercase=True),
                 pre_tokenizers.BertPreTokenizer(), decoders.WordPiece(), specials)
    tok.save(os.path.join(path, "tokenizer.json"))
    config = {"clean_up_tokenization_spaces": True, "unk_token": "[UNK]", "cls_token": "[CLS]",
              "sep_token": "[SEP]", "pad_token": "[PAD]", "tokenizer_class": "TokenizersBackend",
              "extra_special_tokens": {"image_token": "[IMG]"},  # named, as a dict
              "chat_template": [{"name": "default", "template": "{{ messages[0].content }}"},
                                {"name": "tool_use", "template": "tools:{{ tools | length }}"}]}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return path


@pytest.fixture(scope="module", params=["tiny", "qwen_style", "wordpiece"])
def pair(request, qwen_style_dir, wordpiece_dir):
    path = {"tiny": tiny_model_path(), "qwen_style": qwen_style_dir,
            "wordpiece": wordpiece_dir}[request.param]
    return LeanTokenizer(path), _hf(path)


def test_encode_matches_transformers(pair):
    lean, hf = pair
    for text in TEXTS:
        for special in (False, True):
            assert lean.encode(text, add_special_tokens=special) == \
                hf.encode(text, add_special_tokens=special), (text, special)


def test_decode_matches_transformers(pair):
    lean, hf = pair
    for ids in _random_ids(len(hf), seed=1) + [hf.encode(t, add_special_tokens=False)
                                               for t in TEXTS]:
        for skip in (False, True):
            assert lean.decode(ids, skip_special_tokens=skip) == \
                hf.decode(ids, skip_special_tokens=skip), (ids, skip)


def test_space_clean_up_is_skipped_for_bpe_as_in_transformers(qwen_style_dir, tmp_path):
    """transformers ignores ``clean_up_tokenization_spaces`` for BPE models (it would eat the
    spaces before punctuation that BPE decodes exactly)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(qwen_style_dir, name)) as src:
            data = json.load(src)
        if name == "tokenizer_config.json":
            data["clean_up_tokenization_spaces"] = True
        with open(tmp_path / name, "w") as dst:
            json.dump(data, dst)
    lean, hf = LeanTokenizer(str(tmp_path)), _hf(str(tmp_path))
    ids = hf.encode("it 's , don 't . ok ?", add_special_tokens=False)
    assert lean.decode(ids) == hf.decode(ids) == "it 's , don 't . ok ?"


def test_special_tokens_match_transformers(pair):
    lean, hf = pair
    assert lean.eos_token_id == hf.eos_token_id
    assert sorted(lean.all_special_ids) == sorted(hf.all_special_ids)
    assert lean.special_tokens_map == hf.special_tokens_map
    assert len(lean) == len(hf)


@pytest.mark.parametrize("name", ["tiny", "qwen_style"])
def test_model_chat_template_matches_transformers(name, qwen_style_dir):
    path = tiny_model_path() if name == "tiny" else qwen_style_dir
    lean, hf = LeanTokenizer(path), _hf(path)
    cases = [dict(conversation=MESSAGES, add_generation_prompt=True),
             dict(conversation=MESSAGES[1:2], add_generation_prompt=True, enable_thinking=False),
             dict(conversation=MESSAGES, add_generation_prompt=False),
             dict(conversation=MESSAGES + TOOL_TURNS, tools=TOOLS, add_generation_prompt=True)]
    for case in cases:
        for tokenize in (False, True):
            assert lean.apply_chat_template(**case, tokenize=tokenize) == \
                hf.apply_chat_template(**case, tokenize=tokenize, return_dict=False), case


def test_template_features_match_transformers():
    path = tiny_model_path()
    lean, hf = LeanTokenizer(path), _hf(path)
    for msgs in (MESSAGES, MESSAGES + [{"role": "assistant", "content": "6",
                                        "thinking": "3 and 3"}]):
        for tools in (None, TOOLS):
            kwargs = dict(chat_template=FEATURE_TEMPLATE, tools=tools, tokenize=False,
                          add_generation_prompt=True, extra={"k": "<v>"})
            assert lean.apply_chat_template(msgs, **kwargs) == \
                hf.apply_chat_template(msgs, **kwargs)


class Role(str, enum.Enum):
    USER = "user"


class Point(typing.NamedTuple):
    x: int
    y: int


def test_template_sees_plain_data_as_transformers_gives_it():
    """A str enum's value (not its name), a named tuple as a tuple, a numpy scalar's value."""
    path = tiny_model_path()
    lean, hf = LeanTokenizer(path), _hf(path)
    template = ("{% for m in messages %}{{ m.role }}{% if m.role == 'user' %}=user{% endif %}"
                "{{ m.point }}{{ m.point.x }}{% if not m.flag %}!{% endif %}{{ m.n + 1 }}"
                "{{ m.flag | tojson }}{% endfor %}{{ chosen }}")
    msgs = [{"role": Role.USER, "content": "hi", "point": Point(1, 2),
             "flag": numpy.bool_(False), "n": numpy.int64(4)}]
    kwargs = dict(chat_template=template, tokenize=False, chosen=Role.USER)
    rendered = lean.apply_chat_template(msgs, **kwargs)
    assert rendered == hf.apply_chat_template(msgs, **kwargs)
    assert rendered.startswith("user=user")


def test_template_given_by_text_on_a_one_template_model():
    """``chat_template`` that is not one of the model's names is the template itself."""
    lean, hf = LeanTokenizer(tiny_model_path()), _hf(tiny_model_path())
    for text in ("default", "{{ messages | length }}"):
        assert lean.apply_chat_template(MESSAGES, chat_template=text, tokenize=False) == \
            hf.apply_chat_template(MESSAGES, chat_template=text, tokenize=False)


def test_named_templates_are_chosen_as_transformers_chooses(wordpiece_dir):
    lean, hf = LeanTokenizer(wordpiece_dir), _hf(wordpiece_dir)
    for tools in (None, TOOLS):
        rendered = lean.apply_chat_template(MESSAGES, tools=tools, tokenize=False)
        assert rendered == hf.apply_chat_template(MESSAGES, tools=tools, tokenize=False)
    assert rendered == "tools:1"


def test_template_errors_and_sandbox():
    lean = LeanTokenizer(tiny_model_path())
    with pytest.raises(jinja2.TemplateError, match="no system turns"):
        lean.apply_chat_template(MESSAGES, tokenize=False, chat_template=(
            "{% if messages[0].role == 'system' %}{{ raise_exception('no system turns') }}"
            "{% endif %}"))
    with pytest.raises(jinja2.exceptions.SecurityError):
        lean.apply_chat_template(MESSAGES, tokenize=False,
                                 chat_template="{% set ns = namespace(_x=1) %}")
    with pytest.raises(jinja2.exceptions.SecurityError):  # no way out of the sandbox
        lean.apply_chat_template(MESSAGES, tokenize=False,
                                 chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ValueError, match="empty conversation"):
        lean.apply_chat_template([], tokenize=False)


def test_no_template_is_a_clear_error(tmp_path):
    for name in ("tokenizer.json",):
        with open(os.path.join(tiny_model_path(), name)) as src, \
                open(tmp_path / name, "w") as dst:
            dst.write(src.read())
    with pytest.raises(ValueError, match="no chat template"):
        LeanTokenizer(str(tmp_path)).apply_chat_template(MESSAGES)


def test_engine_tokenizer_loads_without_transformers_or_torch():
    """The point of the lean tokenizer: an engine's driver loads it without importing
    transformers (and the torch that comes with it)."""
    code = ("import sys; from nvray.tokenizer import load_tokenizer; "
            f"t = load_tokenizer({tiny_model_path()!r}); "
            "print(type(t).__name__, t.encode('hi there', add_special_tokens=False) != [], "
            "sorted(m for m in ('transformers', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert out == ["LeanTokenizer", "True", "[]"]


def test_engine_loads_byte_level_tokenizers_lean_and_others_through_transformers(
        qwen_style_dir, wordpiece_dir):
    """transformers runs a byte-level tokenizer.json as it stands, but rebuilds some others
    (Llama 2's SentencePiece-derived ones) from its own classes: those stay transformers'."""
    assert type(load_tokenizer(qwen_style_dir)).__name__ == "LeanTokenizer"
    assert type(load_tokenizer(tiny_model_path())).__name__ == "LeanTokenizer"
    assert type(load_tokenizer(wordpiece_dir)).__module__.startswith("transformers.")


def test_checkpoint_without_tokenizer_json_loads_through_transformers(tmp_path,
                                                                        qwen_style_dir):
    """Slow-tokenizer files only (vocab.json + merges.txt): transformers loads them."""
    from tokenizers import Tokenizer

    Tokenizer.from_file(os.path.join(qwen_style_dir, "tokenizer.json")).model.save(str(tmp_path))
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        json.dump({"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>"}, f)
    tok = load_tokenizer(str(tmp_path))
    assert type(tok).__module__.startswith("transformers.")
    assert tok.decode(tok.encode("The quick brown fox", add_special_tokens=False)) == \
        "The quick brown fox"
