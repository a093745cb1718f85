"""nvray reads config.json itself (no transformers import in a rank): what it builds from the
file must be what transformers' AutoConfig makes of the same file — the same model (parameter
names and shapes), norm epsilon, rotary base, dtype, length limit and quantization — for full
files, files that leave keys to the architecture's defaults, and both layouts of a key."""

from __future__ import annotations

import json

import pytest
import torch

from nvray.config import EngineConfig
from nvray.layers.rotary import rope_theta_of
from nvray.model_config import load_model_config
from nvray.models import model_class_for
from nvray.quantization import quant_config_for
from nvray.worker.setup import resolve_dtype, resolve_max_model_len

SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "vocab_size": 320}
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
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
}


def what_nvray_builds(cfg) -> dict:
    with torch.device("meta"):
        model = model_class_for(cfg)(cfg, None)
    engine = EngineConfig.from_kwargs("tiny")
    quant = quant_config_for(cfg, None)
    return {"params": {n: tuple(p.shape) for n, p in model.named_parameters()},
            "tied": model.tie_word_embeddings,
            "eps": sorted({m.eps for m in model.modules() if hasattr(m, "eps")}),
            "rope_theta": rope_theta_of(cfg),
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
