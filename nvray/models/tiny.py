"""The embedded default model: a tiny random Qwen3 checkpoint built locally, no download.

``build_checkpoint`` writes a complete HF-format checkpoint — config.json, model.safetensors
(random weights from a fixed seed), generation_config.json and a byte-level BPE tokenizer with
special tokens, Qwen3's ``<think>``/``</think>`` tokens and a ChatML chat template that honours
``enable_thinking`` as Qwen3's does — for any Qwen3/Qwen2 shape; tests use it for other random
configs too. ``resolve_model("tiny")`` builds the default once into a cache directory
(``$NVRAY_CACHE_DIR``, default ``~/.cache/nvray``) whose name carries a fingerprint of everything
the build depends on, so a changed tokenizer or template never reuses a stale cache; the engine
then loads it with exactly the code that loads a real model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

from nvray.cache_dirs import cache_dir

TINY_NAME = "tiny"
_TINY_VERSION = "tiny-qwen3-v3"  # bump when the weights' recipe changes
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Like Qwen3's: ordinary added tokens (not special), so decoded output keeps them and a
# reasoning parser can find them; they take the last ids of the tokenizer's vocabulary.
THINK_TOKENS = ["<think>", "</think>"]
_EOS_IDS = [SPECIAL_TOKENS.index("<|endoftext|>"), SPECIAL_TOKENS.index("<|im_end|>")]
_TINY_TOKENIZER_VOCAB = 512
# ChatML; with enable_thinking=false the generation prompt closes an empty think block, which is
# how Qwen3's template switches thinking off. Tools render as Qwen3's template renders them: their
# signatures in the system turn inside <tools></tools>, the assistant's calls as
# <tool_call>{"name": ..., "arguments": ...}</tool_call> blocks, and each tool result as a user
# turn inside <tool_response></tool_response>.
_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n</tools>\\n\\n' }}For each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    + _TOOLS_PREAMBLE + "{{ '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and tools and loop.first %}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + "
    "'\n</tool_response><|im_end|>\n' }}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}"
    "{% set f = call['function'] if call['function'] is defined else call %}"
    "{% if message['content'] or not loop.first %}{{ '\n' }}{% endif %}"
    "{{ '<tool_call>\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}"
    "{% if f['arguments'] is string %}{{ f['arguments'] }}{% else %}{{ f['arguments'] | tojson }}"
    "{% endif %}{{ '}\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}"
)
TINY_CONFIG: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 2048, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
_CORPUS = """\
Ray is a unified framework for scaling AI and Python applications. An inference engine keeps
the weights of a language model on the accelerator and serves many requests at once. Each
request is a prompt: a list of tokens. The engine runs a prefill over the prompt and then
decodes one token at a time, keeping the keys and values of every token in a paged cache.
Blocks of the cache are shared between requests that start with the same text, so a system
prompt is computed once. The scheduler builds a batch every step, mixing decodes with chunks
of new prompts under a token budget. When memory runs out a request is preempted and
recomputed later. Hello world! The quick brown fox jumps over the lazy dog. 0123456789.
Héllo wörld, naïve café, 你好，世界。こんにちは。Привет, мир! 🙂 ✨
def main(): print("hello, world") # code, too: for i in range(10): yield i * i
"""


def _synthetic_words(vocab_size: int) -> list[str]:
    """Lines of pseudo-random words, so that BPE can learn a large vocabulary (e.g. Qwen3's)."""
    import random  # noqa: PLC0415

    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    words = ["".join(rng.choices(letters, k=rng.randint(3, 9))) for _ in range(3 * vocab_size)]
    return [" ".join(words[i:i + 40]) for i in range(0, len(words), 40)]


def _train_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE of ``vocab_size`` tokens in all, the think tokens last."""
    from tokenizers import (AddedToken, Tokenizer, decoders, models,  # noqa: PLC0415
                            pre_tokenizers, trainers)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(THINK_TOKENS),
                                  special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    corpus = _CORPUS.splitlines() * 4
    tok.train_from_iterator(corpus + (_synthetic_words(vocab_size) if vocab_size > 4096 else []),
                            trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    return tok


def _save_tokenizer(path: str, vocab_size: int) -> int:
    """Write tokenizer files; returns the tokenizer's vocabulary size."""
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    fast = PreTrainedTokenizerFast(tokenizer_object=_train_tokenizer(vocab_size),
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIAL_TOKENS[1:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return len(fast)


def _hf_config(arch: str, shape: dict[str, Any], vocab_size: int, eos_ids: list[int]) -> dict[str, Any]:
    qwen2 = arch == "Qwen2ForCausalLM"
    cfg = {"architectures": [arch], "model_type": "qwen2" if qwen2 else "qwen3",
           "vocab_size": vocab_size, "hidden_act": "silu", "dtype": "float32",
           "bos_token_id": eos_ids[0], "eos_token_id": eos_ids[-1], "attention_bias": qwen2,
           "use_sliding_window": False, "attention_dropout": 0.0, "initializer_range": 0.02,
           "use_cache": True, **shape}
    if qwen2:
        cfg.pop("head_dim", None)
    return cfg


def _random_weights(cfg: dict[str, Any], seed: int, std: float) -> dict[str, Any]:
    import torch  # noqa: PLC0415

    gen = torch.Generator().manual_seed(seed)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    nh, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    qwen2 = cfg["model_type"] == "qwen2"

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm_weight(n: int) -> torch.Tensor:
        return 1.0 + torch.randn(n, generator=gen) * 0.1

    w = {"model.embed_tokens.weight": normal(v, h), "model.norm.weight": norm_weight(h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_weight(h)
        w[p + "post_attention_layernorm.weight"] = norm_weight(h)
        for name, rows in (("q_proj", nh * d), ("k_proj", kvh * d), ("v_proj", kvh * d)):
            w[p + f"self_attn.{name}.weight"] = normal(rows, h)
            if qwen2:
                w[p + f"self_attn.{name}.bias"] = normal(rows)
        w[p + "self_attn.o_proj.weight"] = normal(h, nh * d)
        if not qwen2:
            w[p + "self_attn.q_norm.weight"] = norm_weight(d)
            w[p + "self_attn.k_norm.weight"] = norm_weight(d)
        w[p + "mlp.gate_proj.weight"] = normal(inter, h)
        w[p + "mlp.up_proj.weight"] = normal(inter, h)
        w[p + "mlp.down_proj.weight"] = normal(h, inter)
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = normal(v, h)
    return w


def build_checkpoint(path: str, shape: dict[str, Any] | None = None, seed: int = 0,
                     architecture: str = "Qwen3ForCausalLM", tokenizer_vocab_size: int = _TINY_TOKENIZER_VOCAB,
                     std: float = 0.2, vocab_size: int | None = None,
                     dtype: str = "float32") -> str:
    """Write a random HF checkpoint of the given shape (defaults: the tiny model) to ``path``.

    ``vocab_size`` pads the model's vocabulary beyond the tokenizer's (as real Qwen3 checkpoints
    do: 151936 rows for a smaller tokenizer); ``dtype`` is the dtype of the saved weights.
    """
    import torch  # noqa: PLC0415
    from safetensors.torch import save_file  # noqa: PLC0415

    os.makedirs(path, exist_ok=True)
    vocab = _save_tokenizer(path, tokenizer_vocab_size)
    if vocab_size is not None and vocab_size < vocab:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {vocab} tokens")
    cfg = _hf_config(architecture, {**TINY_CONFIG, **(shape or {})}, vocab_size or vocab, _EOS_IDS)
    cfg["dtype"] = dtype
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": _EOS_IDS[0], "eos_token_id": _EOS_IDS, "do_sample": False}, f)
    weights = {k: t.to(getattr(torch, dtype)).contiguous()
               for k, t in _random_weights(cfg, seed, std).items()}
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def tiny_cache_name() -> str:
    """The tiny model's cache directory name: the recipe's version and a fingerprint of the
    tokenizer's inputs, the chat template and the shape."""
    recipe = json.dumps([SPECIAL_TOKENS, THINK_TOKENS, CHAT_TEMPLATE, TINY_CONFIG, _CORPUS],
                        sort_keys=True)
    return f"{_TINY_VERSION}-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"


def tiny_model_path() -> str:
    """Path of the embedded tiny model, built on first use (atomically: safe across processes)."""
    final = os.path.join(cache_dir(), tiny_cache_name())
    if tiny_is_built():
        return final
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=cache_dir(), prefix=".building-")
    try:
        build_checkpoint(tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first
            if not os.path.exists(os.path.join(final, "model.safetensors")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def tiny_recipe_config() -> dict[str, Any]:
    """The embedded model's config.json as its recipe will write it, without building it
    (building needs torch): what ``nvray.preflight`` checks the engine options against when
    the model is not built yet. Its ``vocab_size`` is the one the recipe asks the tokenizer
    trainer for."""
    return _hf_config("Qwen3ForCausalLM", TINY_CONFIG, _TINY_TOKENIZER_VOCAB, _EOS_IDS)


def tiny_is_built() -> bool:
    return os.path.exists(os.path.join(cache_dir(), tiny_cache_name(), "model.safetensors"))


def resolve_model(model: str) -> str:
    """``"tiny"`` -> the embedded model's path; otherwise a local checkpoint directory."""
    if model == TINY_NAME:
        return tiny_model_path()
    if not os.path.isdir(model) or not os.path.exists(os.path.join(model, "config.json")):
        raise ValueError(f"model={model!r} is not a local checkpoint directory with a config.json "
                         "(nvray never downloads weights; pass a path or 'tiny')")
    return model
