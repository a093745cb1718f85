"""Setting up one rank: its device, the model's dtype and length limit, the model itself.

Functions of the configuration only, run once when a ``ModelRunner`` is made: which torch
device the rank computes on (``torch_device``: inside a Ray actor ``cuda`` is the one visible
GPU), the compute dtype, the sequence length limit, and the model built on that device with the
checkpoint's weights loaded, its fast paths (``torch.compile``d layers, Triton kernels) chosen
for the device; a later pipeline stage's input buffer and the adapter slots (``enable_lora``)
on it.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from nvray.config import EngineConfig
from nvray.loader import fill_random, load_model
from nvray.lora.model import LoRAModel
from nvray.layers.rotary import rope_max_positions
from nvray.models import model_class_for
from nvray.quantization import Fp8Config

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_device(name: str) -> torch.device:
    """The torch device for ``EngineConfig.device`` in this process ('auto': CUDA if visible)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but no CUDA device is visible")
    return torch.device("cuda", torch.cuda.current_device()) if name == "cuda" else torch.device("cpu")


def resolve_dtype(name: str, hf_config: Any, device: torch.device) -> torch.dtype:
    """'auto': the checkpoint's dtype, except fp32 runs as bf16 on GPU and 16-bit as fp32 on CPU."""
    if name != "auto":
        return _DTYPES[name]
    ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
    ckpt = _DTYPES.get(ckpt, torch.float32) if isinstance(ckpt, str) else ckpt
    if device.type == "cpu":
        return torch.float32
    return torch.bfloat16 if ckpt == torch.float32 else ckpt


def resolve_max_model_len(config: EngineConfig, hf_config: Any) -> int:
    """``max_model_len``, or as far as the model's rope reaches (``rope_max_positions``:
    ``max_position_embeddings``, further where the config's rope scaling covers more)."""
    limit = rope_max_positions(hf_config, getattr(hf_config, "layer_types", None))
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        scaled = limit > hf_config.max_position_embeddings
        raise ValueError(
            f"max_model_len={config.max_model_len} exceeds the model's "
            + (f"rope scaling's reach of {limit} positions" if scaled else
               f"max_position_embeddings={limit} (a longer context needs rope scaling, e.g. "
               f"hf_overrides={{'rope_scaling': {{'rope_type': 'yarn', 'factor': 4.0, "
               f"'original_max_position_embeddings': {limit}}}}})"))
    return config.max_model_len


def build_model(hf_config: Any, model_path: str, dtype: torch.dtype, device: torch.device,
                seed: int, quant: Fp8Config | None = None,
                load_format: str = "auto") -> torch.nn.Module:
    """The model for ``hf_config``, made on ``device`` in ``dtype`` (its linear layers FP8
    with ``quant``), its weights loaded (``load_format="dummy"``: random)."""
    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class_for(hf_config)(hf_config, quant)
    finally:
        torch.set_default_dtype(default_dtype)
    if load_format == "dummy":
        fill_random(model, seed)
    else:
        load_model(model, model_path)
    return model.eval()


def enable_torch_compile(model: torch.nn.Module) -> None:
    """Fused norms, rotary and activation (measured on an H100, Qwen3-0.6B, batch 256: a
    decode graph replay takes 12.0 ms instead of 15.0 ms; an eager decode 28 ms instead of
    44 ms). Compilation happens in the first forward (the warm-up or the graph capture)."""
    for module in model.modules():
        if hasattr(module, "enable_torch_compile"):
            module.enable_torch_compile()


def use_triton_kernels(model: torch.nn.Module) -> bool:
    """Hand-written Triton kernels where the model has them: the q/k norms and rotary of
    each layer in one kernel instead of four; the hidden-state norms (with the residual add)
    and the MLP's activation instead of their ``torch.compile``d versions, whose guards and
    wrappers cost ~0.15 ms of host time per call on eager (prefill) steps. Returns whether
    Triton is there, and with it the plain sampler's one-kernel draw."""
    if importlib.util.find_spec("triton") is None:
        return False
    for module in model.modules():
        if hasattr(module, "use_triton_kernels"):
            module.use_triton_kernels()
    return True


def stage_input_buffer(model: torch.nn.Module, rows: int, hidden_size: int, dtype: torch.dtype,
                       device: torch.device) -> torch.Tensor | None:
    """A later pipeline stage's input, [rows, 2, hidden], as large as a step gets (the model
    reads its first rows, ``DecoderModel.forward``), set on the model; None on the first
    stage."""
    if model.model.embed_tokens is not None:
        return None
    buffer = torch.zeros(rows, 2, hidden_size, dtype=dtype, device=device)
    model.model.stage_input = buffer
    return buffer


def lora_model(model: torch.nn.Module, config: EngineConfig, quantized: bool, rows: int,
               device: torch.device) -> LoRAModel | None:
    """Adapter slots on every adaptable projection (``enable_lora``) for steps of up to
    ``rows`` rows, made before the memory profile, which counts them."""
    if not config.enable_lora:
        return None
    if quantized:
        raise ValueError("enable_lora needs an unquantized model: this checkpoint's linear "
                         "layers are FP8 (LoRA on FP8 layers is not supported)")
    return LoRAModel(model, config.max_loras, config.max_lora_rank, config.cpu_loras, rows,
                     device)
