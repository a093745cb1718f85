"""What a set-up rank found its model to be, as one ``ModelFacts`` (``nvray/model_facts.py``).

``rank_facts(runner)`` reads a ``ModelRunner`` once it is built: the length limit, the
vocabulary, the architecture (from the rank's config, with ``hf_overrides``), what the weights,
compute and KV cache are stored in, the KV layout's windows, the recurrent state slots, how the
ranks split the model, and the projections adapters may adapt. It travels whole to the executor,
the engine's limits, the driver's info and the model card.
"""

from __future__ import annotations

from typing import Any

from nvray.layers.tp import expert_parallel, tp_size
from nvray.layers.pp import pp_size
from nvray.model_facts import ModelFacts


def rank_facts(runner: Any) -> ModelFacts:
    """What the loaded model of ``runner`` (a ``ModelRunner``) is, as its rank found it."""
    lora_targets = runner.lora.targets() if runner.lora is not None else {}
    return ModelFacts(runner.max_model_len, runner.hf_config.vocab_size,
                      (runner.hf_config.architectures or [""])[0], storage_dtypes(runner),
                      runner.kv_layout.group_windows, runner.num_state_slots,
                      parallelism(runner.all_reduce_in_use), lora_targets)


def parallelism(all_reduce: str) -> dict[str, Any]:
    """How the ranks split the model and talk, for stats and the model card."""
    return {"tensor_parallel_size": tp_size(), "pipeline_parallel_size": pp_size(),
            "expert_parallel": expert_parallel(), "all_reduce": all_reduce}


def storage_dtypes(runner: Any) -> dict[str, str]:
    """What the weights and the KV cache are stored in, for stats and the model card."""
    compute = str(runner.dtype).removeprefix("torch.")
    quant = runner.quant_config
    weights = compute if quant is None else quant.describe()
    kv = compute if runner.kv_dtype == runner.dtype else "fp8 e4m3 (scale 1)"
    return {"weights": weights, "compute": compute, "kv_cache": kv}
