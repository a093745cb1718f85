"""Qwen3 (per-head q/k RMSNorm, no qkv bias) and Qwen2 (qkv bias, no q/k norms): the shared
decoder of ``decoder.py`` with the family's switches."""

from __future__ import annotations

from nvray.models.decoder import CausalLM


class Qwen3ForCausalLM(CausalLM):
    qk_norm, qkv_bias = True, False


class Qwen2ForCausalLM(CausalLM):
    qk_norm, qkv_bias = False, True
