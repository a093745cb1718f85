"""The benchmarks' checkpoints: Qwen3-shaped models with random bf16 weights, built once, and
the other families' shapes as config-only checkpoints the engine fills with random weights.

``random_qwen3_checkpoint(path, shape)`` writes (or finds) a checkpoint of one of
``QWEN3_SHAPES`` at ``path``; ``default_checkpoint(shape)`` is the one in the temp dir that the
benchmarks use without ``--model``. Throughput does not depend on weight values with
``ignore_eos``, so no real weights are needed.
"""

from __future__ import annotations

from typing import Any

# Qwen3-0.6B's and Qwen3-8B's shapes (config.json of Qwen/Qwen3-0.6B and Qwen/Qwen3-8B). As in the
# real checkpoints, the model's 151936 vocabulary rows are a little more than the tokenizer's
# 151669 tokens, so the LM head, the sampler and the detokenizer cost what they cost with the
# real model.
QWEN3_0_6B_SHAPE: dict[str, Any] = {
    "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True}
QWEN3_8B_SHAPE: dict[str, Any] = {
    **QWEN3_0_6B_SHAPE, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
    "num_attention_heads": 32, "tie_word_embeddings": False}
QWEN3_SHAPES: dict[str, dict[str, Any]] = {"0.6b": QWEN3_0_6B_SHAPE, "8b": QWEN3_8B_SHAPE}
QWEN3_VOCAB, QWEN3_TOKENIZER_VOCAB = 151936, 151669

# Other families' shapes, from their config.json (Llama-3.1-8B, Qwen3-30B-A3B, Gemma-3-12B's text
# model; Qwen3.5's below; Qwen3-8B's again): only the config is written, and the engine makes
# random weights on the GPU (load_format="dummy": 16-60 GB of random safetensors would take
# longer to write than to bench).
FAMILY_SHAPES: dict[str, dict[str, Any]] = {
    # Qwen3-8B's shape again, config only: long-context runs need no written weights
    "qwen3-8b": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                 **QWEN3_8B_SHAPE, "vocab_size": QWEN3_VOCAB},
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "vocab_size": 128256, "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "vocab_size": 151936,
        "tie_word_embeddings": False},
    "gemma3-12b": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 3840,
        "intermediate_size": 15360, "num_hidden_layers": 48, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 256, "query_pre_attn_scalar": 256,
        "sliding_window": 1024, "sliding_window_pattern": 6, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "vocab_size": 262208,
        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True},
}
# Qwen3.5: transformers' own configuration classes' defaults, which they call the Qwen3.5-9B-style
# (dense) and Qwen3.5-35B-A3B-style (MoE) configurations, with the released models' rope base and
# context: three linear-attention layers of every four, 16 key / 32 value heads of 128
_QWEN3_5_COMMON: dict[str, Any] = {
    "vocab_size": 248320, "num_attention_heads": 16, "head_dim": 256,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "full_attention_interval": 4,
    "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "mtp_num_hidden_layers": 1,  # the released checkpoints' MTP head (speculative method mtp)
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                        "partial_rotary_factor": 0.25}}
FAMILY_SHAPES.update({
    "qwen3.5-9b": {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
                   **_QWEN3_5_COMMON, "hidden_size": 4096, "intermediate_size": 12288,
                   "num_hidden_layers": 32, "num_key_value_heads": 4},
    "qwen3.5-35b-a3b": {"architectures": ["Qwen3_5MoeForCausalLM"],
                        "model_type": "qwen3_5_moe_text", **_QWEN3_5_COMMON,
                        "hidden_size": 2048, "num_hidden_layers": 40, "num_key_value_heads": 2,
                        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                        "num_experts": 256, "num_experts_per_tok": 8},
})
SHAPES = sorted([*QWEN3_SHAPES, *FAMILY_SHAPES])


def is_config_only(shape: str) -> bool:
    """Whether the shape's checkpoint has a config and no weights (load_format="dummy")."""
    return shape in FAMILY_SHAPES


def random_qwen3_checkpoint(path: str, shape: str = "0.6b", std: float = 0.2) -> str:
    """A Qwen3 checkpoint of the named shape (``QWEN3_SHAPES``) with random bf16 weights at
    ``path`` (built once)."""
    import os  # noqa: PLC0415

    from nvray.models.tiny import build_checkpoint  # noqa: PLC0415

    if shape in FAMILY_SHAPES:
        return config_only_checkpoint(path, shape)
    if shape not in QWEN3_SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {SHAPES}")
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    return build_checkpoint(path, QWEN3_SHAPES[shape], seed=0, vocab_size=QWEN3_VOCAB,
                            tokenizer_vocab_size=QWEN3_TOKENIZER_VOCAB, dtype="bfloat16",
                            std=std)


def config_only_checkpoint(path: str, shape: str) -> str:
    """A tokenizer and the config.json of ``FAMILY_SHAPES[shape]``, no weights (built once)."""
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415

    from nvray.models.tiny import _save_tokenizer  # noqa: PLC0415

    config = os.path.join(path, "config.json")
    if os.path.exists(config):
        return path
    os.makedirs(path, exist_ok=True)
    _save_tokenizer(path, QWEN3_TOKENIZER_VOCAB)
    with open(config + ".tmp", "w") as f:
        json.dump({**FAMILY_SHAPES[shape], "dtype": "bfloat16", "bos_token_id": 0,
                   "eos_token_id": 1}, f, indent=2)
    os.rename(config + ".tmp", config)
    return path


def default_checkpoint(shape: str = "0.6b") -> str:
    """The benchmarks' default model: a Qwen3-shaped random checkpoint in the temp dir."""
    import os  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    name = shape if shape in FAMILY_SHAPES else f"qwen3-{shape}"
    path = os.path.join(tempfile.gettempdir(), f"nvray-{name}-random")
    return random_qwen3_checkpoint(path, shape)


EAGLE3_DRAFT_VOCAB = 32000  # the published EAGLE-3 heads' (Llama 3.1 8B, Qwen3 8B)


def eagle3_checkpoint(target_path: str, with_weights: bool, std: float = 0.02) -> str:
    """An EAGLE-3 head of the target at ``target_path`` in the temp dir (built once per
    config): one Llama
    layer of the target's width and heads, a draft vocabulary of ``EAGLE3_DRAFT_VOCAB`` ids
    (its first ids: ``d2t`` zero), the target's embeddings; random bf16 weights
    ``with_weights``, else the config only (load_format="dummy")."""
    import hashlib  # noqa: PLC0415
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    from nvray.models.tiny import resolve_model  # noqa: PLC0415

    with open(os.path.join(resolve_model(target_path), "config.json")) as f:
        target = json.load(f)
    hidden = target["hidden_size"]
    heads, kv_heads = target["num_attention_heads"], target.get("num_key_value_heads")
    head_dim = target.get("head_dim") or hidden // heads
    vocab = target["vocab_size"]
    draft_vocab = min(EAGLE3_DRAFT_VOCAB, vocab)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
              "hidden_size": hidden, "intermediate_size": target["intermediate_size"],
              "num_attention_heads": heads, "num_key_value_heads": kv_heads or heads,
              "head_dim": head_dim, "num_hidden_layers": 1, "vocab_size": vocab,
              "draft_vocab_size": draft_vocab, "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
              "rope_theta": target.get("rope_theta", 10000.0),
              "max_position_embeddings": target.get("max_position_embeddings", 2048),
              "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    layers = target["num_hidden_layers"]  # EAGLE-3's features: layers 2, L // 2, L - 3
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [
        min(2, layers - 1), layers // 2, max(layers - 3, 0)]}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
    path = os.path.join(tempfile.gettempdir(), f"nvray-eagle3-{digest}"
                        + ("" if with_weights else "-config"))
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    weights = os.path.join(path, "model.safetensors")
    if with_weights and not os.path.exists(weights):
        _write_eagle3_weights(weights, config, std)
    return path


def _write_eagle3_weights(file: str, config: dict[str, Any], std: float) -> None:
    import torch  # noqa: PLC0415
    from safetensors.torch import save_file  # noqa: PLC0415

    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    shapes = {"fc.weight": (hidden, 3 * hidden), "midlayer.self_attn.q_proj.weight": (q, 2 * hidden),
              "midlayer.self_attn.k_proj.weight": (kv, 2 * hidden),
              "midlayer.self_attn.v_proj.weight": (kv, 2 * hidden),
              "midlayer.self_attn.o_proj.weight": (hidden, q),
              "midlayer.mlp.gate_proj.weight": (inter, hidden),
              "midlayer.mlp.up_proj.weight": (inter, hidden),
              "midlayer.mlp.down_proj.weight": (hidden, inter),
              "lm_head.weight": (config["draft_vocab_size"], hidden)}
    g = torch.Generator().manual_seed(0)
    tensors = {name: (torch.randn(shape, generator=g) * std).to(torch.bfloat16)
               for name, shape in shapes.items()}
    for norm in ("midlayer.input_layernorm", "midlayer.hidden_norm",
                 "midlayer.post_attention_layernorm", "norm"):
        tensors[f"{norm}.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    tensors["d2t"] = torch.zeros(config["draft_vocab_size"], dtype=torch.int64)
    save_file(tensors, file)
