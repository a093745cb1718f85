"""ModelFacts: what the loaded model is, as its ranks found it.

A fact is found once, on the ranks (``worker/rank_facts.rank_facts``, rank 0's answer), and travels
whole: the executor holds it (``Executor.facts``), the engine keeps it in its limits
(``ModelLimits``, which adds the KV cache's size and the EOS ids), and the driver's start-up
info, with ``/v1/models`` and the replica's ready line, read it from there
(``as_info()``). A new fact is one field here and the line of ``rank_facts``
that finds it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelFacts:
    max_model_len: int  # prompt + output tokens a sequence may reach
    vocab_size: int
    architecture: str = ""  # config.json's architectures[0], e.g. "LlamaForCausalLM"
    dtypes: dict[str, str] = field(default_factory=dict)  # weights / compute / KV cache, in words
    kv_group_windows: tuple[int | None, ...] = (None,)  # per block-table group (kv_layout.py)
    num_state_slots: int = 0  # recurrent-state slots every rank holds (0: no recurrent layers)
    # how the ranks split the model: tensor/pipeline_parallel_size, expert_parallel, all_reduce
    parallelism: dict[str, Any] = field(default_factory=dict)
    # multi-LoRA: the projections adapters may adapt, checkpoint module -> full (in, out)
    lora_targets: dict[str, tuple[int, int]] = field(default_factory=dict)

    def as_info(self) -> dict[str, Any]:
        """Every fact by name (what the driver reports at start-up)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(ModelFacts)}
