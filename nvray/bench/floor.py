"""The physical floors of a throughput workload: output tok/s that no engine can beat on a GPU.

design.md's floor (``floor_output_tok_per_s``): decode is bound by HBM traffic. Each decode step
reads the weights once (every linear layer and the LM head; the embedding only gathers rows),
and each running sequence's step reads the KV of all its context tokens. Over a workload of
prompts ``p_i`` and output lengths ``m_i`` (the first output token comes from prefill; decode
step ``t`` runs the sequences with ``m_i > t`` over ``p_i + t`` context tokens) the floor is the
output tokens over the time those bytes take at the device's measured bandwidth.

The roofline floor (``roofline_output_tok_per_s``) adds what the bandwidth floor leaves out:
arithmetic. Prefill runs every prompt token through the linear layers (and one row per prompt
through the LM head) at the device's measured matmul peak, and a decode step's linear layers
take the longer of reading their weights and their ``2 x batch x parameters`` FLOPs (a
Qwen3-8B step at batch 256 is compute-bound on an H200). Attention's arithmetic is left out, so
both are bounds, not estimates. With tensor parallelism over ``n`` GPUs each has ``1/n`` of the
bytes and FLOPs: ``n`` times either floor (collectives ignored). With FP8 weights
(``quantization="fp8"`` or an FP8 checkpoint) the decoder layers' linear weights count one byte a
value and their FLOPs run at twice the bf16 matmul peak; the LM head keeps the checkpoint's
dtype. With an FP8 KV cache (``kv_cache_dtype="fp8"``)
keys and values count one byte a value.
"""

from __future__ import annotations

import json
import os
from typing import Any

# Measured on the lent machines (/work/.library/device/KINDS.md): device-to-device copy
# bandwidth (bytes read + written), TB/s, and a bf16 8192^3 matmul on random data (the best of
# the runs reported), TFLOP/s.
MEASURED_TB_PER_S = {"H100": 3.0, "H200": 4.3}
MEASURED_TFLOP_PER_S = {"H100": 798.0, "H200": 798.0}


def _by_device(table: dict[str, float], device_name: str) -> float | None:
    for model, figure in table.items():
        if model in device_name:
            return figure
    return None


def measured_bandwidth(device_name: str) -> float | None:
    """The measured TB/s of a GPU named like ``torch.cuda.get_device_name()``, if known."""
    return _by_device(MEASURED_TB_PER_S, device_name)


def measured_matmul_peak(device_name: str) -> float | None:
    """The measured bf16 matmul TFLOP/s of a GPU, if known."""
    return _by_device(MEASURED_TFLOP_PER_S, device_name)


def _bytes_per_value(cfg: dict[str, Any]) -> int:
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
    return 4 if dtype == "float32" else 2


def _head_params(cfg: dict[str, Any]) -> int:
    return cfg["vocab_size"] * cfg["hidden_size"]


def _layer_params(cfg: dict[str, Any]) -> int:
    """Parameters of the linear layers of all decoder layers."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return cfg["num_hidden_layers"] * (h * (q + 2 * kv) + q * h + 3 * h * inter)


def _layer_bytes_per_value(cfg: dict[str, Any], quantization: str | None) -> int:
    fp8 = quantization == "fp8" or "quantization_config" in cfg
    return 1 if fp8 else _bytes_per_value(cfg)


def weight_bytes_per_step(cfg: dict[str, Any], quantization: str | None = None) -> int:
    """Bytes of the weights one decode step reads: the layers' linear layers and the LM head."""
    return (_layer_params(cfg) * _layer_bytes_per_value(cfg, quantization)
            + _head_params(cfg) * _bytes_per_value(cfg))


def kv_bytes_per_token(cfg: dict[str, Any], kv_cache_dtype: str = "auto") -> int:
    """Bytes of one context token's keys and values over all layers."""
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    value = 1 if kv_cache_dtype == "fp8" else _bytes_per_value(cfg)
    return cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * d * 2 * value


def _decode_steps(prompt_lens: list[int], output_lens: list[int]) -> list[tuple[int, int]]:
    """(batch, context tokens read) of each decode step ``t = 1 .. max(m) - 1``."""
    steps = []
    for t in range(1, max(output_lens)):
        running = [p for p, m in zip(prompt_lens, output_lens) if m > t]
        steps.append((len(running), sum(running) + t * len(running)))
    return steps


def floor_output_tok_per_s(cfg: dict[str, Any], prompt_lens: list[int], output_lens: list[int],
                           tb_per_s: float, tensor_parallel_size: int = 1,
                           quantization: str | None = None, kv_cache_dtype: str = "auto") -> float:
    """design.md's floor in output tok/s (module docstring) at ``tb_per_s`` per GPU."""
    steps = _decode_steps(prompt_lens, output_lens)
    total = (len(steps) * weight_bytes_per_step(cfg, quantization)
             + sum(tokens for _, tokens in steps) * kv_bytes_per_token(cfg, kv_cache_dtype))
    seconds = total / (tb_per_s * 1e12 * tensor_parallel_size)
    return sum(output_lens) / seconds


def roofline_output_tok_per_s(cfg: dict[str, Any], prompt_lens: list[int],
                              output_lens: list[int], tb_per_s: float, tflop_per_s: float,
                              tensor_parallel_size: int = 1, quantization: str | None = None,
                              kv_cache_dtype: str = "auto") -> float:
    """The roofline floor in output tok/s (module docstring) at ``tb_per_s`` and
    ``tflop_per_s`` per GPU."""
    bandwidth, peak = tb_per_s * 1e12, tflop_per_s * 1e12
    # FP8 layers run on the FP8 tensor cores, at twice the bf16 rate
    layer_peak = peak * (2 if _layer_bytes_per_value(cfg, quantization) == 1 else 1)
    layers, head = _layer_params(cfg), _head_params(cfg)
    seconds = 2 * (layers * sum(prompt_lens) / layer_peak + head * len(prompt_lens) / peak)
    weights = weight_bytes_per_step(cfg, quantization)
    kv = kv_bytes_per_token(cfg, kv_cache_dtype)
    for batch, tokens in _decode_steps(prompt_lens, output_lens):
        seconds += tokens * kv / bandwidth + max(weights / bandwidth,
                                                 2 * batch * (layers / layer_peak + head / peak))
    return sum(output_lens) * tensor_parallel_size / seconds


def read_config(model_dir: str) -> dict[str, Any]:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)
