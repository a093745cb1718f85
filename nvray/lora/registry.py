"""LoRARegistry (driver): the adapters requests named, each checked once against the model.

``resolve(lora_request)`` turns a request's ``LoRARequest`` into the checked ``LoRAAdapter`` the
engine schedules by (``adapter.inspect_adapter``: config, tensor shapes against the ranks'
``targets``, rank against ``max_lora_rank``), or raises ``ValueError`` with the reason, so an
adapter nvray cannot serve is refused when it is named, never mid-step. An adapter whose
weights file changed since (a retrained adapter written over the old one) is checked again and
is a new adapter: a new version in its key, new slots and images on the ranks, a new
prefix-cache salt.
"""

from __future__ import annotations

import os

from nvray.lora.adapter import LoRAAdapter, inspect_adapter, weights_version
from nvray.lora.request import LoRARequest


class LoRARegistry:
    def __init__(self, enabled: bool, targets: dict[str, tuple[int, int]],
                 max_lora_rank: int) -> None:
        self.enabled = enabled
        self.targets = targets
        self.max_lora_rank = max_lora_rank
        self.adapters: dict[tuple[str, str], LoRAAdapter] = {}

    def resolve(self, request: LoRARequest | None) -> LoRAAdapter | None:
        if request is None:
            return None
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        if not self.enabled:
            raise ValueError(f"LoRA adapter {request.lora_name!r} was requested, but this engine "
                             "serves no adapters (start it with enable_lora=True)")
        if not self.targets:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: this model has no projection "
                             "nvray can adapt")
        key = (request.lora_name, os.path.realpath(request.lora_path))
        adapter = self.adapters.get(key)
        if adapter is None or adapter.version != weights_version(key[1]):
            adapter = inspect_adapter(request.lora_name, request.lora_path, self.targets,
                                      self.max_lora_rank)
            self.adapters[key] = adapter
        return adapter
