"""Rotary position embedding (NeoX style) with a precomputed cos/sin cache, and the rope
settings of a checkpoint's config.

``rope_spec_of(cfg, layer_type)`` reads what a config says about rope for one kind of layer
(``rope_parameters`` — flat, or nested by layer type as Gemma 3's — or the older
``rope_scaling`` + ``rope_theta`` + ``rope_local_base_freq``) into a ``RopeSpec``. Types:
``default``, ``linear``, ``llama3`` and ``yarn``, each with the inverse frequencies and
attention factor transformers computes for it (``modeling_rope_utils``); ``partial_rotary_factor``
rotates only the first part of each head. Any other type is a ValueError naming it.
``rope_max_positions(cfg)`` is how far the config's rope reaches: ``max_position_embeddings``,
or with YaRN ``factor * original_max_position_embeddings`` where that is further (YaRN on a
stock Qwen3: 4 x 32,768). Llama 3's and linear scaling's configs state their extended length in
``max_position_embeddings`` already (Llama 3.1: 131,072; Gemma 3: 131,072).

``get_rope(head_dim, max_position, spec)`` returns one ``RotaryEmbedding`` per distinct
argument set on the current default device: the layers of a model share its cos/sin cache (one
``[max_position, rotary_dim]`` float32 table, not one per layer). ``enable_torch_compile()``
(called by the model runner on the GPU) runs the gather and rotation of q and k as
``torch.compile``d kernels instead of ~20 small ones per layer.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nvray.layers.compiled import compiled

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_DEFAULT_THETA = 10000.0


@dataclass(frozen=True)
class RopeSpec:
    """One layer kind's rope: base, rotated dims, type and that type's parameters."""

    theta: float
    rotary_dim: int
    rope_type: str = "default"
    params: tuple[tuple[str, Any], ...] = ()  # the scaling keys, sorted (hashable)

    def param(self, name: str, default: Any = None) -> Any:
        return dict(self.params).get(name, default)


def _is_nested(params: dict[str, Any]) -> bool:
    """Rope parameters keyed by layer type (``{"full_attention": {...}, ...}``)."""
    return bool(params) and all(isinstance(v, dict) or v is None for v in params.values())


def _rope_dict(cfg: Any, layer_type: str | None) -> dict[str, Any]:
    """The rope keys that apply to ``layer_type`` (None: the model's only kind of layer)."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    scaling = dict(getattr(cfg, "rope_scaling", None) or {})
    if _is_nested(params):
        kind = layer_type or "full_attention"
        if kind not in params:
            raise ValueError(f"rope_parameters has no entry for {kind!r} layers "
                             f"(it has {sorted(params)})")
        return dict(params[kind] or {})
    local = layer_type == "sliding_attention"
    merged = {**params, **({} if local else scaling)}  # old Gemma 3: scaling is the global layers'
    if "rope_theta" not in merged or merged["rope_theta"] is None:
        local_base = getattr(cfg, "rope_local_base_freq", None) if local else None
        merged["rope_theta"] = local_base or getattr(cfg, "rope_theta", None) or _DEFAULT_THETA
    return merged


def rope_spec_of(cfg: Any, layer_type: str | None = None) -> RopeSpec:
    """The rope of ``layer_type`` layers of a model config; an unknown type is a ValueError."""
    d = _rope_dict(cfg, layer_type)
    kind = d.get("rope_type") or d.get("type") or "default"
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_type={kind!r} is not supported (supported: {list(ROPE_TYPES)})")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    partial = d.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None)) or 1.0
    rotary_dim = int(head_dim * partial)
    if kind != "default" and d.get("factor") is None:
        raise ValueError(f"rope_type={kind!r} needs a 'factor'")
    if kind == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            if d.get(key) is None:
                raise ValueError(f"rope_type='llama3' needs {key!r}")
    if kind in ("llama3", "yarn"):
        d.setdefault("original_max_position_embeddings", cfg.max_position_embeddings)
    # M-RoPE (Qwen3.5's checkpoints) gives text the same position in every section: plain rope
    keep = {k: v for k, v in d.items()
            if k not in ("rope_type", "type", "rope_theta", "partial_rotary_factor",
                         "mrope_section", "mrope_interleaved") and v is not None}
    return RopeSpec(float(d["rope_theta"]), rotary_dim, kind, tuple(sorted(keep.items())))


def rope_max_positions(cfg: Any, layer_types: list[str | None] | None = None) -> int:
    """How far the config's rope reaches (see the module docstring)."""
    reach = cfg.max_position_embeddings
    for layer_type in layer_types or [None]:
        spec = rope_spec_of(cfg, layer_type)
        original = spec.param("original_max_position_embeddings")
        factor = spec.param("factor")
        if spec.rope_type == "yarn" and original and factor:
            reach = max(reach, int(factor * original))
    return reach


def _yarn_factor(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(spec: RopeSpec, inv_freq: torch.Tensor) -> tuple[torch.Tensor, float]:
    dim, base = spec.rotary_dim, spec.theta
    original = spec.param("original_max_position_embeddings")
    factor = spec.param("factor")
    attention_factor = spec.param("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = spec.param("mscale"), spec.param("mscale_all_dim")
        attention_factor = (_yarn_factor(factor, mscale) / _yarn_factor(factor, mscale_all)
                            if mscale and mscale_all else _yarn_factor(factor))

    def dim_for(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_for(spec.param("beta_fast") or 32), dim_for(spec.param("beta_slow") or 1)
    if spec.param("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate (divide by factor)
    inv_freq = inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate
    return inv_freq, float(attention_factor)


def _llama3(spec: RopeSpec, inv_freq: torch.Tensor) -> torch.Tensor:
    factor, low, high = (spec.param(k) for k in ("factor", "low_freq_factor", "high_freq_factor"))
    original = spec.param("original_max_position_embeddings")
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, smoothed, scaled)


def inv_freq_of(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """(inverse frequencies ``[rotary_dim / 2]``, attention factor scaling cos and sin)."""
    dim = spec.rotary_dim
    inv_freq = 1.0 / (spec.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if spec.rope_type == "linear":
        return inv_freq / spec.param("factor"), 1.0
    if spec.rope_type == "llama3":
        return _llama3(spec, inv_freq), 1.0
    if spec.rope_type == "yarn":
        return _yarn(spec, inv_freq)
    return inv_freq, 1.0


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1] * 2
    x1, x2 = x[..., :rot].float().chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return rotated if rot == x.shape[-1] else torch.cat([rotated, x[..., rot:]], dim=-1)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # q: [T, H, D], k: [T, KVH, D], positions: [T], cos_sin: [max_position, rotary_dim]
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, spec: RopeSpec | float) -> None:
        super().__init__()
        if not isinstance(spec, RopeSpec):  # a bare base: default rope over the whole head
            spec = RopeSpec(float(spec), head_dim)
        self.spec, self.head_dim = spec, head_dim
        inv_freq, attention_factor = inv_freq_of(spec)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor
        self.register_buffer("cos_sin", cos_sin, persistent=False)  # [max_position, rotary_dim]
        self._apply_rotary = apply_rotary

    @property
    def is_partial(self) -> bool:
        """Rotates only part of each head (the fused Triton prologue rotates whole heads)."""
        return self.spec.rotary_dim != self.head_dim

    def enable_torch_compile(self) -> None:
        self._apply_rotary = compiled(apply_rotary)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._apply_rotary(positions, q, k, self.cos_sin)


# The tables models hold now: an entry lives as long as a model refers to it (no GPU memory is
# kept for an engine that has shut down)
_LIVE_ROPES: "weakref.WeakValueDictionary[tuple, RotaryEmbedding]" = weakref.WeakValueDictionary()


def get_rope(head_dim: int, max_position: int, spec: RopeSpec) -> RotaryEmbedding:
    """The ``RotaryEmbedding`` of these arguments on the default device, shared by every layer
    that asks for the same (a model's layers hold one cos/sin table, not one each)."""
    key = (head_dim, max_position, spec, str(torch.get_default_device()))
    rope = _LIVE_ROPES.get(key)
    if rope is None:
        rope = _LIVE_ROPES[key] = RotaryEmbedding(head_dim, max_position, spec)
    return rope


def rope_theta_of(hf_config: object) -> float:
    """The rope base of a config's (global) attention layers."""
    return rope_spec_of(hf_config).theta
