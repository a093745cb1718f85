"""Qwen3.5 (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``, and the language model of their
``...ForConditionalGeneration`` checkpoints): a hybrid of Gated DeltaNet linear attention
(``layers/gated_deltanet.py``, three layers of every four in the released models) and gated full
attention, as ``layer_types`` says.

- Gated full attention: q_proj yields each head's query and an output gate side by side
  (``[q_h | gate_h]``, 2 x head_dim per head); per-head q/k norms; rotary on the first
  ``partial_rotary_factor`` of each head (a quarter; text positions make the checkpoints'
  M-RoPE plain rope); paged KV like every other model; the output is multiplied by
  ``sigmoid(gate)`` before o_proj.
- Every RMSNorm but the linear attention's gated one scales by ``1 + w``
  (``ZeroCenteredRMSNorm``).
- Dense: a SwiGLU MLP per layer. MoE: every layer routes over ``num_experts`` experts (top-k,
  renormalised) and adds a shared expert gated by ``sigmoid(shared_expert_gate(x))``.

The full-attention layers hold the paged KV cache (``attention_layers()``); the linear-attention
layers hold a fixed-size state per sequence slot (``state_layers()``), which the model runner
allocates and the engine assigns (``nvray/engine/block_manager.py``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nvray.layers.attention import Attention, AttentionMetadata
from nvray.layers.gated_deltanet import GatedDeltaNet
from nvray.layers.linear import QKVParallelLinear, RowParallelLinear
from nvray.layers.norm import ZeroCenteredRMSNorm
from nvray.layers.rotary import get_rope, rope_max_positions, rope_spec_of
from nvray.layers.tp import PartialSum, divide, tp_size
from nvray.models.decoder import (CausalLM, DecoderModel, GatedMLP, check_hidden_act,
                                  head_dim_of, layer_types_of, quant_for)
from nvray.models.qwen3_moe import SparseMoeBlock
from nvray.quantization import Fp8Config

LINEAR = "linear_attention"
_LANGUAGE_MODEL = "model.language_model."
_NOT_SERVED = ("model.visual.", "mtp.")
logger = logging.getLogger(__name__)


class GatedAttention(nn.Module):
    """Qwen3.5's full attention (see the module docstring)."""

    def __init__(self, cfg: Any, quant: Fp8Config | None, prefix: str) -> None:
        super().__init__()
        head_dim = head_dim_of(cfg)
        self.num_heads = divide(cfg.num_attention_heads, tp_size(), "num_attention_heads")
        # the query and gate of each head count as two heads of the fused projection
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, head_dim, 2 * cfg.num_attention_heads,
                                          cfg.num_key_value_heads,
                                          bias=bool(getattr(cfg, "attention_bias", False)),
                                          quant=quant_for(quant, prefix, ["q_proj", "k_proj", "v_proj"]))
        self.num_kv_heads, self.head_dim = self.qkv_proj.num_kv_heads, head_dim
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * head_dim, cfg.hidden_size,
                                        bias=bool(getattr(cfg, "attention_bias", False)),
                                        quant=quant_for(quant, prefix, ["o_proj"]))
        self.q_norm = ZeroCenteredRMSNorm(head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(head_dim, cfg.rms_norm_eps)
        reach = rope_max_positions(cfg, layer_types_of(cfg))
        self.rotary_emb = get_rope(head_dim, reach, rope_spec_of(cfg, "full_attention"))
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, head_dim ** -0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata
                ) -> torch.Tensor | PartialSum:
        tokens, heads, d = x.shape[0], self.num_heads, self.head_dim
        qkv = self.qkv_proj(x)
        q_and_gate = qkv[:, :2 * heads * d].view(tokens, heads, 2 * d)
        q, gate = q_and_gate[..., :d].contiguous(), q_and_gate[..., d:].reshape(tokens, heads * d)
        kv = self.num_kv_heads * d
        k = qkv[:, 2 * heads * d:2 * heads * d + kv].reshape(tokens, self.num_kv_heads, d)
        v = qkv[:, 2 * heads * d + kv:].reshape(tokens, self.num_kv_heads, d)
        q = self.q_norm(q.view(-1, d)).view(tokens, heads, d)  # the norms take [rows, d]
        k = self.k_norm(k.reshape(-1, d)).view(tokens, self.num_kv_heads, d)
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v, meta).flatten(1)
        return self.o_proj(o * torch.sigmoid(gate))


class HybridDecoderLayer(nn.Module):
    """``x + mixer(norm(x))``, then ``x + mlp(norm(x))`` (residual adds fused into the norms);
    the mixer is ``linear_attn`` (Gated DeltaNet) or ``self_attn`` (gated attention), named as
    the checkpoints name it."""

    def __init__(self, mixer_name: str, mixer: nn.Module, mlp: nn.Module, hidden_size: int,
                 eps: float) -> None:
        super().__init__()
        self.mixer_name = mixer_name
        setattr(self, mixer_name, mixer)
        self.mlp = mlp
        self.input_layernorm = ZeroCenteredRMSNorm(hidden_size, eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(hidden_size, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = getattr(self, self.mixer_name)(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x, meta), residual


class Qwen3_5ForCausalLM(CausalLM):
    """Dense Qwen3.5."""

    def __init__(self, cfg: Any, quant: Fp8Config | None = None) -> None:
        check_hidden_act(cfg)
        kinds = set(layer_types_of(cfg)) - {LINEAR, "full_attention"}
        if kinds:
            raise ValueError(f"layer_types {sorted(kinds)} are not supported by Qwen3.5 "
                             f"(supported: {LINEAR!r}, 'full_attention')")
        super().__init__(cfg, quant)

    def make_model(self, cfg: Any) -> nn.Module:
        if getattr(cfg, "vision_config", None):
            logger.info("%s: serving its language model; the vision tower is not loaded (text "
                        "input only)", (getattr(cfg, "architectures", None) or ["?"])[0])
        return DecoderModel(cfg, self.make_layer, norm_class=ZeroCenteredRMSNorm)

    def stage_tensor_name(self, name: str) -> str | None:
        """A vision-language checkpoint's language model loads as the model (its vision tower
        and multi-token-prediction head are skipped)."""
        if name.startswith(_LANGUAGE_MODEL):
            name = "model." + name.removeprefix(_LANGUAGE_MODEL)
        elif name.startswith(_NOT_SERVED):
            return None
        return super().stage_tensor_name(name)

    def make_layer(self, index: int, prefix: str) -> nn.Module:
        if self.layer_types[index] == LINEAR:
            name, mixer = "linear_attn", GatedDeltaNet(self.cfg, self.quant, f"{prefix}.linear_attn")
        else:
            name, mixer = "self_attn", GatedAttention(self.cfg, self.quant, f"{prefix}.self_attn")
        return HybridDecoderLayer(name, mixer, self.make_mlp(index, prefix),
                                  self.cfg.hidden_size, self.cfg.rms_norm_eps)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers
                if layer.mixer_name == "self_attn"]

    def state_layers(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.model.layers
                if layer.mixer_name == "linear_attn"]


class SharedExpertMoeBlock(SparseMoeBlock):
    """Qwen3-MoE's routed experts (weights always renormalised) plus a shared expert scaled by
    ``sigmoid(shared_expert_gate(x))``; under tensor parallelism both are the rank's partial
    sums, added before the norm that follows sums them."""

    def __init__(self, cfg: Any, quant: Fp8Config | None, prefix: str) -> None:
        super().__init__(cfg, quant, prefix, renormalize=True)
        self.shared_expert = GatedMLP(cfg, quant, f"{prefix}.shared_expert",
                                      cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.shared_expert_gate.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata | None = None
                ) -> torch.Tensor | PartialSum:
        routed = super().forward(x, meta)
        shared = self.shared_expert(x)
        scale = torch.sigmoid(F.linear(x, self.shared_expert_gate.weight))
        if isinstance(routed, PartialSum):
            return PartialSum(routed.partial + scale * shared.partial)
        return routed + scale * shared


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5 MoE (e.g. Qwen3.5-35B-A3B: 256 experts, top-8, a shared expert per layer)."""

    def make_mlp(self, index: int, prefix: str) -> nn.Module:
        return SharedExpertMoeBlock(self.cfg, self.quant, f"{prefix}.mlp")
