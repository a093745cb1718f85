"""Random pooling checkpoints written by transformers' own classes (the oracle) beside the
embedded tiny model's tokenizer: an embedding model saved as Qwen3-Embedding's are (a bare
``Qwen3Model``, sentence-transformers' last-token Pooling and Normalize modules, a tokenizer
that ends a text with <|endoftext|>), and a Qwen3 causal LM whose tokenizer spells "yes" and
"no" as one token each (a Qwen3-Reranker's judge)."""

from __future__ import annotations

import json
import os
import shutil

import torch

from nvray.models.tiny import resolve_model

SHAPE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "max_position_embeddings": 1024, "tie_word_embeddings": False}


def _tokenizer_files(path: str) -> None:
    tiny = resolve_model("tiny")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(tiny, name)):
            shutil.copy(os.path.join(tiny, name), os.path.join(path, name))


def _randomized(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.2 * noise)
    return model.eval()


def _end_with_eos(tokenizer_json: str) -> None:
    """The tokenizer appends <|endoftext|> to a text, as Qwen3-Embedding's does."""
    with open(tokenizer_json) as f:
        spec = json.load(f)
    eos = {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"Sequence": {"id": "A", "type_id": 0}}, eos],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}},
                 eos],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0],
                                             "tokens": ["<|endoftext|>"]}}}
    with open(tokenizer_json, "w") as f:
        json.dump(spec, f)


def write_embedder(path: str, seed: int = 3) -> torch.nn.Module:
    """The embedding checkpoint at ``path``; returns transformers' model of it."""
    from transformers import Qwen3Config, Qwen3Model

    os.makedirs(path, exist_ok=True)
    model = _randomized(Qwen3Model(Qwen3Config(vocab_size=512, **SHAPE)), seed)
    model.save_pretrained(path)  # as AutoModel saves it: "Qwen3Model", no LM head, no "model."
    _tokenizer_files(path)
    _end_with_eos(os.path.join(path, "tokenizer.json"))
    modules = [("Transformer", ""), ("Pooling", "1_Pooling"), ("Normalize", "2_Normalize")]
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump([{"idx": i, "name": str(i), "path": where,
                    "type": f"sentence_transformers.models.{kind}"}
                   for i, (kind, where) in enumerate(modules)], f)
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": SHAPE["hidden_size"],
                   "pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}, f)
    return model


def write_reranker(path: str, seed: int = 5) -> torch.nn.Module:
    """The reranker checkpoint at ``path``; returns transformers' model of it."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    os.makedirs(path, exist_ok=True)
    _tokenizer_files(path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens(["yes", "no"])  # Qwen's vocabulary has each as one token
    tok.save_pretrained(path)
    config = Qwen3Config(vocab_size=len(tok), **SHAPE)
    config.architectures = ["Qwen3ForCausalLM"]
    model = _randomized(Qwen3ForCausalLM(config), seed)
    model.save_pretrained(path)
    return model


def hf_last_state(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' final hidden state of the last token."""
    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0, -1]


def hf_yes_probability(model: torch.nn.Module, ids: list[int], yes: int, no: int) -> float:
    """The reranker recipe's score: the softmax of the "yes" and "no" logits at the end."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    return torch.softmax(logits[[yes, no]], dim=0)[0].item()
