"""What can be checked of a model before anything starts: its checkpoint directory and
config.json, an architecture nvray serves, and the engine options against the model's own
facts (``max_model_len`` against its rope, head counts against ``tensor_parallel_size``).

``check_model(config)`` raises one ``ValueError`` naming the first problem. The Serve app calls
it in ``build_app``, before deploying: a mistyped second ``serve run`` then fails in seconds
and leaves the running app alone, instead of replacing it with replicas that fail to start.
Nothing here reads weights or imports torch.
"""

from __future__ import annotations

from nvray.config import EngineConfig
from nvray.model_config import ModelConfig, load_model_config, model_config_from_dict
from nvray.models import MODEL_REGISTRY
from nvray.models.tiny import TINY_NAME, resolve_model, tiny_is_built, tiny_recipe_config


def check_model(config: EngineConfig) -> None:
    hf_config = _model_config(config)
    archs = getattr(hf_config, "architectures", None) or []
    if not any(arch in MODEL_REGISTRY for arch in archs):
        raise ValueError(f"model={config.model!r}: architectures {archs} in its config.json are "
                         f"not supported; supported: {sorted(MODEL_REGISTRY)}")
    _check_heads(config, hf_config)
    _check_max_model_len(config, hf_config)


def _model_config(config: EngineConfig) -> ModelConfig:
    if config.model == TINY_NAME and not tiny_is_built():  # the replicas build it, on their nodes
        return model_config_from_dict({**tiny_recipe_config(), **(config.hf_overrides or {})})
    return load_model_config(resolve_model(config.model), config.hf_overrides)


def _check_heads(config: EngineConfig, hf_config: object) -> None:
    heads = getattr(hf_config, "num_attention_heads", None)
    tp = config.tensor_parallel_size
    if isinstance(heads, int) and heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide model={config.model!r}'s "
                         f"num_attention_heads={heads}")


def _check_max_model_len(config: EngineConfig, hf_config: object) -> None:
    """Past ``max_position_embeddings`` with no YaRN in the config (which reaches further: the
    ranks check that reach, ``rotary.rope_max_positions``; torch is not imported here, as
    ``serve run`` builds the app)."""
    limit = getattr(hf_config, "max_position_embeddings", None)
    if config.max_model_len is None or not isinstance(limit, int) or config.max_model_len <= limit:
        return
    rope = [getattr(hf_config, key, None) for key in ("rope_scaling", "rope_parameters")]
    if any("yarn" in str(value) for value in rope if value):
        return
    raise ValueError(f"model={config.model!r}: max_model_len={config.max_model_len} exceeds the "
                     f"model's max_position_embeddings={limit} (a longer context needs rope "
                     f"scaling, e.g. hf_overrides={{'rope_scaling': {{'rope_type': 'yarn', "
                     f"'factor': 4.0, 'original_max_position_embeddings': {limit}}}}})")
