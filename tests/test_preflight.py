"""``build_app`` checks the model before anything deploys (``nvray/preflight.py``): a missing
checkpoint, a directory without config.json, an architecture nvray does not serve, a
``max_model_len`` past the model's rope and a ``tensor_parallel_size`` that does not divide its
heads are each refused with a ValueError naming them, in the caller's process."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from deployments import build_app


def test_a_missing_checkpoint_is_refused_by_build_app(tmp_path):
    with pytest.raises(ValueError, match=f"model='{tmp_path}/nope' is not a local checkpoint"):
        build_app({"model": str(tmp_path / "nope")})


def test_a_directory_without_config_json_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a local checkpoint directory with a config.json"):
        build_app({"model": str(tmp_path)})


def test_an_unsupported_architecture_is_refused_naming_it(tmp_path, tiny_path):
    model = shutil.copytree(tiny_path, tmp_path / "m")
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = ["BertForMaskedLM"]
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=r"architectures \['BertForMaskedLM'\] .* not supported"):
        build_app({"model": str(model)})


def test_options_the_model_cannot_take_are_refused_before_deploying():
    with pytest.raises(ValueError, match="max_model_len=100000 exceeds the model's "
                                         "max_position_embeddings=2048"):
        build_app({"model": "tiny", "max_model_len": 100000})
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide .* "
                                         "num_attention_heads=4"):
        build_app({"model": "tiny", "tensor_parallel_size": 3})


def test_the_tiny_model_is_checked_before_it_is_built(tmp_path, monkeypatch):
    """With a cold cache the app's build checks the options against the tiny model's recipe and
    leaves building it (torch, on the replicas' nodes) to the replicas."""
    from nvray.models.tiny import tiny_is_built

    monkeypatch.setenv("NVRAY_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="max_model_len=100000 exceeds the model's "
                                         "max_position_embeddings=2048"):
        build_app({"model": "tiny", "max_model_len": 100000})
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide"):
        build_app({"model": "tiny", "tensor_parallel_size": 3})
    build_app({"model": "tiny", "max_model_len": 1024})
    assert not tiny_is_built() and not os.listdir(tmp_path)


def test_the_tiny_models_recipe_config_is_the_config_json_it_builds(tiny_path):
    from nvray.models.tiny import tiny_recipe_config

    with open(os.path.join(tiny_path, "config.json")) as f:
        assert json.load(f) == tiny_recipe_config()
