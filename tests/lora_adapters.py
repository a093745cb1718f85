"""Random LoRA adapters written by PEFT itself (the oracle), and PEFT's own greedy decoding.

``write_adapter`` wraps the base checkpoint's transformers model with ``peft.get_peft_model``,
draws the A and B matrices at random (PEFT starts B at zero, which would change nothing) and
saves them with ``save_pretrained``: ``adapter_config.json`` + ``adapter_model.safetensors``,
exactly what users download. ``peft_greedy`` decodes with ``PeftModel.from_pretrained`` over a
fresh copy of the base model (no adapter: the base model itself).
"""

from __future__ import annotations

import functools
from typing import Any

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def write_adapter(base_path: str, out_dir: str, r: int, targets: list[str], seed: int,
                  alpha: float | None = None, use_rslora: bool = False, std: float = 0.15,
                  **extra: Any) -> str:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha if alpha is not None else 2 * r,
                        target_modules=targets, use_rslora=use_rslora, lora_dropout=0.0, **extra)
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    model.save_pretrained(out_dir)
    return out_dir


@functools.lru_cache(maxsize=None)
def _peft_model(base_path: str, adapter_path: str | None):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    return base if adapter_path is None else PeftModel.from_pretrained(base, adapter_path).eval()


def peft_greedy(base_path: str, adapter_path: str | None, prompt: list[int],
                max_new_tokens: int) -> list[int]:
    """PEFT's model, argmax token by token over the whole sequence (no cache: small shapes)."""
    import torch

    model, tokens = _peft_model(base_path, adapter_path), list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([tokens])).logits
            tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt):]


def peft_logits(base_path: str, adapter_path: str | None, tokens: list[int]):
    import torch

    with torch.no_grad():
        return _peft_model(base_path, adapter_path)(input_ids=torch.tensor([tokens])).logits[0]
