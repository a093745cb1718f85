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
keys and values count one byte a value. An MoE layer's step reads the router and the experts
its tokens pick (about ``E * (1 - (1 - k/E) ** B)`` of ``E`` at batch ``B`` and top-``k``, routing
uniform) and a token computes with its ``k``; a sliding-window layer reads at most its window
of each context (Gemma 3's local layers, Mistral's). A linear-attention layer (Qwen3.5's Gated
DeltaNet) holds no KV: a decode step reads and writes each running sequence's state of it
(the float32 ``[value heads, key dim, value dim]`` matrix and the conv's last inputs), whatever
the context; Qwen3.5's full-attention layers' q projection is twice as wide (the output gate) and
its MoE layers add a shared expert.

The prefill floor of a pooling request (``prefill_flops``; ``python -m nvray.bench embed``) is
its forward pass's arithmetic alone: no LM head (a pooled row skips it), ``2 x`` the decoder
layers' linear parameters a token computes with per prompt token, and causal attention's
``2 * 2 * q_heads * head_dim`` per (query, key) pair of each attention layer.
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


def _num_experts(cfg: dict[str, Any]) -> int:
    return cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0


def _is_sparse(cfg: dict[str, Any], index: int) -> bool:
    """Qwen3-MoE's rule (nvray/models/qwen3_moe.py)."""
    return (_num_experts(cfg) > 0 and index not in (cfg.get("mlp_only_layers") or [])
            and (index + 1) % cfg.get("decoder_sparse_step", 1) == 0)


def layer_types(cfg: dict[str, Any]) -> list[str]:
    """Each layer's kind ("linear_attention" or an attention kind)."""
    n = cfg["num_hidden_layers"]
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    if "full_attention_interval" in cfg:  # Qwen3.5
        every = cfg["full_attention_interval"]
        return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    return ["full_attention"] * n


def _is_hybrid(cfg: dict[str, Any]) -> bool:
    return "linear_attention" in layer_types(cfg)


def _attention_params(cfg: dict[str, Any]) -> int:
    h = cfg["hidden_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    gate = q if _is_hybrid(cfg) else 0  # Qwen3.5's output gate, in q_proj
    return h * (q + gate + 2 * kv) + q * h


def _linear_attention_params(cfg: dict[str, Any]) -> int:
    h, nv = cfg["hidden_size"], cfg["linear_num_value_heads"]
    key, value = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"], nv * cfg["linear_value_head_dim"]
    return h * (2 * key + value) + h * value + 2 * h * nv + value * h


def state_bytes_per_sequence(cfg: dict[str, Any]) -> int:
    """One sequence's recurrent state over all linear-attention layers (S in float32, the
    conv's last inputs in the model's dtype)."""
    linear = layer_types(cfg).count("linear_attention")
    if not linear:
        return 0
    key = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    conv = (2 * key + cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]) * (
        cfg["linear_conv_kernel_dim"] - 1) * _bytes_per_value(cfg)
    s = cfg["linear_num_value_heads"] * cfg["linear_key_head_dim"] * cfg["linear_value_head_dim"] * 4
    return linear * (s + conv)


def experts_touched(num_experts: int, top_k: int, batch: int) -> float:
    """Experts a step of ``batch`` tokens reads on average, routing uniform at random:
    ``E * (1 - (1 - k/E) ** B)``."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def _layer_params(cfg: dict[str, Any], batch: int | None = None) -> int:
    """Parameters of the linear layers of all decoder layers that a step of ``batch`` tokens
    reads (None: every one; an MoE layer's router and the experts its tokens pick)."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    sparse = sum(_is_sparse(cfg, i) for i in range(layers))
    linear = layer_types(cfg).count("linear_attention")
    total = ((layers - linear) * _attention_params(cfg)
             + (linear * _linear_attention_params(cfg) if linear else 0)
             + (layers - sparse) * 3 * h * cfg.get("intermediate_size", 0))
    if sparse:
        e = _num_experts(cfg)
        read = e if batch is None else experts_touched(e, cfg["num_experts_per_tok"], batch)
        shared = cfg.get("shared_expert_intermediate_size", 0)
        total += sparse * round(h * e + read * 3 * h * cfg["moe_intermediate_size"]
                                + (3 * h * shared + h if shared else 0))
    return total


def _active_layer_params(cfg: dict[str, Any]) -> int:
    """Parameters of the decoder layers one token computes with (its top-k experts)."""
    return _layer_params(cfg, batch=1) if _num_experts(cfg) else _layer_params(cfg)


def _layer_bytes_per_value(cfg: dict[str, Any], quantization: str | None) -> int:
    fp8 = quantization == "fp8" or "quantization_config" in cfg
    return 1 if fp8 else _bytes_per_value(cfg)


def weight_bytes_per_step(cfg: dict[str, Any], quantization: str | None = None,
                          batch: int | None = None) -> int:
    """Bytes of the weights one decode step of ``batch`` sequences reads: the layers' linear
    layers (an MoE layer's experts its tokens pick) and the LM head."""
    return (_layer_params(cfg, batch) * _layer_bytes_per_value(cfg, quantization)
            + _head_params(cfg) * _bytes_per_value(cfg))


def layer_windows(cfg: dict[str, Any]) -> list[int | None]:
    """Each layer's attention window (None: full): Gemma 3's ``layer_types`` (or its older
    ``sliding_window_pattern``), Mistral's ``sliding_window`` on every layer."""
    n, window = cfg["num_hidden_layers"], cfg.get("sliding_window")
    if _is_hybrid(cfg):  # Qwen3.5: full attention where it is not linear
        return [None for t in layer_types(cfg) if t != "linear_attention"]
    if cfg.get("layer_types") or "sliding_window_pattern" in cfg:
        every = cfg.get("sliding_window_pattern") or 6
        types = cfg.get("layer_types") or ["full_attention" if (i + 1) % every == 0
                                           else "sliding_attention" for i in range(n)]
        return [window if t == "sliding_attention" else None for t in types]
    if cfg.get("use_sliding_window", True) and window:
        return [window] * n
    return [None] * n


def kv_bytes_per_token(cfg: dict[str, Any], kv_cache_dtype: str = "auto") -> int:
    """Bytes of one context token's keys and values over all (attention) layers."""
    return len(layer_windows(cfg)) * _kv_bytes_per_layer_token(cfg, kv_cache_dtype)


def _kv_bytes_per_layer_token(cfg: dict[str, Any], kv_cache_dtype: str) -> int:
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    value = 1 if kv_cache_dtype == "fp8" else _bytes_per_value(cfg)
    return cfg["num_key_value_heads"] * d * 2 * value


def _decode_steps(prompt_lens: list[int], output_lens: list[int]) -> list[tuple[int, list[int]]]:
    """(batch, the running sequences' context lengths) of each decode step ``t = 1 .. max(m) - 1``."""
    steps = []
    for t in range(1, max(output_lens)):
        contexts = [p + t for p, m in zip(prompt_lens, output_lens) if m > t]
        steps.append((len(contexts), contexts))
    return steps


def _kv_bytes_of_step(cfg: dict[str, Any], contexts: list[int], kv_cache_dtype: str) -> int:
    """Keys and values a decode step reads: each attention layer its window of each context;
    and each linear-attention layer's state of each sequence, read and written."""
    per_token = _kv_bytes_per_layer_token(cfg, kv_cache_dtype)
    windows = layer_windows(cfg)  # attention layers only (a hybrid's linear layers hold no KV)
    full = sum(contexts)
    read = {w: (full if w is None else sum(min(c, w) for c in contexts)) for w in set(windows)}
    return per_token * sum(read[w] for w in windows) + 2 * len(contexts) * state_bytes_per_sequence(cfg)


def floor_output_tok_per_s(cfg: dict[str, Any], prompt_lens: list[int], output_lens: list[int],
                           tb_per_s: float, tensor_parallel_size: int = 1,
                           quantization: str | None = None, kv_cache_dtype: str = "auto") -> float:
    """design.md's floor in output tok/s (module docstring) at ``tb_per_s`` per GPU."""
    total = sum(weight_bytes_per_step(cfg, quantization, batch)
                + _kv_bytes_of_step(cfg, contexts, kv_cache_dtype)
                for batch, contexts in _decode_steps(prompt_lens, output_lens))
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
    layers, head = _active_layer_params(cfg), _head_params(cfg)
    seconds = 2 * (layers * sum(prompt_lens) / layer_peak + head * len(prompt_lens) / peak)
    for batch, contexts in _decode_steps(prompt_lens, output_lens):
        weights = weight_bytes_per_step(cfg, quantization, batch)
        seconds += (_kv_bytes_of_step(cfg, contexts, kv_cache_dtype) / bandwidth
                    + max(weights / bandwidth, 2 * batch * (layers / layer_peak + head / peak)))
    return sum(output_lens) * tensor_parallel_size / seconds


def prefill_flops(cfg: dict[str, Any], prompt_len: int) -> int:
    """FLOPs of one prompt's forward pass without the LM head: ``2 * P * L`` for the linear
    layers (``P`` their parameters a token computes with, ``L`` the prompt length) plus
    ``2 * 2 * q_heads * head_dim`` per (query, key) pair of each attention layer (QK^T and PV):
    causal, the token at position ``i`` attends to ``i`` keys (at most a sliding window's),
    ``L(L+1)/2`` pairs a full-attention layer. Norms, RoPE, activations and a linear-attention
    layer's recurrence are left out: a bound, not an estimate."""
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    pairs = sum(sum(min(i, w or i) for i in range(1, prompt_len + 1)) for w in layer_windows(cfg))
    return 2 * _active_layer_params(cfg) * prompt_len + 4 * cfg["num_attention_heads"] * d * pairs


def read_config(model_dir: str) -> dict[str, Any]:
    """A checkpoint's config.json (a vision-language checkpoint's language model's keys)."""
    from nvray.model_config import language_model_keys  # noqa: PLC0415

    with open(os.path.join(model_dir, "config.json")) as f:
        return language_model_keys(json.load(f))
