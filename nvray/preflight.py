"""What can be checked of a model before anything starts: its checkpoint directory and
config.json, an architecture nvray serves, and the engine options against the model's own
facts (``max_model_len`` against its rope, head counts against ``tensor_parallel_size``).

``check_model(config)`` raises one ``ValueError`` naming the first problem. The Serve app calls
it in ``build_app``, before deploying: a mistyped second ``serve run`` then fails in seconds
and leaves the running app alone, instead of replacing it with replicas that fail to start.
Nothing here reads weights.
"""

from __future__ import annotations

from nvray.config import EngineConfig
from nvray.model_config import load_model_config
from nvray.models import MODEL_REGISTRY
from nvray.models.tiny import resolve_model


def check_model(config: EngineConfig) -> None:
    path = resolve_model(config.model)
    hf_config = load_model_config(path, config.hf_overrides)
    archs = getattr(hf_config, "architectures", None) or []
    if not any(arch in MODEL_REGISTRY for arch in archs):
        raise ValueError(f"model={config.model!r}: architectures {archs} in its config.json are "
                         f"not supported; supported: {sorted(MODEL_REGISTRY)}")
    _check_heads(config, hf_config)
    _check_max_model_len(config, hf_config)


def _check_heads(config: EngineConfig, hf_config: object) -> None:
    heads = getattr(hf_config, "num_attention_heads", None)
    tp = config.tensor_parallel_size
    if isinstance(heads, int) and heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide model={config.model!r}'s "
                         f"num_attention_heads={heads}")


def _check_max_model_len(config: EngineConfig, hf_config: object) -> None:
    from nvray.worker.setup import resolve_max_model_len  # noqa: PLC0415 - imports torch (rotary)

    if config.max_model_len is not None and hasattr(hf_config, "max_position_embeddings"):
        try:
            resolve_max_model_len(config, hf_config)
        except ValueError as e:
            raise ValueError(f"model={config.model!r}: {e}") from None
