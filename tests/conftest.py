"""Shared fixtures: random HF checkpoints (the embedded tiny model and other shapes), the HF
transformers oracle, and helpers. Checkpoints go to a per-session cache directory."""

from __future__ import annotations

import os
import tempfile

import pytest

_SESSION_CACHE = tempfile.mkdtemp(prefix="nvray-test-cache-")
os.environ.setdefault("NVRAY_CACHE_DIR", _SESSION_CACHE)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Another Qwen3 shape: untied head, wider heads, 3 layers, GQA 3:1.
OTHER_QWEN3 = {"hidden_size": 96, "intermediate_size": 160, "num_hidden_layers": 3,
               "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 32,
               "tie_word_embeddings": False, "rope_theta": 1000000.0}
QWEN2 = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}


@pytest.fixture(scope="session")
def tiny_path() -> str:
    from nvray.models.tiny import tiny_model_path

    return tiny_model_path()


@pytest.fixture(scope="session")
def other_qwen3_path(tmp_path_factory) -> str:
    from nvray.models.tiny import build_checkpoint

    return build_checkpoint(str(tmp_path_factory.mktemp("other-qwen3")), OTHER_QWEN3, seed=1)


@pytest.fixture(scope="session")
def qwen2_path(tmp_path_factory) -> str:
    from nvray.models.tiny import build_checkpoint

    return build_checkpoint(str(tmp_path_factory.mktemp("qwen2")), QWEN2, seed=2,
                            architecture="Qwen2ForCausalLM")


