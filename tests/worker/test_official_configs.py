"""The config.json files of the checkpoints teams serve build the model transformers builds
from them (parameter count and the shapes of the tensors that vary by family, on the meta
device: no weights), are refused nowhere, and reach the context they advertise; a config asking
for what nvray does not do is refused with the feature's name."""

from __future__ import annotations

import json

import pytest
import torch

from nvray.config import EngineConfig
from nvray.model_config import load_model_config
from nvray.models import model_class_for
from nvray.worker.setup import resolve_max_model_len

_LLAMA31_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192, "rope_type": "llama3"}
_QWEN3_30B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
    "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936}
_GEMMA3_TEXT = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 256,
    "query_pre_attn_scalar": 256, "sliding_window": 1024, "sliding_window_pattern": 6,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0, "vocab_size": 262208, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-06, "hidden_activation": "gelu_pytorch_tanh", "torch_dtype": "bfloat16"}

# (config.json, context it advertises)
OFFICIAL = {
    "Llama-3.1-8B": ({
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000,
        "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
        "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": _LLAMA31_ROPE,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "vocab_size": 128256}, 131072),
    "Llama-3.2-1B": ({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "intermediate_size": 8192,
        "head_dim": 64, "max_position_embeddings": 131072, "model_type": "llama",
        "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05, "rope_scaling": {**_LLAMA31_ROPE, "factor": 32.0},
        "rope_theta": 500000.0, "tie_word_embeddings": True, "vocab_size": 128256}, 131072),
    "Qwen3-30B-A3B": (_QWEN3_30B, 40960),
    "Gemma-3-4B (text)": ({**_GEMMA3_TEXT, "hidden_size": 2560, "intermediate_size": 10240,
                           "num_hidden_layers": 34, "num_attention_heads": 8,
                           "num_key_value_heads": 4}, 131072),
    "Gemma-3-12B (text)": ({**_GEMMA3_TEXT, "hidden_size": 3840, "intermediate_size": 15360,
                            "num_hidden_layers": 48, "num_attention_heads": 16,
                            "num_key_value_heads": 8}, 131072),
}


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _write(tmp_path, raw: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return str(tmp_path)


@pytest.mark.parametrize("name", OFFICIAL)
def test_an_official_config_builds_the_model_transformers_builds(tmp_path, name):
    from transformers import AutoConfig, AutoModelForCausalLM

    raw, context = OFFICIAL[name]
    path = _write(tmp_path, raw)
    cfg = load_model_config(path)
    with torch.device("meta"):
        ours = model_class_for(cfg)(cfg, None)
        theirs = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    assert _count(ours) == _count(theirs)
    assert resolve_max_model_len(EngineConfig(), cfg) == context
    windows = {layer.sliding_window for layer in ours.attention_layers()}
    expected = {None, raw["sliding_window"]} if "Gemma" in name else {None}
    assert windows == expected


def test_qwen3_moe_experts_are_stacked_per_layer(tmp_path):
    cfg = load_model_config(_write(tmp_path, _QWEN3_30B))
    with torch.device("meta"):
        model = model_class_for(cfg)(cfg, None)
    params = dict(model.named_parameters())
    assert params["model.layers.47.mlp.experts.w13_weight"].shape == (128, 2 * 768, 2048)
    assert params["model.layers.0.mlp.experts.w2_weight"].shape == (128, 2048, 768)
    assert params["model.layers.0.mlp.gate.weight"].shape == (128, 2048)


@pytest.mark.parametrize("change, feature", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_type='longrope'"),
    ({"rope_scaling": {"rope_type": "linear"}}, "needs a 'factor'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"architectures": ["Phi3ForCausalLM"]}, "Phi3ForCausalLM"),
])
def test_an_unsupported_feature_is_refused_by_name(tmp_path, change, feature):
    cfg = load_model_config(_write(tmp_path, {**OFFICIAL["Llama-3.1-8B"][0], **change}))
    with torch.device("meta"), pytest.raises(ValueError, match=feature.replace("(", r"\(")):
        model_class_for(cfg)(cfg, None)


@pytest.mark.parametrize("feature", ["final_logit_softcapping", "attn_logit_softcapping"])
def test_gemma_logit_softcapping_is_refused_by_name(tmp_path, feature):
    raw = {**OFFICIAL["Gemma-3-4B (text)"][0], feature: 30.0}
    cfg = load_model_config(_write(tmp_path, raw))
    with torch.device("meta"), pytest.raises(ValueError, match=feature):
        model_class_for(cfg)(cfg, None)


def test_qwen3_30b_a3b_fp8_builds_fp8_experts_in_128_blocks(tmp_path):
    from nvray.quantization import quant_config_for

    gates = [f"model.layers.{i}.mlp.gate" for i in range(48)]
    raw = {**_QWEN3_30B, "quantization_config": {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
        "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head", *gates]}}
    cfg = load_model_config(_write(tmp_path, raw))
    with torch.device("meta"):
        model = model_class_for(cfg)(cfg, quant_config_for(cfg, None))
    params = dict(model.named_parameters())
    experts = "model.layers.5.mlp.experts."
    assert params[experts + "w13_weight"].dtype == torch.float8_e4m3fn
    assert params[experts + "w13_weight_scale_inv"].shape == (128, 2 * 768 // 128, 2048 // 128)
    assert params[experts + "w2_weight_scale_inv"].shape == (128, 2048 // 128, 768 // 128)
    assert params["model.layers.5.mlp.gate.weight"].dtype == torch.get_default_dtype()
    assert params["model.layers.5.self_attn.qkv_proj.weight"].dtype == torch.float8_e4m3fn
