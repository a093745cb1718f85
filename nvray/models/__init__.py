"""Models built from ``nvray.layers``, one file per family: the decoder Qwen, Llama and Mistral
share (``decoder.py``), Qwen3 and Qwen2 (``qwen3.py``), Qwen3-MoE (``qwen3_moe.py``), Llama 3.x and
Mistral (``llama.py``), Gemma 3 text (``gemma3.py``), Qwen3.5 dense and MoE, hybrids of linear
and full attention (``qwen3_5.py``; the language model of their vision-language checkpoints),
EAGLE-3 drafters (``eagle3.py``), Qwen3.5's MTP head (``qwen3_5_mtp.py``), and the embedded tiny checkpoint
(``tiny.py``: a small random-weight Qwen3 written in HF format on first use, loaded through the
same code as a real model). ``model_class_for`` maps a checkpoint's HF
``architectures`` name to its nvray class (``nvray/architectures.py`` is the table); an unknown one is a ValueError naming it. A bare
backbone (``Qwen3Model``: an embedding checkpoint) runs as its causal LM with the LM head tied
to the embeddings (``BACKBONES``; the pooling requests never need the head's own weights).
"""

from __future__ import annotations

from typing import Any

from nvray.architectures import ARCHITECTURES, names_where

# architecture -> (module, class) of its nvray model (nvray/architectures.py: the one table)
MODEL_REGISTRY = {name: tuple(arch.model.split(":")) for name, arch in ARCHITECTURES.items()}
BACKBONES = names_where(backbone=True)


def model_class_for(hf_config: Any) -> type:
    import importlib  # noqa: PLC0415

    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            module, name = MODEL_REGISTRY[arch]
            return getattr(importlib.import_module(module), name)
    raise ValueError(f"model architectures {archs} are not supported; supported: {sorted(MODEL_REGISTRY)}")
