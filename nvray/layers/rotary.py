"""Rotary position embedding (NeoX style, as in Qwen) with a precomputed cos/sin cache.

``enable_torch_compile()`` (called by the model runner on the GPU) runs the gather and rotation
of q and k as ``torch.compile``d kernels instead of ~20 small ones per layer.
"""

from __future__ import annotations

import torch
from torch import nn

from nvray.layers.compiled import compiled


def rope_theta_of(hf_config: object) -> float:
    """rope_theta from an HF config, old layout (``rope_theta``) or new (``rope_parameters``)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    for cfg in (params, scaling):
        kind = cfg.get("rope_type", cfg.get("type", "default"))
        if kind not in ("default", None):
            raise ValueError(f"rope_type={kind!r} is not supported (only 'default')")
    theta = getattr(hf_config, "rope_theta", None) or params.get("rope_theta")
    if theta is None:
        raise ValueError("the model config has no rope_theta")
    return float(theta)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # q: [T, H, D], k: [T, KVH, D], positions: [T], cos_sin: [max_position, D]
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1),
                             persistent=False)  # [max_position, head_dim]
        self._apply_rotary = apply_rotary

    def enable_torch_compile(self) -> None:
        self._apply_rotary = compiled(apply_rotary)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._apply_rotary(positions, q, k, self.cos_sin)
