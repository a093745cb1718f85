"""Load safetensors checkpoints into a (sharded) nvray model.

Each checkpoint tensor is routed to its parameter — through ``packed_modules_mapping`` for
fused parameters — and that parameter's ``weight_loader`` copies this rank's shard; under
pipeline parallelism only the tensors of the rank's stage (the model's ``stage_tensor_name``). A tensor
the model does not have, a parameter the checkpoint lacks, or a shape mismatch is a
``ValueError`` that names the tensor.

FP8 layers (``nvray/quantization``) take their scale tensors the same way. With on-the-fly FP8
a 16/32-bit linear weight is quantized whole, on the parameter's device, before it is sharded:
the weight and its per-channel scale then load as a pre-quantized checkpoint's would.
``fill_random`` makes random weights instead (``load_format="dummy"``: benchmarks of a shape).
A bare backbone's checkpoint (saved through transformers' ``AutoModel``: no tensor named
``model.*``) loads into the model's ``model.`` submodule.
"""

from __future__ import annotations

import glob
import os
import re

import torch
from safetensors import safe_open
from torch import nn

# Tensors checkpoints may carry that the model computes itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# One expert's projection of an MoE layer: stacked into the layer's w13 (gate, up) / w2 (down).
_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.")
_EXPERT_PARAM = re.compile(r"\.experts\.w(13|2)_")


def _route(name: str, packed: dict[str, tuple[str, object]]) -> tuple[str, object | None]:
    """Checkpoint name -> (parameter name, shard id or None)."""
    expert = _EXPERT.search(name)
    if expert is not None:
        stacked = "w2" if expert.group(2) == "down_proj" else "w13"
        return (name[:expert.start()] + f".experts.{stacked}_" + name[expert.end():],
                (int(expert.group(1)), expert.group(2)))
    for ckpt_part, (param_part, shard_id) in packed.items():
        if f".{ckpt_part}." in name:
            return name.replace(f".{ckpt_part}.", f".{param_part}."), shard_id
    return name, None


def checkpoint_files(path: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}")
    return files


def checkpoint_tensor_names(path: str) -> set[str]:
    """The names of every tensor in the checkpoint at ``path``."""
    names: set[str] = set()
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            names.update(f.keys())
    return names


def load_model(model: nn.Module, path: str) -> None:
    """Fill every parameter of ``model`` from the safetensors files in ``path``."""
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules_mapping", {})
    tied = getattr(model, "tie_word_embeddings", False)
    on_stage = getattr(model, "stage_tensor_name", lambda name: name)  # pipeline stages
    expected_shards = _expected_shards(params, packed)
    loaded: dict[str, set[object]] = {}
    files = checkpoint_files(path)
    prefix = "" if _has_model_prefix(files) else "model."
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                    continue
                stage_name = on_stage(prefix + name)
                if stage_name is None:
                    continue  # another pipeline stage's
                param_name, shard_id = _route(stage_name, packed)
                for pname, tensor in _as_stored(params, param_name, f.get_tensor(name)):
                    _load_one(params, pname, shard_id, name, tensor)
                    loaded.setdefault(pname, set()).add(shard_id)
    _check_complete(expected_shards, loaded, tied, packed)


def _has_model_prefix(files: list[str]) -> bool:
    """Whether the checkpoint names its tensors ``model.*`` (a causal LM's), not bare."""
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            if any(name.startswith("model.") for name in f.keys()):
                return True
    return False


def _as_stored(params: dict[str, nn.Parameter], param_name: str, tensor: torch.Tensor
               ) -> list[tuple[str, torch.Tensor]]:
    """(parameter, tensor) pairs one checkpoint tensor fills: itself, or with on-the-fly FP8
    the quantized weight and its scale."""
    method = getattr(params.get(param_name), "quant_method", None)
    if (method is None or not method.config.quantize_on_load or tensor.dtype.itemsize == 1
            or not param_name.endswith(".weight")):
        return [(param_name, tensor)]
    q, scale = method.quantize_checkpoint_tensor(tensor.to(params[param_name].device))
    return [(param_name, q), (param_name[:-len("weight")] + method.config.scale_name, scale)]


def _check_dtype(param: nn.Parameter, tensor: torch.Tensor) -> None:
    """An FP8 parameter takes FP8 tensors only, and an FP8 tensor only an FP8 parameter
    (``copy_`` would convert either silently)."""
    if (param.dtype.itemsize == 1) != (tensor.dtype.itemsize == 1):
        raise ValueError(f"checkpoint dtype {tensor.dtype} does not fit the model's "
                         f"{param.dtype} parameter (does quantization_config name every "
                         f"quantized module, and only those?)")


def _load_one(params: dict[str, nn.Parameter], param_name: str, shard_id: object | None,
              ckpt_name: str, tensor: torch.Tensor) -> None:
    param = params.get(param_name)
    if param is None:
        raise ValueError(f"checkpoint tensor {ckpt_name!r} does not match any model parameter")
    loader = getattr(param, "weight_loader", None)
    try:
        if not getattr(param, "loads_any_dtype", False):  # else: its loader quantizes
            _check_dtype(param, tensor)
        if loader is None:
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"expected shape {tuple(param.shape)}, checkpoint has {tuple(tensor.shape)}")
            param.data.copy_(tensor)
        elif shard_id is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard_id)
    except ValueError as e:
        raise ValueError(f"checkpoint tensor {ckpt_name!r}: {e}") from None


def _expected_shards(params: dict[str, nn.Parameter], packed: dict[str, tuple[str, object]]
                     ) -> dict[str, set[object]]:
    fused: dict[str, set[object]] = {}
    for param_part, shard_id in packed.values():
        fused.setdefault(param_part, set()).add(shard_id)
    expected = {}
    for name, param in params.items():
        if hasattr(param, "expected_shards"):  # e.g. an MoE layer's stacked experts
            expected[name] = set(param.expected_shards)
            continue
        parts = [p for p in fused if f".{p}." in name]
        expected[name] = fused[parts[0]] if parts else {None}
    return expected


def _checkpoint_name(param_name: str, shard_id: object | None,
                     packed: dict[str, tuple[str, object]]) -> str:
    stacked = _EXPERT_PARAM.search(param_name)
    if stacked is not None and isinstance(shard_id, tuple):
        expert, proj = shard_id
        return f"{param_name[:stacked.start()]}.experts.{expert}.{proj}.{param_name[stacked.end():]}"
    for ckpt_part, (param_part, sid) in packed.items():
        if sid == shard_id and f".{param_part}." in param_name:
            return param_name.replace(f".{param_part}.", f".{ckpt_part}.")
    return param_name


def _check_complete(expected: dict[str, set[object]], loaded: dict[str, set[object]],
                    tied: bool, packed: dict[str, tuple[str, object]]) -> None:
    for name, shards in expected.items():
        if tied and name == "lm_head.weight":
            continue
        for shard_id in shards - loaded.get(name, set()):
            raise ValueError(f"checkpoint is missing tensor {_checkpoint_name(name, shard_id, packed)!r}")


def fill_random(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Random weights in place of a checkpoint's (``load_format="dummy"``): normal(0, ``std``)
    values, norms near 1, FP8 weights normal(0, 1) in e4m3 with scales of ``std``; made on
    each parameter's device."""
    gen: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            g = gen.setdefault(param.device, torch.Generator(param.device).manual_seed(seed))
            if not param.dtype.is_floating_point:
                continue  # an index map (an EAGLE-3 drafter's d2t): its zeros are the identity
            if param.dtype.itemsize == 1:  # FP8 weight
                values = torch.randn(param.shape, generator=g, device=param.device)
                param.copy_(values.clamp(-448, 448).to(param.dtype))
            elif "scale" in name.rsplit(".", 1)[-1]:
                param.fill_(std)
            elif "norm" in name and param.dim() == 1:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=g, device=param.device))
            else:
                param.normal_(0.0, std, generator=g)
