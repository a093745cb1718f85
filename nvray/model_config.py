"""A checkpoint's model config (its ``config.json``), read without importing transformers.

``load_model_config(path, overrides)`` returns a ``ModelConfig``: the file's keys as attributes,
with the values transformers' config class of the architecture (``Qwen3Config``,
``LlamaConfig``, ``Gemma3TextConfig``, ...) gives the keys a file leaves out, for the keys nvray's
models read. ``overrides`` (``hf_overrides``, vLLM's flag of that name) are merged over the file's
top-level keys first: a stock Qwen3 checkpoint gets YaRN with ``{"rope_scaling": {"rope_type":
"yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}``. It exists for start-up time: importing transformers costs a rank process 8-10 s on a GPU node (measured on
an H100 machine, warm caches), and a rank needs nothing of it but these numbers.
``tests/worker/test_model_config.py`` holds it to transformers' ``AutoConfig`` on full and sparse files.
"""

from __future__ import annotations

import json
import os
import types
from typing import Any

from nvray.architectures import ARCHITECTURES, QWEN_DEFAULTS, names_where

_DEFAULT_ROPE_THETA = 10000.0
# Keys transformers writes under another name than the checkpoints on the Hub (its attribute_map)
_ALIASES = {"num_local_experts": "num_experts"}
# each architecture's config defaults (nvray/architectures.py); others get Qwen's
_DEFAULTS = {name: arch.config_defaults for name, arch in ARCHITECTURES.items()
             if arch.config_defaults}
_BACKBONES = set(names_where(backbone=True))
_LANGUAGE_MODEL_OF = names_where(language_model_of=True)


class ModelConfig(types.SimpleNamespace):
    """config.json's keys as attributes (the architecture's defaults filled in)."""


def load_model_config(model_path: str, overrides: dict[str, Any] | None = None) -> ModelConfig:
    """``config.json`` of ``model_path`` with ``overrides`` (``hf_overrides``) merged over its
    top-level keys (a nested dict such as ``rope_scaling`` is replaced whole)."""
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
    return model_config_from_dict({**raw, **(overrides or {})})


def architecture_of(model_path: str) -> str:
    """The checkpoint's first ``architectures`` name (what ``/v1/models`` reports)."""
    return (load_model_config(model_path).architectures or [""])[0]


def language_model_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """A vision-language checkpoint's ``text_config`` lifted to the top level (its own
    top-level keys kept where the text config lacks them)."""
    text = raw.get("text_config")
    if not isinstance(text, dict) or not set(raw.get("architectures") or []) & set(_LANGUAGE_MODEL_OF):
        return raw
    top = {k: v for k, v in raw.items() if k != "text_config"}
    return {**top, **text, "architectures": raw["architectures"],
            "tie_word_embeddings": raw.get("tie_word_embeddings",
                                           text.get("tie_word_embeddings", False))}


def speculators_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """An EAGLE-3 head in the ``speculators`` library's format (``speculators_model_type``
    ``eagle3``: its layer's config in ``transformer_layer_config``) as the published EAGLE-3
    format states it (``Eagle3LlamaForCausalLM``; ``norm_before_residual`` defaults to true
    there)."""
    if raw.get("speculators_model_type") != "eagle3":
        return raw
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError("a speculators EAGLE-3 config needs transformer_layer_config (a dict)")
    keys = ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids")
    return {**layer, **{k: raw[k] for k in keys if raw.get(k) is not None},
            "norm_before_residual": raw.get("norm_before_residual", True),
            "architectures": ["Eagle3LlamaForCausalLM"]}


def model_config_from_dict(raw: dict[str, Any]) -> ModelConfig:
    raw = language_model_keys(speculators_keys(raw))
    archs = raw.get("architectures") or []
    defaults = next((_DEFAULTS[a] for a in archs if a in _DEFAULTS), QWEN_DEFAULTS)
    raw = {_ALIASES.get(k, k): v for k, v in raw.items()}
    values = {**defaults, **raw}
    if set(archs) & _BACKBONES:  # no LM head of its own: pooling requests never read one
        values["tie_word_embeddings"] = True
    if values.get("num_key_value_heads") is None:  # as the config classes do
        values["num_key_value_heads"] = values["num_attention_heads"]
    if values.get("head_dim") is None:
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    if values.get("rope_theta") is None:  # transformers 5 writes it into rope_parameters
        rope = values.get("rope_parameters") or values.get("rope_scaling") or {}
        values["rope_theta"] = rope.get("rope_theta", _DEFAULT_ROPE_THETA)
    if values.get("layer_types") is None and "full_attention_interval" in values:  # Qwen3.5
        every = values["full_attention_interval"]
        values["layer_types"] = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                 for i in range(values["num_hidden_layers"])]
    elif "layer_types" in values and values["layer_types"] is None:  # Gemma 3's old pattern key
        every = values.get("sliding_window_pattern") or 6
        values["layer_types"] = ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                                 for i in range(values["num_hidden_layers"])]
    return ModelConfig(**values)
