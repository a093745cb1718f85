"""Qwen3.5's multi-token-prediction head (``speculative_config`` method ``mtp``): the drafter's
network, read from the target's own checkpoint (``mtp.*``), and the target's feature capture.

The head (``mtp_num_hidden_layers: 1`` in the released checkpoints) takes, at position i, token
i + 1's embedding and the target's final hidden state at i (after its final norm), each
through its own norm (``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``), concatenated and
projected back to the hidden size by ``fc``; then one of Qwen3.5's full-attention decoder
layers (gated attention, partial rotary, its MLP: ``mtp.layers.0.*``; on Qwen3.5-MoE the
routed experts and the shared expert of the target's layers) and ``mtp.norm``; the
target's LM head proposes token i + 2. Every norm scales by ``1 + w`` as the target's do. The
embeddings and the LM head are the target's. The next draft's row (position i + 1) reads the
proposed token and, instead of a target hidden state, the head's own normed output at i, as
vLLM's MTP drafting does. ``forward`` reads that H-wide input from ``hidden_in`` (a static
buffer the drafter fills, so CUDA graphs can replay it) and returns the normed hidden states.

``FinalCapture`` is the target's side: its ``DecoderModel`` hands over what its final norm
returns, stored at the forward's KV slots in ``cache`` (one row a slot, and a last row for slot
-1, the padding rows of a CUDA graph).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nvray.layers.attention import Attention, AttentionMetadata
from nvray.layers.linear import ReplicatedLinear
from nvray.layers.norm import ZeroCenteredRMSNorm
from nvray.layers.tp import end_forward
from nvray.models.decoder import PACKED_QKV_GATE_UP, GatedMLP
from nvray.models.qwen3_5 import GatedAttention, HybridDecoderLayer, SharedExpertMoeBlock

ARCHITECTURE = "Qwen3_5MTP"
PREFIX = "mtp."


def mtp_layers(cfg: Any) -> int:
    """How many MTP layers the target's config names (0: it has no head)."""
    return int(getattr(cfg, "mtp_num_hidden_layers", 0) or 0)


class FinalCapture:
    """The target's final hidden states, stored at each forward's KV slots (see the module
    docstring); ``cache`` is the drafter's feature cache (None: store nothing)."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.cache: torch.Tensor | None = None

    @property
    def feature_width(self) -> int:
        return self.width

    def attach(self, model: nn.Module) -> None:
        model.model.final_capture = self

    def detach(self, model: nn.Module) -> None:
        model.model.final_capture = None
        self.cache = None

    def take(self, hidden: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if self.cache is None or not self.cache.numel():
            return
        self.cache[slot_mapping.long()] = hidden.to(self.cache.dtype)


class Qwen3_5MTP(nn.Module):
    """Qwen3.5's MTP head (see the module docstring); the drafter sets ``embed_tokens`` and
    ``logits_of`` to the target's embeddings and LM head."""

    packed_modules_mapping = PACKED_QKV_GATE_UP

    def __init__(self, cfg: Any, quant: Any = None) -> None:
        super().__init__()
        if mtp_layers(cfg) != 1:
            raise ValueError(f"a Qwen3.5 MTP head of {mtp_layers(cfg)} layers: nvray reads "
                             "one-layer heads (mtp.layers.0.*)")
        self.cfg = cfg
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.embed_tokens: nn.Module | None = None
        self.logits_of: Any = None
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(hidden, eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(hidden, eps)
        self.fc = ReplicatedLinear(2 * hidden, hidden, bias=False)
        prefix = PREFIX + "layers.0"
        mlp = (SharedExpertMoeBlock(cfg, quant, f"{prefix}.mlp") if getattr(cfg, "num_experts", 0)
               else GatedMLP(cfg, quant, f"{prefix}.mlp"))
        self.layers = nn.ModuleList([HybridDecoderLayer(
            "self_attn", GatedAttention(cfg, quant, f"{prefix}.self_attn"), mlp, hidden, eps)])
        self.norm = ZeroCenteredRMSNorm(hidden, eps)
        self.hidden_in: torch.Tensor | None = None  # [tokens, hidden], the drafter's buffer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        assert self.hidden_in is not None and self.embed_tokens is not None
        hidden = self.hidden_in[:positions.shape[0]]
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(self.embed_tokens(input_ids)),
                               self.pre_fc_norm_hidden(hidden)], dim=-1))
        x, residual = self.layers[0](positions, x, None, meta)
        normed, _ = self.norm(x, residual)
        end_forward()
        return normed

    def combine(self, features: torch.Tensor) -> torch.Tensor:
        """A row's H-wide input from the target's hidden state at its position (as it is)."""
        return features

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The target's logits (rank 0; None elsewhere)."""
        return self.logits_of(hidden)

    def target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    def stage_tensor_name(self, name: str) -> str | None:
        """The head's tensors of the target's checkpoint (``mtp.*``); the rest is the
        target's."""
        return name.removeprefix(PREFIX) if name.startswith(PREFIX) else None

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]
