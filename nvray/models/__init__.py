"""Model registry: HF ``architectures`` name -> nvray model class."""

from __future__ import annotations

from typing import Any

MODEL_REGISTRY = {
    "Qwen3ForCausalLM": ("nvray.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen2ForCausalLM": ("nvray.models.qwen3", "Qwen2ForCausalLM"),
}


def model_class_for(hf_config: Any) -> type:
    import importlib  # noqa: PLC0415

    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            module, name = MODEL_REGISTRY[arch]
            return getattr(importlib.import_module(module), name)
    raise ValueError(f"model architectures {archs} are not supported; supported: {sorted(MODEL_REGISTRY)}")
