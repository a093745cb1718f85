"""Multi-LoRA: many PEFT adapters on one base model, batched in the same step.

- ``request.py``: ``LoRARequest``, how a caller names an adapter (vLLM's fields).
- ``adapter.py``: the PEFT format on disk (``adapter_config.json`` + ``adapter_model.safetensors``),
  read, checked against the model's projections and scaled (``lora_alpha / r``, rsLoRA
  ``lora_alpha / sqrt(r)``); the driver checks an adapter when a request names it, the ranks
  read its tensors when it gets a GPU slot.
- ``registry.py`` (driver): the adapters requests named, checked once, each with its prefix-cache
  salt; ``slots.py`` (driver): which adapter each of the ``max_loras`` GPU slots holds.
- ``weights.py``, ``batch.py``, ``model.py`` (ranks): each target projection's stacked A/B
  slots, the step's token -> slot map, and the model-wide view that loads an adapter into a slot.
- ``ops.py``: the batched delta ``y += (x @ A[slot].T) @ B[slot].T`` per token: torch on the
  CPU, Triton shrink/expand kernels (``kernels/lora.py``) on the GPU.

docs/lora.md tells the whole story.
"""

from nvray.lora.request import LoRARequest

__all__ = ["LoRARequest"]
