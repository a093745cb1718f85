"""FP8 checkpoints for tests, written the way each format stores them, and the oracle for them.

``write_fp8_checkpoint(src, dst, fmt)`` quantizes a random 16/32-bit checkpoint's decoder linear
weights (this module's own quantizer, not nvray's):

- ``"qwen-fp8"``: Qwen's format: e4m3 weights, float32 ``weight_scale_inv`` per 128x128 block,
  ``quant_method: fp8`` with ``weight_block_size``;
- ``"ct-channel"``: compressed-tensors ``FP8_DYNAMIC`` as llm-compressor writes it: e4m3 weights,
  ``weight_scale`` ``[out, 1]`` (float32), dynamic per-token activations;
- ``"ct-block"``: compressed-tensors ``FP8_BLOCK``: 128x128 ``weight_scale``, activations per
  token and 128-column group.

``hf_fp8_model(dst)`` is HF transformers' Qwen3 loaded from those files by transformers' own
quantizers (which dequantize them on a machine without a GPU), in fp32, with each quantized
layer's input put through the FP8 round trip the format prescribes (and, for per-token
scales, as tensor-parallel ranks apply it: ``tp_ranks``).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import warnings

import torch
from safetensors import safe_open
from safetensors.torch import save_file

E4M3_MAX = 448.0
BLOCK = (128, 128)
# decoder linear weights: what both formats quantize (embeddings, norms, lm_head stay);
# Qwen3.5's linear-attention projections too (in_proj_qkv, in_proj_z, out_proj, ...)
_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp|linear_attn)\.\w*proj\w*\.weight$")
# a Qwen3 shape whose every projection splits into 128x128 blocks, also on 2 ranks
FP8_SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 128, "num_hidden_layers": 2}
FORMATS = ("qwen-fp8", "ct-channel", "ct-block")


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.float().abs().amax(dim=1, keepdim=True) / E4M3_MAX
    return _e4m3(w.float() / scale), scale


def quantize_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    (bn, bk), (n, k) = BLOCK, w.shape
    assert n % bn == 0 and k % bk == 0, "test shapes split into whole blocks"
    blocks = w.float().view(n // bn, bn, k // bk, bk)
    scale = blocks.abs().amax(dim=(1, 3)) / E4M3_MAX
    q = _e4m3(blocks / scale[:, None, :, None]).view(n, k)
    return q, scale


def _quantization_config(fmt: str, ignore: list[str]) -> dict:
    if fmt == "qwen-fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(BLOCK), "modules_to_not_convert": ignore or None}
    block = fmt == "ct-block"
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": "block" if block else "channel", "group_size": None,
               "block_structure": list(BLOCK) if block else None, "observer": "minmax",
               "observer_kwargs": {}, "actorder": None}
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                   "strategy": "group" if block else "token", "group_size": BLOCK[1] if block else None,
                   "block_structure": None, "observer": None, "observer_kwargs": {}, "actorder": None}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "kv_cache_scheme": None,
            "ignore": ["lm_head", *ignore],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations,
                                          "output_activations": None}}}


def write_fp8_checkpoint(src: str, dst: str, fmt: str, ignore: tuple[str, ...] = ()) -> str:
    """``src`` (16/32-bit) quantized into ``dst`` in ``fmt``; ``ignore``: modules kept as they are."""
    assert fmt in FORMATS, fmt
    shutil.copytree(src, dst, dirs_exist_ok=True)
    tensors = {}
    with safe_open(os.path.join(src, "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            tensors.update(_stored(name, f.get_tensor(name), fmt, ignore))
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = _quantization_config(fmt, list(ignore))
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return dst


def _stored(name: str, w: torch.Tensor, fmt: str, ignore: tuple[str, ...]) -> dict[str, torch.Tensor]:
    module = name[:-len(".weight")]
    if not _LINEAR.match(name) or module in ignore:
        return {name: w}
    if fmt == "ct-channel":
        q, scale = quantize_channel(w)
        return {name: q, f"{module}.weight_scale": scale}
    q, scale = quantize_block(w)
    scale_name = "weight_scale_inv" if fmt == "qwen-fp8" else "weight_scale"
    return {name: q, f"{module}.{scale_name}": scale}


def fake_quantize(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """``x`` after the dynamic FP8 round trip: a scale per token (and ``group`` columns)."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1]).float()
    rows = rows.view(rows.shape[0], -1, group or shape[-1])
    scale = rows.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / E4M3_MAX
    return (_e4m3(rows / scale).float() * scale).view(shape).to(x.dtype)


def _format_of(qc: dict) -> str:
    if qc["quant_method"] == "fp8":
        return "qwen-fp8"
    strategy = qc["config_groups"]["group_0"]["weights"]["strategy"]
    return "ct-block" if strategy == "block" else "ct-channel"


# the layers a tensor-parallel engine splits along their input columns (row-parallel)
_ROW_PARALLEL = ("o_proj", "down_proj")


@functools.lru_cache(maxsize=None)
def hf_fp8_model(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 tp_ranks: int = 1):
    """HF transformers' Qwen3 over the dequantized files, FP8 activations reproduced.

    With per-token activation scales and ``tp_ranks`` > 1, a row-parallel layer's input is
    quantized as that many ranks quantize it: each rank's columns of a token with their own
    scale (block formats' groups already lie inside one rank)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig, FineGrainedFP8Config

    with open(os.path.join(path, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    fmt = _format_of(qc)
    # transformers' own readers of each format, told to dequantize (on a machine without a GPU
    # they do anyway)
    loader = FineGrainedFP8Config if fmt == "qwen-fp8" else CompressedTensorsConfig
    with warnings.catch_warnings():  # that the checkpoint's config is kept, with dequantize on
        # top of it: what is asked
        warnings.filterwarnings("ignore", message="You passed `quantization_config`")
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, quantization_config=loader(dequantize=True),
            device_map=device).eval()
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        quantized = {n[:-len(".weight")] for n in f.keys()
                     if n.endswith(".weight") and f.get_slice(n).get_dtype() == "F8_E4M3"}
    for name, module in model.named_modules():
        if name in quantized:
            width = module.weight.shape[1]
            assert width % tp_ranks == 0, f"{name}: {width} input columns on {tp_ranks} ranks"
            group = BLOCK[1] if fmt != "ct-channel" else (
                width // tp_ranks if name.endswith(_ROW_PARALLEL) else None)
            module.register_forward_pre_hook(
                lambda _m, args, group=group: (fake_quantize(args[0], group),))
    return model


def assert_near_argmax(oracle, prompt: list[int], ours: list[int], tol: float) -> float:
    """Every token nvray picked greedily is, given the same context (its own earlier tokens),
    the oracle's argmax or within ``tol`` of it (a near-tie the quantization noise may break
    either way); returns the share that is the argmax itself."""
    with torch.no_grad():
        logits = oracle(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1:-1]
    chosen = logits.gather(1, torch.tensor(ours).unsqueeze(1)).squeeze(1)
    gap = logits.max(-1).values - chosen
    bad = (gap > tol).nonzero().flatten().tolist()
    assert not bad, f"tokens {bad} are {gap[bad].tolist()} below the oracle's best (> {tol:.4f})"
    return float((gap == 0).float().mean())


def _fp8_kv_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA over keys and values rounded as an FP8 KV cache stores them (scale 1, ±448)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def stored(x: torch.Tensor) -> torch.Tensor:
        return _e4m3(x.float()).to(x.dtype)

    return sdpa_attention_forward(module, query, stored(key), stored(value), attention_mask, **kwargs)


@functools.lru_cache(maxsize=None)
def hf_fp8_kv_model(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """HF transformers' Qwen3 whose attention reads keys and values through an FP8 round
    trip: the oracle of ``kv_cache_dtype='fp8'``."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register("nvray_fp8_kv", _fp8_kv_attention)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device,
                                                attn_implementation="nvray_fp8_kv").eval()
