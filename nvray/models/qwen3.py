"""Qwen3 (and Qwen2: qkv bias, no q/k norm) built from tensor-parallel layers.

``packed_modules_mapping`` tells the loader which checkpoint tensors are fused into which
parameters. ``forward`` returns hidden states of every token; ``compute_logits`` takes the rows
to sample and returns their full-vocabulary logits on rank 0 (None elsewhere). On the GPU the
model runner calls ``use_triton_kernels()`` on the modules that have it: the attention's q/k norms,
rotary and KV-cache store then run as one fused kernel, and the norms and activation before FP8
projections quantize their outputs for them. With an ``Fp8Config`` each linear layer is FP8
unless the config leaves the checkpoint modules it fuses unquantized (layers are named by their
checkpoint prefix, e.g. ``model.layers.0.self_attn.q_proj``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nvray.layers.activation import SiluAndMul
from nvray.layers.attention import Attention, AttentionMetadata
from nvray.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nvray.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nvray.layers.norm import RMSNorm
from nvray.layers.rotary import RotaryEmbedding, rope_theta_of
from nvray.quantization import Fp8Config


def _quant(quant: Fp8Config | None, prefix: str, parts: list[str]) -> Fp8Config | None:
    """The layer fusing checkpoint modules ``prefix.<part>``: quantized or not."""
    return quant.for_modules([f"{prefix}.{p}" for p in parts]) if quant is not None else None


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: Any, qk_norm: bool, qkv_bias: bool, quant: Fp8Config | None,
                 prefix: str) -> None:
        super().__init__()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=qkv_bias,
                                          quant=_quant(quant, prefix, ["q_proj", "k_proj", "v_proj"]))
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * head_dim, cfg.hidden_size,
                                        bias=False, quant=_quant(quant, prefix, ["o_proj"]))
        self.rotary_emb = RotaryEmbedding(head_dim, cfg.max_position_embeddings, rope_theta_of(cfg))
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, head_dim ** -0.5)
        self.q_norm = RMSNorm(head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.fused_prologue = None  # set by use_triton_kernels()

    def use_triton_kernels(self) -> None:
        """q/k norms, rotary and the KV-cache store as one Triton kernel
        (``kernels/qk_norm_rope.py``), GPU only."""
        from kernels import qk_norm_rope_store  # noqa: PLC0415

        self.fused_prologue = qk_norm_rope_store

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        if self.fused_prologue is not None:  # k and v go straight into the cache
            norms = (self.q_norm, self.k_norm) if self.q_norm is not None else None
            q = self.fused_prologue(
                qkv, positions, self.rotary_emb.cos_sin, self.num_heads, self.num_kv_heads,
                norms[0].weight if norms else None, norms[1].weight if norms else None,
                norms[0].eps if norms else 0.0, self.attn.k_cache, self.attn.v_cache,
                meta.slot_mapping)
            o = self.attn(q, None, None, meta)  # [T, H, D]
        else:
            q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q = qkv[:, :q_size].view(-1, self.num_heads, self.head_dim)  # [T, H, D]
            k = qkv[:, q_size:q_size + kv_size].view(-1, self.num_kv_heads, self.head_dim)
            v = qkv[:, q_size + kv_size:].view(-1, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary_emb(positions, q, k)
            o = self.attn(q, k, v, meta)
        return self.o_proj(o.flatten(1))


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: Any, quant: Fp8Config | None, prefix: str) -> None:
        super().__init__()
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={cfg.hidden_act!r} is not supported (only 'silu')")
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2,
            quant=_quant(quant, prefix, ["gate_proj", "up_proj"]))
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size,
                                           quant=_quant(quant, prefix, ["down_proj"]))
        self.act_fn = SiluAndMul(quantize_for=self.down_proj.quant_method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, qk_norm: bool, qkv_bias: bool, quant: Fp8Config | None,
                 prefix: str) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(cfg, qk_norm, qkv_bias, quant, f"{prefix}.self_attn")
        self.mlp = Qwen3MLP(cfg, quant, f"{prefix}.mlp")
        # with FP8 projections, the norms' kernels quantize their outputs for them (GPU)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                       quantize_for=self.self_attn.qkv_proj.quant_method)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                quantize_for=self.mlp.gate_up_proj.quant_method)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Qwen3Model(nn.Module):
    def __init__(self, cfg: Any, qk_norm: bool, qkv_bias: bool, quant: Fp8Config | None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, qk_norm, qkv_bias, quant, f"model.layers.{i}")
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class Qwen3ForCausalLM(nn.Module):
    qk_norm, qkv_bias = True, False
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: Any, quant: Fp8Config | None = None) -> None:
        super().__init__()
        self.model = Qwen3Model(cfg, self.qk_norm, self.qkv_bias, quant)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]


class Qwen2ForCausalLM(Qwen3ForCausalLM):
    qk_norm, qkv_bias = False, True
