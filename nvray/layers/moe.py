"""A sparse Mixture-of-Experts MLP (Qwen3-MoE's): a router picks each token's top-k experts and
the token's output is the routing-weighted sum of those experts' SwiGLU MLPs.

``FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize)`` holds every
expert's weights stacked: ``w13_weight`` ``[E, 2 * I_local, H]`` (each expert's gate rows, then
its up rows) and ``w2_weight`` ``[E, H, I_local]``. Tensor parallelism shards every expert along
its intermediate dimension (``I_local = I / tp``) and returns its share of the output for the
next norm to sum over the ranks (``tp.PartialSum``), as the dense MLP does. Expert parallelism (``tp.expert_parallel()``, ``enable_expert_parallel``) instead gives each
rank ``E / tp`` whole experts (``E_local``, from ``first_expert`` on): every rank routes every
token, computes the pairs whose expert it holds (the others' ids become -1, which the experts
skip) and the same sum over the ranks adds the parts up. Checkpoints store experts one by one (``mlp.experts.<e>.gate_proj.weight``, ...): the
loader routes each to ``weight_loader(param, tensor, (expert, proj))``; ``expected_shards`` on
each parameter tells it which it must see.

FP8 (an ``Fp8Config``): e4m3 weights with block scales beside them (``w13_<scale_name>``
``[E, 2 * I_local / bn, H / bk]``, ``w2_<scale_name>`` ``[E, H / bn, I_local / bk]``), from a
block-scaled checkpoint (Qwen3-30B-A3B-FP8's 128x128) or quantized in 128x128 blocks as a
16/32-bit checkpoint loads (``quantization="fp8"``); the kernel upcasts each weight tile.

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

from nvray.layers.tp import PartialSum, divide, expert_parallel, tp_rank, tp_size
from nvray.quantization import Fp8Config
from nvray.quantization.fp8_math import FP8_DTYPE, dequantize, quantize_per_block

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
                    weights: torch.Tensor, ids: torch.Tensor, *,
                    w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                    block_shape: tuple[int, int] | None = None,
                    skips_pairs: bool = True) -> torch.Tensor:
    """The experts' weighted sum, one expert at a time (the CPU path and the reference); FP8
    experts (``w13_scale``/``w2_scale`` per ``block_shape``) dequantized as they are used; a
    pair whose id is outside ``[0, E)`` (another rank's expert) is skipped, whatever
    ``skips_pairs`` says (the kernel's flag, taken so that either runs the experts)."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    num_experts = w13.shape[0]
    flat_ids = ids.flatten().long()
    flat_ids = torch.where((flat_ids >= 0) & (flat_ids < num_experts), flat_ids, num_experts)
    order = torch.argsort(flat_ids, stable=True)  # skipped pairs last
    counts = torch.bincount(flat_ids, minlength=num_experts + 1)[:num_experts].tolist()
    tokens = order // ids.shape[1]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = order[start:start + count]
        tok = tokens[start:start + count]
        start += count
        e13, e2 = w13[expert], w2[expert]
        if w13_scale is not None:
            e13 = dequantize(e13, w13_scale[expert], block_shape, x.dtype)
            e2 = dequantize(e2, w2_scale[expert], block_shape, x.dtype)
        gate, up = F.linear(x[tok], e13).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, e2)
        out.index_add_(0, tok, y.float() * weights.flatten()[rows].float().unsqueeze(1))
    return out.to(x.dtype)


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, quant: Fp8Config | None = None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size = intermediate_size
        self.expert_parallel = ep = expert_parallel()  # whole experts per rank, counting load
        self.local_experts = divide(num_experts, tp_size(), "num_experts") if ep else num_experts
        self.first_expert = tp_rank() * self.local_experts if ep else 0
        self.width_rank = 0 if ep else tp_rank()  # whole experts: no slice of their width
        self.local_inter = intermediate_size if ep else divide(intermediate_size, tp_size(),
                                                               "moe_intermediate_size")
        # FP8: 128x128 blocks when quantized at load (the kernel's block-scaled path)
        self.block = (quant.block or (128, 128)) if quant is not None else None
        self.on_the_fly = quant is not None and quant.quantize_on_load
        dtype = FP8_DTYPE if quant is not None else None
        self.w13_weight = self._param(self.local_experts, 2 * self.local_inter, hidden_size, dtype)
        self.w2_weight = self._param(self.local_experts, hidden_size, self.local_inter, dtype)
        experts = range(self.first_expert, self.first_expert + self.local_experts)
        w13_shards = {(e, p) for e in experts for p in _PROJ_ROWS}
        w2_shards = {(e, "down_proj") for e in experts}
        self.w13_weight.expected_shards = w13_shards  # type: ignore[attr-defined]
        self.w2_weight.expected_shards = w2_shards  # type: ignore[attr-defined]
        self.scale_names: tuple[str, str] | None = None
        if quant is not None:
            self._create_scales(quant, hidden_size, set() if self.on_the_fly else w13_shards,
                                set() if self.on_the_fly else w2_shards)
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
            param.loads_any_dtype = self.on_the_fly  # type: ignore[attr-defined]
        self._experts: Callable[..., torch.Tensor] = moe_experts_ref
        # expert parallel: (token, expert) pairs each local expert computed (the last entry
        # takes the other ranks' pairs), real tokens only (``expert_load``)
        self.register_buffer("pairs_per_expert",
                             torch.zeros(self.local_experts + 1, dtype=torch.int64),
                             persistent=False)

    @staticmethod
    def _param(*shape: int | torch.dtype | None) -> nn.Parameter:
        *dims, dtype = shape
        return nn.Parameter(torch.empty(*dims, dtype=dtype), requires_grad=False)

    def _create_scales(self, quant: Fp8Config, hidden: int, w13_shards: set, w2_shards: set) -> None:
        """Block scales beside the FP8 weights, named as the checkpoint names them."""
        bn, bk = self.block
        if self.local_inter % bn or self.local_inter % bk:
            raise ValueError(f"moe_intermediate_size per rank of {self.local_inter} does not "
                             f"split into {bn}x{bk} FP8 weight blocks")
        e, cols = self.local_experts, -(-hidden // bk)
        w13 = self._param(e, 2 * self.local_inter // bn, cols, torch.float32)
        w2 = self._param(e, -(-hidden // bn), self.local_inter // bk, torch.float32)
        w13.expected_shards, w2.expected_shards = w13_shards, w2_shards  # type: ignore[attr-defined]
        self.scale_names = (f"w13_{quant.scale_name}", f"w2_{quant.scale_name}")
        self.register_parameter(self.scale_names[0], w13)
        self.register_parameter(self.scale_names[1], w2)

    def _scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.scale_names is None:
            return None, None
        return getattr(self, self.scale_names[0]), getattr(self, self.scale_names[1])

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *args: object) -> None:
        expert, proj = args[0]  # type: ignore[misc]
        expert -= self.first_expert  # its index among this rank's experts
        if not 0 <= expert < self.local_experts:
            return  # another rank's expert
        is_scale = param.dtype == torch.float32 and self.scale_names is not None
        if self.on_the_fly and not is_scale and loaded.dtype.itemsize > 1:
            q, scale = quantize_per_block(loaded.to(param.device), self.block)
            self._load_slice(param, q, expert, proj, (1, 1))
            w13_scale, w2_scale = self._scales()
            self._load_slice(w2_scale if proj == "down_proj" else w13_scale, scale, expert, proj,
                             self.block)
            return
        self._load_slice(param, loaded, expert, proj, self.block if is_scale else (1, 1))

    def _load_slice(self, param: nn.Parameter, loaded: torch.Tensor, expert: int, proj: str,
                    unit: tuple[int, int]) -> None:
        """This rank's slice of one expert's projection (a weight, or its scales in units of
        the blocks they cover)."""
        rows, cols = unit
        if proj == "down_proj":  # [H, I]: split the columns
            n = self.local_inter // cols
            expected = (param.shape[1], self.intermediate_size // cols)
            target, source = param.data[expert], loaded.narrow(1, n * self.width_rank, n)
        else:  # [I, H]: this projection's rows of w13, split
            n = self.local_inter // rows
            expected = (self.intermediate_size // rows, param.shape[2])
            target = param.data[expert].narrow(0, _PROJ_ROWS[proj] * n, n)
            source = loaded.narrow(0, n * self.width_rank, n)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"expected shape {expected}, checkpoint has {tuple(loaded.shape)}")
        target.copy_(source)

    def _count_pairs(self, local_ids: torch.Tensor, real_tokens: torch.Tensor) -> None:
        """Add each local expert's pairs of real tokens (-1, another rank's, counts last)."""
        slots = local_ids.remainder(self.local_experts + 1).flatten()
        counts = real_tokens.to(torch.int64).repeat_interleave(self.top_k)
        self.pairs_per_expert.index_add_(0, slots, counts)

    def reset_load(self) -> None:
        self.pairs_per_expert.zero_()

    def use_triton_kernels(self) -> None:
        """The fused Triton kernel for the experts (GPU only)."""
        from kernels import fused_moe  # noqa: PLC0415

        self._experts = fused_moe

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor,
                real_tokens: torch.Tensor | None = None) -> torch.Tensor | PartialSum:
        """The experts' weighted sum: the rank's share of it (``tp.PartialSum``, for the norm
        it feeds to finish) when the experts are split over ranks. ``real_tokens``: [T] bool,
        the rows that are tokens (not a CUDA graph's padding), whose pairs an expert-parallel
        rank counts (``expert_load``)."""
        weights, ids = route(router_logits, self.top_k, self.renormalize, x.dtype)
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        if self.expert_parallel:  # this rank's pairs only
            ids = ids - self.first_expert
            ids = torch.where((ids >= 0) & (ids < self.local_experts), ids, -1)
            if real_tokens is not None:
                self._count_pairs(ids, real_tokens)
        w13_scale, w2_scale = self._scales()
        scales = {} if w13_scale is None else {"w13_scale": w13_scale, "w2_scale": w2_scale,
                                               "block_shape": self.block}
        out = self._experts(x, self.w13_weight, self.w2_weight, weights.float(), ids,
                            skips_pairs=self.expert_parallel, **scales)
        return PartialSum(out) if tp_size() > 1 else out


def _expert_parallel_layers(model: nn.Module) -> list[FusedMoE]:
    return [m for m in model.modules() if isinstance(m, FusedMoE) and m.expert_parallel]


def expert_load(model: nn.Module) -> list[int]:
    """Expert parallel: the (token, expert) pairs each of this rank's experts computed since
    the last reset, summed over the model's layers (empty without expert parallelism)."""
    layers = _expert_parallel_layers(model)
    if not layers:
        return []
    return torch.stack([m.pairs_per_expert[:m.local_experts] for m in layers]).sum(0).tolist()


def reset_expert_load(model: nn.Module) -> None:
    for m in _expert_parallel_layers(model):
        m.reset_load()
