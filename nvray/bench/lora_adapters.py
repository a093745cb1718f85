"""Random LoRA adapters in PEFT's format, for the benchmarks and the GPU tests.

``write_random_adapter(path, targets, rank, seed)`` writes ``adapter_config.json`` and
``adapter_model.safetensors`` for every projection in ``targets`` (checkpoint module -> full
(in, out), what an engine reports as ``limits.lora_targets``), bf16 weights of small norm;
``clone_adapter`` gives another name to the same tensors (a hard link), for benchmarks that need
many adapters and measure their loads, not their values. PEFT reads these files
(``tests/engine/test_lora.py`` holds nvray to PEFT on them).
"""

from __future__ import annotations

import json
import os
import shutil

_KINDS_ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(path: str, targets: dict[str, tuple[int, int]], rank: int, seed: int,
                         std: float = 0.02, alpha: float | None = None,
                         dtype: str = "bfloat16") -> str:
    import torch  # noqa: PLC0415
    from safetensors.torch import save_file  # noqa: PLC0415

    os.makedirs(path, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (in_features, out_features) in sorted(targets.items()):
        key = f"base_model.model.{module}"
        a = torch.randn(rank, in_features, generator=gen) * std
        b = torch.randn(out_features, rank, generator=gen) * std
        tensors[f"{key}.lora_A.weight"] = a.to(getattr(torch, dtype))
        tensors[f"{key}.lora_B.weight"] = b.to(getattr(torch, dtype))
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    kinds = sorted({m.rsplit(".", 1)[-1] for m in targets},
                   key=lambda k: _KINDS_ORDER.index(k) if k in _KINDS_ORDER else 99)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha if alpha is not None else 2 * rank,
              "target_modules": kinds, "lora_dropout": 0.0, "bias": "none",
              "use_rslora": False, "task_type": "CAUSAL_LM"}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path


def clone_adapter(src: str, dst: str) -> str:
    """Another adapter directory over the same tensors (a hard link where the disk allows)."""
    os.makedirs(dst, exist_ok=True)
    shutil.copy(os.path.join(src, "adapter_config.json"), dst)
    weights = os.path.join(src, "adapter_model.safetensors")
    target = os.path.join(dst, "adapter_model.safetensors")
    try:
        os.link(weights, target)
    except OSError:
        shutil.copy(weights, target)
    return dst
