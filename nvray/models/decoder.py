"""The pre-norm decoder the Qwen, Llama and Mistral families share, built from tensor-parallel
layers; a family file declares what differs (q/k norms, qkv bias, the MLP of each layer).

``CausalLM`` is the model class the engine sees: ``forward`` returns hidden states of every
token; ``compute_logits`` takes the rows to sample and returns their full-vocabulary logits on
rank 0 (None elsewhere); ``attention_layers()`` lists the layers that hold a paged KV cache, each
with its cache spec (``Attention.sliding_window``: None for full attention). ``packed_modules_mapping``
tells the loader which checkpoint tensors are fused into which parameters. On the GPU the model
runner calls ``use_triton_kernels()`` on the modules that have it: the attention's q/k norms,
rotary and KV-cache store then run as one fused kernel (heads rotated whole; a partial rotary
keeps the torch path), and the norms and activation before FP8 projections quantize their
outputs for them. With an ``Fp8Config`` each linear layer is FP8 unless the config leaves the
checkpoint modules it fuses unquantized (layers are named by their checkpoint prefix, e.g.
``model.layers.0.self_attn.q_proj``). Under tensor parallelism the row-parallel projections
(o_proj, down_proj, the experts) hand their ranks' partial sums to the norm they feed
(``tp.PartialSum``), which sums them over the ranks, on the GPU inside its own kernel.

Under pipeline parallelism (``layers/pp.py``) a rank builds its stage's layers only (named by
their index in the whole model, so checkpoint names load unchanged: ``stage_tensor_name``), the
embeddings on the first stage and the final norm and LM head on the last. A stage after the
first reads its input, the previous stage's hidden states and residual, from ``stage_input``
(a static buffer the runner fills before the forward); a stage before the last returns
``[tokens, 2, hidden]`` (hidden states, residual) for the next.

With an EAGLE-3 drafter (``nvray/models/eagle3.py``) each layer it names hands its
``aux_capture`` the residual stream entering it (the new residual its input norm returns, whole
on every rank), stored at the forward's KV slots; with Qwen3.5's MTP head
(``nvray/models/qwen3_5_mtp.py``) the model hands its ``final_capture`` what its final norm
returns.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import re

import torch
from torch import nn

from nvray.layers.activation import SiluAndMul
from nvray.layers.attention import Attention, AttentionMetadata
from nvray.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nvray.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nvray.layers.norm import RMSNorm
from nvray.layers.pp import is_first_stage, is_last_stage, pp_size, stage_layers
from nvray.layers.tp import PartialSum, end_forward, finish
from nvray.layers.rotary import get_rope, rope_max_positions, rope_spec_of
from nvray.quantization import Fp8Config

_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")

PACKED_QKV_GATE_UP = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def quant_for(quant: Fp8Config | None, prefix: str, parts: list[str]) -> Fp8Config | None:
    """The layer fusing checkpoint modules ``prefix.<part>``: quantized or not."""
    return quant.for_modules([f"{prefix}.{p}" for p in parts]) if quant is not None else None


def head_dim_of(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def layer_types_of(cfg: Any) -> list[str | None]:
    """Each layer's kind: ``layer_types`` where the config has them, else full attention
    everywhere (a ``sliding_window`` that every layer uses: Mistral's)."""
    types = getattr(cfg, "layer_types", None)
    return list(types) if types else [None] * cfg.num_hidden_layers


def sliding_window_of(cfg: Any, layer_type: str | None) -> int | None:
    """The window of a layer, None for full attention."""
    if layer_type == "full_attention":
        return None
    if layer_type == "sliding_attention" or getattr(cfg, "use_sliding_window", True):
        return getattr(cfg, "sliding_window", None) or None
    return None


def check_hidden_act(cfg: Any, allowed: tuple[str, ...] = ("silu",)) -> str:
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
    if act not in allowed:
        raise ValueError(f"hidden_act={act!r} is not supported (supported: {list(allowed)})")
    return act


class DecoderAttention(nn.Module):
    """Self-attention of one layer: fused qkv projection, optional per-head q/k norms, rotary
    (the layer type's rope), paged attention (windowed where the layer is), output projection."""

    def __init__(self, cfg: Any, quant: Fp8Config | None, prefix: str, *, qk_norm: bool,
                 qkv_bias: bool, layer_type: str | None = None, scale: float | None = None,
                 norm_class: type[RMSNorm] = RMSNorm, input_size: int | None = None) -> None:
        """(``input_size``: the width q, k and v are projected from, if not ``hidden_size``.)"""
        super().__init__()
        head_dim = head_dim_of(cfg)
        self.qkv_proj = QKVParallelLinear(input_size or cfg.hidden_size, head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=qkv_bias,
                                          quant=quant_for(quant, prefix, ["q_proj", "k_proj", "v_proj"]))
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * head_dim, cfg.hidden_size,
                                        bias=False, quant=quant_for(quant, prefix, ["o_proj"]))
        reach = rope_max_positions(cfg, layer_types_of(cfg))
        self.rotary_emb = get_rope(head_dim, reach, rope_spec_of(cfg, layer_type))
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim,
                              head_dim ** -0.5 if scale is None else scale,
                              sliding_window=sliding_window_of(cfg, layer_type))
        self.q_norm = norm_class(head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = norm_class(head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.fused_prologue: Callable[..., torch.Tensor] | None = None  # use_triton_kernels()

    def use_triton_kernels(self) -> None:
        """q/k norms, rotary and the KV-cache store as one Triton kernel
        (``kernels/qk_norm_rope.py``), GPU only; it rotates whole heads."""
        from kernels import qk_norm_rope_store  # noqa: PLC0415

        if not self.rotary_emb.is_partial:
            self.fused_prologue = qk_norm_rope_store

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata
                ) -> torch.Tensor | PartialSum:
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        if self.fused_prologue is not None:  # k and v go straight into the cache
            norms = (self.q_norm, self.k_norm) if self.q_norm is not None else None
            q = self.fused_prologue(
                qkv, positions, self.rotary_emb.cos_sin, self.num_heads, self.num_kv_heads,
                norms[0].weight if norms else None, norms[1].weight if norms else None,
                norms[0].eps if norms else 0.0, self.attn.k_cache, self.attn.v_cache,
                self.attn.meta_of(meta).slot_mapping)
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


class GatedMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with gate and up fused."""

    def __init__(self, cfg: Any, quant: Fp8Config | None, prefix: str,
                 intermediate_size: int | None = None, bias: bool = False) -> None:
        super().__init__()
        check_hidden_act(cfg)
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [inter] * 2, bias=bias,
            quant=quant_for(quant, prefix, ["gate_proj", "up_proj"]))
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias=bias,
                                           quant=quant_for(quant, prefix, ["down_proj"]))
        self.act_fn = SiluAndMul(quantize_for=self.down_proj.quant_method)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata | None = None
                ) -> torch.Tensor | PartialSum:
        """(``meta``: the step's, which a dense MLP does not need; an MoE block's does.)"""
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


def _first_quant_method(module: nn.Module) -> Any:
    """The quant method of the projection a norm feeds (None: not FP8, or not one layer)."""
    proj = getattr(module, "qkv_proj", None) or getattr(module, "gate_up_proj", None)
    return getattr(proj, "quant_method", None)


class DecoderLayer(nn.Module):
    """``x + attn(norm(x))``, then ``x + mlp(norm(x))``, with the residual add fused into
    each norm."""

    def __init__(self, attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.self_attn, self.mlp = attn, mlp
        # with FP8 projections, the norms' kernels quantize their outputs for them (GPU)
        self.input_layernorm = RMSNorm(hidden_size, eps, quantize_for=_first_quant_method(attn))
        self.post_attention_layernorm = RMSNorm(hidden_size, eps,
                                                quantize_for=_first_quant_method(mlp))
        self.aux_capture: Any = None  # an EAGLE-3 drafter's AuxCapture (models/eagle3.py) ...
        self.aux_index = -1  # ... and this layer's index for it

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        if self.aux_capture is not None:  # the stream entering this layer, for EAGLE-3
            self.aux_capture.take(self.aux_index, residual, meta.slot_mapping)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x, meta), residual


class StageLayers(nn.Module):
    """The decoder layers of one pipeline stage, in order, each named by its index in the
    whole model (all of them without pipeline parallelism)."""

    def __init__(self, layers: dict[int, nn.Module]) -> None:
        super().__init__()
        self.indices = range(min(layers), max(layers) + 1)
        for index, layer in layers.items():
            self.add_module(str(index), layer)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, index: int) -> nn.Module:
        """The layer of index ``index`` in the whole model (negative: from this stage's end);
        an IndexError names the stage's layers where another stage holds it."""
        if index < 0:
            return list(self._modules.values())[index]
        if index not in self.indices:
            raise IndexError(f"layer {index} is not on this pipeline stage (it holds layers "
                             f"{self.indices.start}..{self.indices.stop - 1})")
        return self._modules[str(index)]


class DecoderModel(nn.Module):
    """Embeddings, the layers (each returns its output and the residual, added in the next
    norm), the final norm. A family may scale the embeddings (``embed``) or use its own norm."""

    def __init__(self, cfg: Any, make_layer: Callable[[int, str], nn.Module],
                 norm_class: type[RMSNorm] = RMSNorm) -> None:
        super().__init__()
        self.embed_tokens = (VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
                             if is_first_stage() else None)
        self.layers = StageLayers({i: make_layer(i, f"model.layers.{i}")
                                   for i in stage_layers(cfg.num_hidden_layers)})
        self.norm = norm_class(cfg.hidden_size, cfg.rms_norm_eps) if is_last_stage() else None
        self.stage_input: torch.Tensor | None = None  # [tokens, 2, hidden], a later stage's
        self.final_capture: Any = None  # a Qwen3.5 MTP drafter's FinalCapture (qwen3_5_mtp.py)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        if self.embed_tokens is not None:
            x, residual = self.embed(input_ids), None
        else:  # the previous stage's output
            assert self.stage_input is not None, "a later pipeline stage reads stage_input"
            received = self.stage_input[:positions.shape[0]]
            x, residual = received[:, 0].contiguous(), received[:, 1].contiguous()
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        if self.norm is None:  # for the next stage
            out = torch.stack([finish(x), residual], dim=1)
        else:
            out, _ = self.norm(x, residual)
            if self.final_capture is not None:  # the final hidden states, for an MTP head
                self.final_capture.take(out, meta.slot_mapping)
        end_forward()  # the fused all-reduces' bookkeeping (layers/tp.py)
        return out


class CausalLM(nn.Module):
    """A decoder and its (possibly tied) LM head. Subclasses set the family's switches and may
    replace ``make_mlp`` (the MoE families) or ``make_layer``."""

    qk_norm = False
    qkv_bias: bool | None = None  # None: the config's attention_bias
    packed_modules_mapping = PACKED_QKV_GATE_UP

    def __init__(self, cfg: Any, quant: Fp8Config | None = None) -> None:
        super().__init__()
        self.cfg, self.quant = cfg, quant
        self.layer_types = layer_types_of(cfg)
        self.model = self.make_model(cfg)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size) if is_last_stage() else None
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if self.tie_word_embeddings and self.lm_head is not None and is_first_stage():
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_model(self, cfg: Any) -> nn.Module:
        return DecoderModel(cfg, self.make_layer)

    def make_attention(self, index: int, prefix: str) -> nn.Module:
        bias = self.qkv_bias if self.qkv_bias is not None else bool(getattr(self.cfg, "attention_bias", False))
        return DecoderAttention(self.cfg, self.quant, f"{prefix}.self_attn", qk_norm=self.qk_norm,
                                qkv_bias=bias, layer_type=self.layer_types[index])

    def make_mlp(self, index: int, prefix: str) -> nn.Module:
        return GatedMLP(self.cfg, self.quant, f"{prefix}.mlp",
                        bias=bool(getattr(self.cfg, "mlp_bias", False)))

    def make_layer(self, index: int, prefix: str) -> nn.Module:
        return DecoderLayer(self.make_attention(index, prefix), self.make_mlp(index, prefix),
                            self.cfg.hidden_size, self.cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

    def stage_tensor_name(self, name: str) -> str | None:
        """The parameter a checkpoint tensor loads into on this pipeline stage (None: another
        stage holds it); a tied LM head on a last stage that is not the first loads the
        embeddings' tensor."""
        if pp_size() == 1:
            return name
        layer = _LAYER_INDEX.match(name)
        if layer is not None:
            return name if int(layer.group(1)) in self.model.layers.indices else None
        if name.startswith("model.embed_tokens."):
            if self.model.embed_tokens is not None:
                return name
            tied_head = self.tie_word_embeddings and self.lm_head is not None
            return "lm_head." + name.removeprefix("model.embed_tokens.") if tied_head else None
        if name.startswith("model.norm."):
            return name if self.model.norm is not None else None
        if name.startswith("lm_head."):
            return name if self.lm_head is not None else None
        return name

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
