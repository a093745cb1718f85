"""Tensor-parallel linear layers; each parameter carries a ``weight_loader`` that shards a full
checkpoint tensor onto this rank.

- ColumnParallelLinear: output features split across ranks (no communication).
- MergedColumnParallelLinear: several column layers fused (gate_proj + up_proj).
- QKVParallelLinear: q, k, v fused; heads split across ranks, KV heads replicated when there are
  fewer KV heads than ranks.
- RowParallelLinear: input features split; outputs summed over the ranks by the norm they feed
  (a ``tp.PartialSum``; with a bias, by an all-reduce here).
- ReplicatedLinear: the whole layer on every rank (a small projection, e.g. EAGLE-3's ``fc``).

With multi-LoRA (``nvray/lora``) a projection's ``lora`` holds its adapter slots, and its output
gets each token's adapter delta (a row-parallel one adds it to its rank's partial sum, before the
reduction). Every layer takes an optional ``Fp8Config`` (``nvray/quantization``): its weight is then FP8
with a scale tensor beside it, and the loaders shard the scale along the same axis as the
weight, in units of the scale's ``shard_unit`` (the weight rows / columns one entry covers).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nvray.layers.tp import PartialSum, all_reduce, divide, tp_rank, tp_size
from nvray.quantization import Fp8Config, Fp8LinearMethod


def _check_shape(param: nn.Parameter, loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(loaded.shape) != expected:
        raise ValueError(f"expected shape {expected}, checkpoint has {tuple(loaded.shape)}")


def _units(param: nn.Parameter, dim: int, n: int) -> int:
    """Entries of ``param`` along ``dim`` that ``n`` weight rows (0) / columns (1) take."""
    unit = getattr(param, "shard_unit", (1, 1))[dim] if param.dim() == 2 else 1
    return -(-n // unit)


def _split_along_inputs(param: nn.Parameter) -> bool:
    """Whether a row-parallel layer splits this parameter's columns (a bias or a per-channel
    scale covers whole rows)."""
    return param.dim() == 2 and getattr(param, "shard_unit", (1, 1))[1] is not None


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool,
                 quant: Fp8Config | None = None) -> None:
        super().__init__()
        self.quant_method = Fp8LinearMethod(quant) if quant is not None else None
        if self.quant_method is None:
            self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        else:
            self.quant_method.create_weights(self, in_features, out_features)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
            param.quant_method = self.quant_method  # type: ignore[attr-defined]
        self.lora: Any = None  # its LoRAWeights (nvray/lora/weights.py) when adapters are on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._project(x, self.bias)

    def _project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self._matmul(x, bias)
        return y if self.lora is None else self.lora.add(x, y)

    def use_triton_kernels(self) -> None:
        """FP8 layers take their CUDA kernels (GPU only; the model runner calls this)."""
        if self.quant_method is not None:
            self.quant_method.use_triton_kernels()

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, bias)
        return F.linear(x, self.weight, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *args: object) -> None:
        raise NotImplementedError


class ColumnParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 quant: Fp8Config | None = None) -> None:
        self.full_out = out_features
        local = divide(out_features, tp_size(), "output features")
        if quant is not None and tp_size() > 1:
            quant.check_shard("output features per rank", local, 0)
        super().__init__(in_features, local, bias, quant)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *args: object) -> None:
        shard = param.shape[0]
        _check_shape(param, loaded, (_units(param, 0, self.full_out), *param.shape[1:]))
        param.data.copy_(loaded.narrow(0, tp_rank() * shard, shard))


class ReplicatedLinear(LinearBase):
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *args: object) -> None:
        _check_shape(param, loaded, tuple(param.shape))
        param.data.copy_(loaded)


class MergedColumnParallelLinear(LinearBase):
    """Fused column layers; ``shard_id`` picks which of ``output_sizes`` a tensor fills."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 quant: Fp8Config | None = None) -> None:
        self.output_sizes = output_sizes
        local = [divide(n, tp_size(), "output features") for n in output_sizes]
        if quant is not None:
            for n in local:
                quant.check_shard("a fused part's output features per rank", n, 0)
        self.offsets = [sum(local[:i]) for i in range(len(local))]
        self.local_sizes = local
        super().__init__(in_features, sum(local), bias, quant)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *args: object) -> None:
        shard_id = int(args[0])  # type: ignore[arg-type]
        size = _units(param, 0, self.local_sizes[shard_id])
        offset = _units(param, 0, self.offsets[shard_id])
        _check_shape(param, loaded, (_units(param, 0, self.output_sizes[shard_id]), *param.shape[1:]))
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, tp_rank() * size, size))


class QKVParallelLinear(LinearBase):
    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, quant: Fp8Config | None = None) -> None:
        world = tp_size()
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.num_heads = divide(num_heads, world, "num_attention_heads")
        if num_kv_heads >= world:
            self.num_kv_heads = divide(num_kv_heads, world, "num_key_value_heads")
        else:
            divide(world, num_kv_heads, "tensor_parallel_size / num_key_value_heads")
            self.num_kv_heads = 1  # each KV head replicated on world // num_kv_heads ranks
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        if quant is not None:
            for part, n in (("q", self.num_heads * head_dim), ("k/v", self.num_kv_heads * head_dim)):
                quant.check_shard(f"{part} output features per rank", n, 0)
        super().__init__(hidden_size, out, bias, quant)

    def _kv_head_start(self) -> int:
        if self.total_num_kv_heads >= tp_size():
            return tp_rank() * self.num_kv_heads
        return tp_rank() * self.total_num_kv_heads // tp_size()

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *args: object) -> None:
        shard_id = str(args[0])
        d = self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            full, size, offset, start = self.total_num_heads * d, q_size, 0, tp_rank() * q_size
        else:
            full, size = self.total_num_kv_heads * d, kv_size
            offset = q_size if shard_id == "k" else q_size + kv_size
            start = self._kv_head_start() * d
        full, size, offset, start = (_units(param, 0, n) for n in (full, size, offset, start))
        _check_shape(param, loaded, (full, *param.shape[1:]))
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, start, size))


class RowParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 quant: Fp8Config | None = None) -> None:
        self.full_in = in_features
        super().__init__(divide(in_features, tp_size(), "input features"), out_features, bias,
                         quant)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *args: object) -> None:
        if not _split_along_inputs(param):  # bias (added once after the reduce), channel scale
            _check_shape(param, loaded, tuple(param.shape))
            param.data.copy_(loaded)
            return
        shard = param.shape[1]
        _check_shape(param, loaded, (param.shape[0], _units(param, 1, self.full_in)))
        param.data.copy_(loaded.narrow(1, tp_rank() * shard, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor | PartialSum:
        """The rank's partial sum, for the norm it feeds to finish (``tp.PartialSum``); the
        sum itself with a bias (added once, after it) or on one rank."""
        y = self._project(x, None)
        if self.bias is None and tp_size() > 1:
            return PartialSum(y)
        y = all_reduce(y)
        return y + self.bias if self.bias is not None else y
