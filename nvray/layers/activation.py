"""SiluAndMul: the gated activation of Qwen's MLP on a fused [gate | up] tensor."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2*I] -> [T, I]
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
