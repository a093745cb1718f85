"""A sparse Mixture-of-Experts MLP (Qwen3-MoE's): a router picks each token's top-k experts and
the token's output is the routing-weighted sum of those experts' SwiGLU MLPs.

``FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize)`` holds every
expert's weights stacked: ``w13_weight`` ``[E, 2 * I_local, H]`` (each expert's gate rows, then
its up rows) and ``w2_weight`` ``[E, H, I_local]``. Tensor parallelism shards every expert along
its intermediate dimension (``I_local = I / tp``) and all-reduces the output, as the dense MLP
does; expert parallelism (whole experts per rank) would replace ``weight_loader``'s slicing and the
reduce. Checkpoints store experts one by one (``mlp.experts.<e>.gate_proj.weight``, ...): the
loader routes each to ``weight_loader(param, tensor, (expert, proj))``; ``expected_shards`` on
each parameter tells it which it must see.

``forward(x, router_logits)``: routing as transformers computes it (softmax in float32, top-k,
renormalised when ``renormalize``, weights cast to x's dtype), then the experts: on the CPU a
loop over the experts that have tokens (``moe_experts_ref``), on the GPU (after
``use_triton_kernels()``) the fused Triton kernel ``kernels.fused_moe`` (tokens sorted by expert,
grouped GEMMs with the activation fused, the weighted combine), which has no host sync and is
captured in CUDA graphs.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nvray.layers.tp import all_reduce, divide, tp_rank, tp_size

_PROJ_ROWS = {"gate_proj": 0, "up_proj": 1}


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[T, k]`` in ``dtype``, expert ids ``[T, k]`` int32) of each token."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids.to(torch.int32)


def moe_experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The experts' weighted sum, one expert at a time (the CPU path and the reference)."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    flat_ids = ids.flatten().long()
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    tokens = order // ids.shape[1]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = order[start:start + count]
        tok = tokens[start:start + count]
        start += count
        gate, up = F.linear(x[tok], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, tok, y.float() * weights.flatten()[rows].float().unsqueeze(1))
    return out.to(x.dtype)


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size = intermediate_size
        self.local_inter = divide(intermediate_size, tp_size(), "moe_intermediate_size")
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * self.local_inter, hidden_size),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.local_inter),
                                      requires_grad=False)
        experts = range(num_experts)
        self.w13_weight.expected_shards = {(e, p) for e in experts for p in _PROJ_ROWS}  # type: ignore[attr-defined]
        self.w2_weight.expected_shards = {(e, "down_proj") for e in experts}  # type: ignore[attr-defined]
        for param in (self.w13_weight, self.w2_weight):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self._experts: Callable[..., torch.Tensor] = moe_experts_ref

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *args: object) -> None:
        expert, proj = args[0]  # type: ignore[misc]
        n, shard = self.local_inter, self.local_inter * tp_rank()
        if proj == "down_proj":
            expected = (param.shape[1], self.intermediate_size)
            target, source = param.data[expert], loaded.narrow(1, shard, n)
        else:
            expected = (self.intermediate_size, param.shape[2])
            target = param.data[expert].narrow(0, _PROJ_ROWS[proj] * n, n)
            source = loaded.narrow(0, shard, n)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"expected shape {expected}, checkpoint has {tuple(loaded.shape)}")
        target.copy_(source)

    def use_triton_kernels(self) -> None:
        """The fused Triton kernel for the experts (GPU only)."""
        from kernels import fused_moe  # noqa: PLC0415

        self._experts = fused_moe

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = route(router_logits, self.top_k, self.renormalize, x.dtype)
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        out = self._experts(x, self.w13_weight, self.w2_weight, weights.float(), ids)
        return all_reduce(out)
