"""Gemma 3 text (``Gemma3ForCausalLM``): local (sliding-window) and global attention layers
interleaved as ``layer_types`` says (five local to one global in the released models), each kind
with its own rope (``rope_parameters`` per layer type, or the older ``rope_theta`` +
``rope_local_base_freq`` + ``rope_scaling`` of the global layers), q/k norms, a GeGLU MLP
(tanh-approximated GELU), RMSNorms that scale by ``1 + weight``, a norm after attention and
after the MLP as well as before each ("sandwich" norms), embeddings scaled by
``sqrt(hidden_size)``, attention scaled by ``query_pre_attn_scalar ** -0.5``, tied LM head.

The ``1 + weight`` of Gemma's norms is folded into the weight as it loads, so the norms run the
same code (and kernels) as every other model's. Logit soft-capping (Gemma 2's) is refused by
name: Gemma 3 checkpoints do not set it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nvray.layers.attention import AttentionMetadata
from nvray.layers.compiled import compiled
from nvray.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from nvray.layers.norm import ZeroCenteredRMSNorm
from nvray.models.decoder import (CausalLM, DecoderAttention, DecoderModel, check_hidden_act,
                                  quant_for)
from nvray.quantization import Fp8Config


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2*I] -> [T, I]
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class GeluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self._fn = gelu_tanh_and_mul

    def enable_torch_compile(self) -> None:
        self._fn = compiled(gelu_tanh_and_mul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fn(x)


class GemmaMLP(nn.Module):
    def __init__(self, cfg: Any, quant: Fp8Config | None, prefix: str) -> None:
        super().__init__()
        check_hidden_act(cfg, ("gelu_pytorch_tanh",))
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2,
            quant=quant_for(quant, prefix, ["gate_proj", "up_proj"]))
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size,
                                           quant=quant_for(quant, prefix, ["down_proj"]))
        self.act_fn = GeluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    """Norms before and after attention and the MLP; the residual adds fused into the norms
    that follow them."""

    def __init__(self, attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.self_attn, self.mlp = attn, mlp
        self.input_layernorm = ZeroCenteredRMSNorm(hidden_size, eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(hidden_size, eps)
        self.pre_feedforward_layernorm = ZeroCenteredRMSNorm(hidden_size, eps)
        self.post_feedforward_layernorm = ZeroCenteredRMSNorm(hidden_size, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x, meta))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3Model(DecoderModel):
    """The shared decoder's, with Gemma's norm and embeddings scaled by ``sqrt(hidden_size)``
    (the factor rounded to the compute dtype first, as transformers does)."""

    def __init__(self, cfg: Any, make_layer: Any) -> None:
        super().__init__(cfg, make_layer, norm_class=ZeroCenteredRMSNorm)
        self.embed_scale = cfg.hidden_size ** 0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)


class Gemma3ForCausalLM(CausalLM):
    qk_norm, qkv_bias = True, False

    def __init__(self, cfg: Any, quant: Fp8Config | None = None) -> None:
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(cfg, name, None) is not None:
                raise ValueError(f"{name}={getattr(cfg, name)} is not supported (Gemma 3 "
                                 "checkpoints do not set it)")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention=True is not supported (a causal LM "
                             "serves causal attention)")
        super().__init__(cfg, quant)

    def make_model(self, cfg: Any) -> nn.Module:
        return Gemma3Model(cfg, self.make_layer)

    def make_attention(self, index: int, prefix: str) -> nn.Module:
        return DecoderAttention(self.cfg, self.quant, f"{prefix}.self_attn", qk_norm=True,
                                qkv_bias=bool(getattr(self.cfg, "attention_bias", False)),
                                layer_type=self.layer_types[index],
                                scale=self.cfg.query_pre_attn_scalar ** -0.5,
                                norm_class=ZeroCenteredRMSNorm)

    def make_mlp(self, index: int, prefix: str) -> nn.Module:
        return GemmaMLP(self.cfg, self.quant, f"{prefix}.mlp")

    def make_layer(self, index: int, prefix: str) -> nn.Module:
        return Gemma3DecoderLayer(self.make_attention(index, prefix), self.make_mlp(index, prefix),
                                  self.cfg.hidden_size, self.cfg.rms_norm_eps)
