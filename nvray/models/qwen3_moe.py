"""Qwen3-MoE (``Qwen3MoeForCausalLM``, e.g. Qwen3-30B-A3B: 128 experts, top-8): Qwen3's
attention (q/k norms, no bias) and, in every layer the config makes sparse, a router over
``num_experts`` SwiGLU experts (``nvray.layers.moe.FusedMoE``) in place of the dense MLP.

A layer is sparse unless ``mlp_only_layers`` lists it, when ``num_experts > 0`` and
``(index + 1) % decoder_sparse_step == 0`` (transformers' rule); the others keep a dense MLP of
``intermediate_size``. The router (``mlp.gate``) is a plain replicated linear layer, never FP8
(Qwen's FP8 checkpoints keep it in bf16); the experts are FP8 with the model's ``Fp8Config``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nvray.layers.attention import AttentionMetadata
from nvray.layers.moe import FusedMoE
from nvray.layers.tp import PartialSum
from nvray.models.decoder import CausalLM, check_hidden_act, quant_for
from nvray.quantization import Fp8Config


class SparseMoeBlock(nn.Module):
    """The router and the experts of one sparse layer; ``renormalize`` (None: the config's
    ``norm_topk_prob``) rescales each token's top-k weights to sum to 1."""

    def __init__(self, cfg: Any, quant: Fp8Config | None, prefix: str,
                 renormalize: bool | None = None) -> None:
        super().__init__()
        check_hidden_act(cfg)
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.gate.weight.requires_grad_(False)
        renormalize = bool(cfg.norm_topk_prob) if renormalize is None else renormalize
        self.experts = FusedMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                                cfg.moe_intermediate_size, renormalize,
                                quant_for(quant, prefix, ["experts"]))

    def forward(self, x: torch.Tensor, meta: AttentionMetadata | None = None
                ) -> torch.Tensor | PartialSum:
        real = meta.real_tokens() if meta is not None and self.experts.expert_parallel else None
        return self.experts(x, F.linear(x, self.gate.weight), real)


def is_sparse_layer(cfg: Any, index: int) -> bool:
    return (index not in (getattr(cfg, "mlp_only_layers", None) or [])
            and cfg.num_experts > 0 and (index + 1) % cfg.decoder_sparse_step == 0)


class Qwen3MoeForCausalLM(CausalLM):
    qk_norm, qkv_bias = True, False

    def make_mlp(self, index: int, prefix: str) -> nn.Module:
        if is_sparse_layer(self.cfg, index):
            return SparseMoeBlock(self.cfg, self.quant, f"{prefix}.mlp")
        return super().make_mlp(index, prefix)
