"""nvray reads config.json itself (no transformers import in a rank): what it builds from the
file must be what transformers' AutoConfig makes of the same file — the same model (parameter
names and shapes), norm epsilon, rotary base, dtype, length limit and quantization — for full
files, files that leave keys to the architecture's defaults, and both layouts of a key."""

from __future__ import annotations

import json

import pytest
import torch

from nvray.config import EngineConfig
from nvray.layers.rotary import rope_spec_of
from nvray.models.decoder import layer_types_of
from nvray.model_config import load_model_config
from nvray.models import model_class_for
from nvray.quantization import quant_config_for
from nvray.worker.setup import resolve_dtype, resolve_max_model_len

SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "vocab_size": 320}
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
MISTRAL = {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}
GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text"}
QWEN3_5 = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text"}
QWEN3_5_MOE = {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text"}
# as Qwen3.5's checkpoints write rope: M-RoPE sections (plain rope for text), a quarter rotated
QWEN3_5_ROPE = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                "mrope_interleaved": True, "mrope_section": [11, 11, 10]}
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
FP8 = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                               "weight_block_size": [128, 128]}}

CASES = {
    "qwen3, sizes only (defaults for the rest)": {**QWEN3, **SMALL},
    "qwen3, GQA, own head_dim, tied, old rope_theta and torch_dtype":
        {**QWEN3, **SMALL, "num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": True,
         "rope_theta": 1e6, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5,
         "max_position_embeddings": 4096},
    "qwen3, transformers 5 layout (rope_parameters, dtype)":
        {**QWEN3, **SMALL, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
         "dtype": "float16"},
    "qwen3, null num_key_value_heads": {**QWEN3, **SMALL, "num_key_value_heads": None},
    "qwen3, FP8 checkpoint": {**QWEN3, **SMALL, "num_key_value_heads": 2, **FP8},
    "qwen2, sizes only (head_dim from the sizes)": {**QWEN2, **SMALL},
    "qwen2, qkv bias and GQA": {**QWEN2, **SMALL, "num_key_value_heads": 1, "rope_theta": 1e6,
                                "tie_word_embeddings": True},
    "qwen3, YaRN (old layout)": {**QWEN3, **SMALL, "max_position_embeddings": 40960,
                                 "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 32768}},
    "llama, sizes only": {**LLAMA, **SMALL},
    "llama 3.1, old layout": {**LLAMA, **SMALL, "num_key_value_heads": 2, "rope_theta": 5e5,
                              "rope_scaling": LLAMA31_ROPE, "max_position_embeddings": 131072,
                              "mlp_bias": False, "torch_dtype": "bfloat16"},
    "llama 3.2, tied, transformers 5 layout": {
        **LLAMA, **SMALL, "tie_word_embeddings": True, "head_dim": 32,
        "rope_parameters": {**LLAMA31_ROPE, "rope_theta": 5e5, "factor": 32.0}},
    "mistral, sizes only (a window)": {**MISTRAL, **SMALL},
    "mistral, no window": {**MISTRAL, **SMALL, "sliding_window": None, "num_key_value_heads": 2},
    "qwen3-moe, sizes only": {**QWEN3_MOE, **SMALL},
    "qwen3-moe, as 30B-A3B writes it": {**QWEN3_MOE, **SMALL, "num_experts": 8,
                                        "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                        "norm_topk_prob": True, "head_dim": 32,
                                        "num_key_value_heads": 2, "mlp_only_layers": [1]},
    "qwen3-moe, as transformers 5 writes it": {**QWEN3_MOE, **SMALL, "num_local_experts": 4, "num_experts_per_tok": 2,
                                               "moe_intermediate_size": 16,
                                               "decoder_sparse_step": 2},
    "gemma3, sizes only": {**GEMMA3, **SMALL, "head_dim": 16},
    "gemma3, old layout (pattern, local base, scaling)": {
        **GEMMA3, **SMALL, "head_dim": 16, "num_hidden_layers": 4, "sliding_window_pattern": 2,
        "rope_theta": 1e6, "rope_local_base_freq": 1e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 512},
    "qwen3.5, sizes only (layer kinds from the interval, linear attention's defaults)":
        {**QWEN3_5, **SMALL, "num_hidden_layers": 4},
    "qwen3.5, as the checkpoints write it": {
        **QWEN3_5, **SMALL, "num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "rope_parameters": QWEN3_5_ROPE,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]},
    "qwen3.5-moe, sizes only": {**QWEN3_5_MOE, **SMALL, "num_hidden_layers": 4, "num_experts": 8,
                                "num_experts_per_tok": 2},
}


def what_nvray_builds(cfg) -> dict:
    with torch.device("meta"):
        model = model_class_for(cfg)(cfg, None)
    engine = EngineConfig.from_kwargs("tiny")
    quant = quant_config_for(cfg, None)
    return {"params": {n: tuple(p.shape) for n, p in model.named_parameters()},
            "tied": model.tie_word_embeddings,
            "eps": sorted({m.eps for m in model.modules() if hasattr(m, "eps")}),
            "rope": [rope_spec_of(cfg, t) for t in layer_types_of(cfg)],
            "windows": [layer.sliding_window for layer in model.attention_layers()],
            "dtype": (resolve_dtype("auto", cfg, torch.device("cpu")),
                      resolve_dtype("auto", cfg, torch.device("meta"))),
            "max_model_len": resolve_max_model_len(engine, cfg),
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "quant": quant and (quant.block, quant.scale_name, quant.source)}


@pytest.mark.parametrize("name", CASES)
def test_config_json_read_without_transformers_builds_what_autoconfig_builds(tmp_path, name):
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps(CASES[name]))
    ours, theirs = load_model_config(str(tmp_path)), AutoConfig.from_pretrained(str(tmp_path))
    assert what_nvray_builds(ours) == what_nvray_builds(theirs)


def test_a_vision_language_checkpoint_reads_as_its_language_model(tmp_path):
    """Qwen3.5 ships as ``Qwen3_5ForConditionalGeneration``: nvray builds from its
    ``text_config`` what transformers builds from it (the top level keeps the architecture)."""
    from transformers import AutoConfig

    text = dict(CASES["qwen3.5, as the checkpoints write it"])
    text.pop("architectures")
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "text_config": text, "vision_config": {"depth": 1, "hidden_size": 32}}))
    ours = load_model_config(str(tmp_path))
    theirs = AutoConfig.from_pretrained(str(tmp_path)).get_text_config()
    theirs.architectures = ["Qwen3_5ForCausalLM"]
    assert ours.architectures == ["Qwen3_5ForConditionalGeneration"]
    assert what_nvray_builds(ours) == what_nvray_builds(theirs)


def test_the_embedded_checkpoint_reads_the_same_both_ways(tiny_path):
    from transformers import AutoConfig

    assert what_nvray_builds(load_model_config(tiny_path)) == \
        what_nvray_builds(AutoConfig.from_pretrained(tiny_path))


@pytest.mark.parametrize("content, error", [
    (None, "has no config.json"), ("{not json", "is not valid JSON"),
    ("[1, 2]", "holds a list, not a JSON object")])
def test_a_missing_or_broken_config_json_is_named(tmp_path, content, error):
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises(ValueError, match=error):
        load_model_config(str(tmp_path))
