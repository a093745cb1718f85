"""Models built from ``nvray.layers``, one file per family: the decoder Qwen, Llama and Mistral
share (``decoder.py``), Qwen3 and Qwen2 (``qwen3.py``), Qwen3-MoE (``qwen3_moe.py``), Llama 3.x and
Mistral (``llama.py``), Gemma 3 text (``gemma3.py``), Qwen3.5 dense and MoE, hybrids of linear
and full attention (``qwen3_5.py``; the language model of their vision-language checkpoints),
EAGLE-3 drafters (``eagle3.py``), Qwen3.5's MTP head (``qwen3_5_mtp.py``), and the embedded tiny checkpoint
(``tiny.py``: a small random-weight Qwen3 written in HF format on first use, loaded through the
same code as a real model). ``model_class_for`` maps a checkpoint's HF
``architectures`` name to its nvray class; an unknown one is a ValueError naming it. A bare
backbone (``Qwen3Model``: an embedding checkpoint) runs as its causal LM with the LM head tied
to the embeddings (``BACKBONES``; the pooling requests never need the head's own weights).
"""

from __future__ import annotations

from typing import Any

MODEL_REGISTRY = {
    "Qwen3ForCausalLM": ("nvray.models.qwen3", "Qwen3ForCausalLM"),
    # a bare backbone (an embedding checkpoint saved through AutoModel: no LM head, no "model."
    # prefix on its tensors; nvray.loader adds it)
    "Qwen3Model": ("nvray.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen2ForCausalLM": ("nvray.models.qwen3", "Qwen2ForCausalLM"),
    "Qwen3MoeForCausalLM": ("nvray.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "LlamaForCausalLM": ("nvray.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("nvray.models.llama", "MistralForCausalLM"),
    "Gemma3ForCausalLM": ("nvray.models.gemma3", "Gemma3ForCausalLM"),
    "Qwen3_5ForCausalLM": ("nvray.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("nvray.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("nvray.models.qwen3_5", "Qwen3_5MoeForCausalLM"),
    "Qwen3_5MoeForConditionalGeneration": ("nvray.models.qwen3_5", "Qwen3_5MoeForCausalLM"),
    # EAGLE-3 drafters (speculative_config method "eagle3" only)
    "LlamaForCausalLMEagle3": ("nvray.models.eagle3", "Eagle3LlamaForCausalLM"),
    "Eagle3LlamaForCausalLM": ("nvray.models.eagle3", "Eagle3LlamaForCausalLM"),
    # Qwen3.5's MTP head, read from the target's checkpoint (speculative_config method "mtp")
    "Qwen3_5MTP": ("nvray.models.qwen3_5_mtp", "Qwen3_5MTP"),
}

BACKBONES = ("Qwen3Model",)


def model_class_for(hf_config: Any) -> type:
    import importlib  # noqa: PLC0415

    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            module, name = MODEL_REGISTRY[arch]
            return getattr(importlib.import_module(module), name)
    raise ValueError(f"model architectures {archs} are not supported; supported: {sorted(MODEL_REGISTRY)}")
