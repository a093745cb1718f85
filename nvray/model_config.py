"""A checkpoint's model config (its ``config.json``), read without importing transformers.

``load_model_config(path)`` returns a ``ModelConfig``: the file's keys as attributes, with the
values transformers' config class of the architecture (``Qwen3Config``, ``Qwen2Config``) gives
the keys a file leaves out, for the keys nvray's models read. It exists for start-up time: importing transformers costs a rank process 8-10 s on a GPU node (measured on
an H100 machine, warm caches), and a rank needs nothing of it but these numbers.
``tests/worker/test_model_config.py`` holds it to transformers' ``AutoConfig`` on full and sparse files.
"""

from __future__ import annotations

import json
import os
import types
from typing import Any

# What transformers' Qwen3Config / Qwen2Config default to, for the keys nvray's models read
# (read off transformers 5.24; the test holds them to the installed version).
_QWEN_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "rope_scaling": None, "quantization_config": None,
}
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULTS: dict[str, dict[str, Any]] = {
    "Qwen3ForCausalLM": {**_QWEN_DEFAULTS, "head_dim": 128},
    "Qwen2ForCausalLM": {**_QWEN_DEFAULTS, "head_dim": None},  # hidden_size // heads
}


class ModelConfig(types.SimpleNamespace):
    """config.json's keys as attributes (the architecture's defaults filled in)."""


def load_model_config(model_path: str) -> ModelConfig:
    path = os.path.join(model_path, "config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{model_path} has no config.json: not a model checkpoint") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} holds a {type(raw).__name__}, not a JSON object")
    return model_config_from_dict(raw)


def model_config_from_dict(raw: dict[str, Any]) -> ModelConfig:
    archs = raw.get("architectures") or []
    defaults = next((_DEFAULTS[a] for a in archs if a in _DEFAULTS), _QWEN_DEFAULTS)
    values = {**defaults, **raw}
    if values.get("num_key_value_heads") is None:  # as the config classes do
        values["num_key_value_heads"] = values["num_attention_heads"]
    if values.get("rope_theta") is None:  # transformers 5 writes it into rope_parameters
        rope = values.get("rope_parameters") or values.get("rope_scaling") or {}
        values["rope_theta"] = rope.get("rope_theta", _DEFAULT_ROPE_THETA)
    return ModelConfig(**values)
