"""LoRAModel: a rank's adapter slots over the whole model, and the adapters it has read.

``LoRAModel(model, max_loras, max_lora_rank, max_cpu_loras, capacity, device)`` gives every
adaptable projection (``LinearBase.lora``) its ``LoRAWeights``: the plain column-, row-, q/k/v-
and gate/up-fused projections of the layers (not the experts of a MoE layer, not the
embeddings or the LM head). Each is known by the checkpoint names of the modules it fuses
(``model.layers.0.self_attn.q_proj``: through the model's ``packed_modules_mapping``), which is
how PEFT names them; ``targets()`` lists them with their full (in, out) features, for the driver
to check adapters against (``adapter.inspect_adapter``).

``load(slot, adapter)`` puts an adapter into a slot: its tensors as the file holds them (one
pinned host buffer an adapter, kept for an LRU of ``max_cpu_loras`` adapters and otherwise read
from the adapter's files) are copied to the device and there cut to this rank's shard, scaled
and written into the slot (``LoRAWeights.write``): queued on the step's stream, after the steps
launched before (which may still read the slot's old adapter) and before the step that names
it. ``batch`` is
the step's token -> slot map the projections read.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from nvray.layers.linear import (ColumnParallelLinear, LinearBase, MergedColumnParallelLinear,
                                 QKVParallelLinear, RowParallelLinear)
from nvray.lora.adapter import LoRAAdapter, read_adapter_weights
from nvray.lora.batch import LoRABatch
from nvray.lora.weights import LoRAWeights, full_shape, slice_ids

_ADAPTABLE = (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
              RowParallelLinear)


def _module_names(model: nn.Module, path: str, layer: LinearBase) -> list[str] | None:
    """The checkpoint module of each fused part of the projection at ``path``."""
    parent, _, leaf = path.rpartition(".")
    ids = slice_ids(layer)
    if ids == [None]:
        return [path]
    packed = getattr(model, "packed_modules_mapping", {})
    by_id = {shard: name for name, (fused, shard) in packed.items() if fused == leaf}
    if set(by_id) != set(ids):
        return None
    return [f"{parent}.{by_id[i]}" for i in ids]


class LoRAModel:
    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int, capacity: int, device: torch.device) -> None:
        self.batch = LoRABatch(max_loras, capacity, device)
        self.max_cpu_loras = max_cpu_loras
        self.layers: list[tuple[LoRAWeights, list[str]]] = []
        self._targets: dict[str, tuple[int, int]] = {}
        for path, module in model.named_modules():
            if type(module) not in _ADAPTABLE:
                continue
            names = _module_names(model, path, module)
            if names is None:
                continue
            weights = LoRAWeights(module, max_loras, max_lora_rank, self.batch)
            module.lora = weights
            self.layers.append((weights, names))
            for name, shard_id in zip(names, slice_ids(module)):
                self._targets[name] = full_shape(module, shard_id)
        self.pin = device.type == "cuda"
        self.cpu_cache: OrderedDict[tuple[str, str, int], dict[str, Any]] = OrderedDict()
        self.num_disk_loads = 0

    def targets(self) -> dict[str, tuple[int, int]]:
        return dict(self._targets)

    def begin_step(self, step: Any) -> None:
        """Put the step's new adapters into their slots (before its forward)."""
        for slot, adapter in step.lora_loads:
            self.load(slot, adapter)

    def prepare_step(self, step: Any, verify_q: int) -> None:
        """The step's token -> slot map; ``verify_q`` > 0: its forward is a verification graph
        of that many rows a sequence (tokens first, then padding)."""
        seqs = step.seqs
        slots = [s.lora_slot for s in seqs for _ in range(len(s.token_ids))]
        rows = ([i * verify_q + j for i, s in enumerate(seqs) for j in range(len(s.token_ids))]
                if verify_q else None)
        self.batch.prepare(slots, rows)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        weights = self._host_weights(adapter)
        for layer, names in self.layers:
            layer.write(slot, {part: weights[name] for part, name in enumerate(names)
                               if name in weights})

    def _host_weights(self, adapter: LoRAAdapter) -> dict[str, Any]:
        """``adapter``'s tensors in host memory (``read_adapter_weights``), from the LRU or
        read from its files."""
        weights = self.cpu_cache.pop(adapter.key, None)
        if weights is None:
            weights = read_adapter_weights(adapter, pin=self.pin)
            self.num_disk_loads += 1
        self.cpu_cache[adapter.key] = weights
        while len(self.cpu_cache) > self.max_cpu_loras:
            self.cpu_cache.popitem(last=False)
        return weights
