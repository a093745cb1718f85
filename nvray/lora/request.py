"""LoRARequest: the adapter a request runs with (vLLM's ``LoRARequest`` fields).

``lora_name`` names the adapter (what ``/v1/models`` lists and an HTTP request's ``model``
picks); ``lora_path`` is its PEFT directory on local disk; ``lora_int_id`` is kept for vLLM
callers and otherwise unused (nvray keys adapters by name and path).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name={self.lora_name!r} is invalid: a non-empty string")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path is required (the "
                             "adapter's PEFT directory on local disk)")
