"""Random-weight checkpoints written by transformers' own model classes (the oracle), for the
model families beyond the embedded Qwen3: the config class of the family, weights drawn
large enough that greedy decoding does not tie (std 0.2; norms near their identity), saved with
``save_pretrained``, beside the embedded tiny model's tokenizer so the engine can serve them."""

from __future__ import annotations

import os
import shutil
from typing import Any

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "generation_config.json", "chat_template.jinja")

SHAPES: dict[str, dict[str, Any]] = {
    # Llama 3.x: GQA, untied (the 8B's layout), llama3 rope scaling as Llama-3.1 ships it
    "llama3": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
               "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False,
               "max_position_embeddings": 1024,
               "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 128}},
    # Llama 3.2 1B/3B's layout: tied embeddings, MHA, wider heads
    "llama3-tied": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
                    "num_attention_heads": 2, "num_key_value_heads": 2,
                    "tie_word_embeddings": True, "max_position_embeddings": 1024,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
                "sliding_window": None, "max_position_embeddings": 1024},
    "qwen3-moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                  "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
                  "norm_topk_prob": True, "max_position_embeddings": 1024},
    # uneven: a dense layer among sparse ones, top-4 of 6 unnormalised, tied, MHA
    "qwen3-moe-mixed": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                        "hidden_size": 48, "intermediate_size": 64, "moe_intermediate_size": 24,
                        "num_hidden_layers": 3, "num_attention_heads": 4,
                        "num_key_value_heads": 4, "head_dim": 16, "num_experts": 6,
                        "num_experts_per_tok": 4, "norm_topk_prob": False,
                        "mlp_only_layers": [1], "tie_word_embeddings": True,
                        "max_position_embeddings": 1024},
    # Gemma 3: a window of 8 tokens over 16-token blocks reaches past itself within one prompt;
    # global layer 3 of 4 (pattern 2), local rope 10k / global 1M with linear scaling as the 4B
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
               "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
               # attention scaled by 24 ** -0.5, not head_dim ** -0.5 (Gemma-3-27B: 168 vs 128)
               "query_pre_attn_scalar": 24, "sliding_window": 8,
               "layer_types": ["sliding_attention", "full_attention"] * 2,
               "max_position_embeddings": 1024,
               "rope_parameters": {
                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                   "full_attention": {"rope_type": "linear", "factor": 8.0,
                                      "rope_theta": 1000000.0}}},
}

_QWEN3_5_LINEAR = {"linear_num_key_heads": 2, "linear_num_value_heads": 4,
                   "linear_key_head_dim": 16, "linear_value_head_dim": 8,
                   "linear_conv_kernel_dim": 4}
# Qwen3.5 hybrids (linear + gated full attention): not in FAMILIES' generic tests (their
# prefix cache keeps states, not blocks alone); tests/test_qwen3_5.py runs them
HYBRID_SHAPES: dict[str, dict[str, Any]] = {
    # a full-attention layer first; GQA in the linear layers (4 value heads read 2 key heads)
    "qwen3_5": {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
                "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "layer_types": ["full_attention", "linear_attention", "linear_attention",
                                "full_attention"],
                "max_position_embeddings": 1024, **_QWEN3_5_LINEAR},
    # ends in linear layers; tied; one key head per value head
    "qwen3_5-tied": {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
                     "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 3,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                     "layer_types": ["linear_attention", "full_attention", "linear_attention"],
                     "tie_word_embeddings": True, "max_position_embeddings": 1024,
                     **_QWEN3_5_LINEAR, "linear_num_value_heads": 2},
    "qwen3_5-moe": {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
                    "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "head_dim": 16, "moe_intermediate_size": 32,
                    "shared_expert_intermediate_size": 48, "num_experts": 8,
                    "num_experts_per_tok": 2, "max_position_embeddings": 1024,
                    "layer_types": ["linear_attention", "full_attention"] * 2, **_QWEN3_5_LINEAR},
    # as Qwen3.5 ships: a vision-language checkpoint (a one-block vision tower) whose language
    # model nvray serves
    "qwen3_5-vl": {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                   "text_config": {"hidden_size": 64, "intermediate_size": 96,
                                   "num_hidden_layers": 2, "num_attention_heads": 4,
                                   "num_key_value_heads": 2, "head_dim": 16,
                                   "layer_types": ["linear_attention", "full_attention"],
                                   "max_position_embeddings": 1024, **_QWEN3_5_LINEAR},
                   "vision_config": {"depth": 1, "hidden_size": 32, "num_heads": 2,
                                     "intermediate_size": 64, "out_hidden_size": 64,
                                     "patch_size": 8, "num_position_embeddings": 64}},
}
# norms scaling by 1 + w (their random weights centred on 0); Qwen3.5's linear attention's
# gated norm scales by w
_ZERO_CENTRED_NORMS = ("gemma", "qwen3_5")
_PLAIN_NORMS = ("linear_attn.norm.",)


def _randomize(model: Any, seed: int, std: float, norm_offset: float) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name and param.dim() == 1:
                offset = 1.0 if any(p in name for p in _PLAIN_NORMS) else norm_offset
                param.copy_(offset + 0.1 * noise)
            else:
                param.copy_(noise * std)


def write_hf_checkpoint(path: str, shape: dict[str, Any], tokenizer_from: str, seed: int = 0,
                        std: float = 0.2) -> str:
    """Build the family's transformers model of ``shape`` with random weights and save it (and
    the tokenizer of the checkpoint at ``tokenizer_from``) to ``path``."""
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(tokenizer_from, "config.json")) as f:
        tok_cfg = json.load(f)
    kwargs = {k: v for k, v in shape.items() if k not in ("architectures", "model_type")}
    tokens = {"vocab_size": tok_cfg["vocab_size"], "bos_token_id": tok_cfg["bos_token_id"],
              "eos_token_id": tok_cfg["eos_token_id"], "pad_token_id": tok_cfg["bos_token_id"]}
    vision_language = "text_config" in kwargs
    if vision_language:  # the token ids belong to its language model's config
        kwargs["text_config"] = {**kwargs["text_config"], **tokens}
        config = AutoConfig.for_model(shape["model_type"], **kwargs)
    else:
        config = AutoConfig.for_model(shape["model_type"], **tokens, **kwargs)
    config.architectures = shape["architectures"]
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if vision_language else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    norm_offset = 0.0 if shape["model_type"].startswith(_ZERO_CENTRED_NORMS) else 1.0
    _randomize(model, seed, std, norm_offset)
    model.save_pretrained(path)
    for name in _TOKENIZER_FILES:
        if os.path.exists(os.path.join(tokenizer_from, name)):
            shutil.copy(os.path.join(tokenizer_from, name), os.path.join(path, name))
    return path
