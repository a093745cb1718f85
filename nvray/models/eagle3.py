"""EAGLE-3 (``speculative_config`` method ``eagle3``): the drafter's network and the target's
feature capture.

The checkpoint is the format EAGLE-3's authors publish and vLLM and SGLang read
(``architectures: ["LlamaForCausalLMEagle3"]``): one Llama decoder layer (``midlayer.*``) whose
q, k and v project from twice the hidden size, ``fc`` (three target hidden sizes to one),
``norm``, an LM head over a draft vocabulary of ``draft_vocab_size`` tokens with ``d2t`` (a
draft id's offset to its target id: ``target = draft + d2t[draft]``; absent when the draft
vocabulary is the target's), and ``embed_tokens`` where the drafter has its own (else it
shares the target's). ``t2d`` is not needed. The ``speculators`` library's format
(``speculators_model_type: "eagle3"``, tensors ``layers.0.*``) reads the same
(``model_config.speculators_keys``). The config may set ``target_hidden_size``,
``norm_before_residual`` and ``eagle_aux_hidden_state_layer_ids`` (at its top level or in
``eagle_config``); without them the features come from the target's layers 2, L // 2 and
L - 3.

How it drafts (the feature of position i: the target's residual stream entering each named
layer at i, concatenated): the row at position i reads token i + 1's embedding and ``fc`` of
position i's feature, attends over the rows before it, and proposes token i + 2. The next
draft's row (position i + 1) reads the proposed token and, instead of a target feature, the
drafter's own hidden state before its final norm (``prenorm``). ``forward`` reads that H-wide
input from ``hidden_in`` (a static buffer the drafter fills, so CUDA graphs can replay it) and
returns ``[tokens, 2, hidden]``: the normed hidden states (for the LM head) and ``prenorm``.

``AuxCapture`` is the target's side: each named ``DecoderLayer`` hands it the stream entering it
(the new residual of its input norm), stored as that layer's part of the feature at the
forward's KV slots in ``cache`` (one row a slot, and a last row for slot -1, the padding rows
of a CUDA graph).

The layer ids count layers as vLLM does (layer l's input: HF's ``output_hidden_states[l]``);
SGLang adds one to the ids a config names, so a head trained with SGLang's count and explicit
ids names the layer before the one it was trained on.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nvray.layers.attention import AttentionMetadata, Attention
from nvray.layers.embed_head import ParallelLMHead
from nvray.layers.linear import ReplicatedLinear
from nvray.layers.norm import RMSNorm
from nvray.layers.tp import end_forward
from nvray.models.decoder import PACKED_QKV_GATE_UP, DecoderAttention, GatedMLP

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def aux_layer_ids(cfg: Any, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose input streams make an EAGLE-3 drafter's feature."""
    nested = getattr(cfg, "eagle_config", None) or {}
    ids = getattr(cfg, "eagle_aux_hidden_state_layer_ids", None) or nested.get(
        "eagle_aux_hidden_state_layer_ids")
    ids = tuple(ids) if ids else (2, num_target_layers // 2, num_target_layers - 3)
    if len(ids) != 3 or any(not 0 <= i < num_target_layers for i in ids):
        raise ValueError(f"EAGLE-3 drafter: eagle_aux_hidden_state_layer_ids={list(ids)} must "
                         f"name three layers of the target's {num_target_layers}")
    return ids


class AuxCapture:
    """The target's features for its EAGLE-3 drafter (see the module docstring)."""

    def __init__(self, layers: tuple[int, ...], width: int) -> None:
        self.layers, self.width = layers, width
        self.cache: torch.Tensor | None = None  # [slots + 1, 3 * width], set by the drafter

    @property
    def feature_width(self) -> int:
        """A token's feature: the named layers' streams side by side."""
        return len(self.layers) * self.width

    def attach(self, model: nn.Module) -> None:
        """Have the target's named layers hand over their input streams."""
        for index in sorted(set(self.layers)):
            layer = model.model.layers[index]
            if not hasattr(layer, "aux_capture"):
                raise ValueError(f"EAGLE-3: the target's layer {index} ({type(layer).__name__}) "
                                 "cannot hand its input to a drafter")
            layer.aux_capture, layer.aux_index = self, index

    def detach(self, model: nn.Module) -> None:
        for index in sorted(set(self.layers)):
            model.model.layers[index].aux_capture = None
        self.cache = None

    def take(self, index: int, stream: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Layer ``index``'s input stream [tokens, width], stored at each token's slot in the
        feature's part(s) that name the layer."""
        if self.cache is None or not self.cache.numel():
            return
        parts = self.cache.view(-1, len(self.layers), self.width)
        slots = slot_mapping.long()
        for part, layer in enumerate(self.layers):
            if layer == index:
                parts[slots, part] = stream.to(parts.dtype)


class Eagle3Layer(nn.Module):
    """The drafter's layer: attention over ``[norm(embeds), hidden_norm(hidden)]``, then the
    MLP, each added to the residual (``hidden``, or its norm with ``norm_before_residual``)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = DecoderAttention(cfg, None, "midlayer.self_attn", qk_norm=False,
                                          qkv_bias=bool(getattr(cfg, "attention_bias", False)),
                                          input_size=2 * hidden)
        self.mlp = GatedMLP(cfg, None, "midlayer.mlp", bias=bool(getattr(cfg, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.norm_before_residual = bool(getattr(cfg, "norm_before_residual", False))

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x, meta), residual


class Eagle3LlamaForCausalLM(nn.Module):
    """An EAGLE-3 drafter (see the module docstring). ``embed_tokens`` is the target's unless
    the config says ``eagle_own_embeddings`` (the drafter sets it from the checkpoint)."""

    packed_modules_mapping = PACKED_QKV_GATE_UP

    def __init__(self, cfg: Any, quant: Any = None) -> None:
        super().__init__()
        if getattr(cfg, "num_hidden_layers", 1) != 1:
            raise ValueError(f"an EAGLE-3 drafter of {cfg.num_hidden_layers} layers: nvray "
                             "reads one-layer drafters (midlayer.*)")
        self.cfg = cfg
        hidden = cfg.hidden_size
        target_hidden = getattr(cfg, "target_hidden_size", None) or hidden
        self.vocab_size = cfg.vocab_size
        self.draft_vocab_size = getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size
        self.embed_tokens: nn.Module | None = None
        if getattr(cfg, "eagle_own_embeddings", False):
            from nvray.layers.embed_head import VocabParallelEmbedding  # noqa: PLC0415

            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, hidden)
        self.fc = ReplicatedLinear(3 * target_hidden, hidden, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(cfg)])
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, hidden)
        self.d2t: nn.Parameter | None = None
        if self.draft_vocab_size != cfg.vocab_size:
            self.d2t = nn.Parameter(torch.zeros(self.draft_vocab_size, dtype=torch.int64),
                                    requires_grad=False)
        self.hidden_in: torch.Tensor | None = None  # [tokens, hidden], the drafter's buffer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        assert self.hidden_in is not None and self.embed_tokens is not None
        hidden = self.hidden_in[:positions.shape[0]]
        x, residual = self.layers[0](positions, self.embed_tokens(input_ids), hidden, meta)
        normed, prenorm = self.norm(x, residual)
        end_forward()
        return torch.stack([normed, prenorm], dim=1)

    def combine(self, features: torch.Tensor) -> torch.Tensor:
        """A row's H-wide input from the target's feature at its position."""
        return self.fc(features)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Draft-vocabulary logits on rank 0 (None elsewhere)."""
        return self.lm_head(hidden)

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids.long()]

    def stage_tensor_name(self, name: str) -> str | None:
        """A checkpoint tensor's parameter (the loader prefixes bare names with ``model.``)."""
        name = name.removeprefix("model.")
        if name == "t2d" or (name == "d2t" and self.d2t is None):
            return None
        return "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]
