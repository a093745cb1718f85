"""Adapter names looked up under ``lora_path`` (``deployments/ingress/lora_names.py``) stay inside
it: a name that walks out of the directory (``..``, ``../x``, an absolute path,
``<base>:../x``) is an unknown model (404), even where an adapter lies at the place it points
to; a plain subdirectory's name resolves to its adapter."""

from __future__ import annotations

import json
import os

import pytest

from deployments.ingress.errors import OpenAIError
from deployments.ingress.lora_names import LoRANames


def _adapter(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}, f)
    return path


@pytest.fixture()
def names(tmp_path) -> LoRANames:
    _adapter(str(tmp_path / "adapters" / "inside"))
    _adapter(str(tmp_path / "outside"))  # an adapter beside the directory, not in it
    _adapter(str(tmp_path))  # and one in the directory above it (what ".." names)
    return LoRANames("base", {}, str(tmp_path / "adapters"))


def test_a_subdirectory_of_lora_path_resolves_to_its_adapter(names, tmp_path):
    request = names.resolve("inside")
    assert request is not None and request.lora_path == str(tmp_path / "adapters" / "inside")
    assert names.resolve("base:inside").lora_path == request.lora_path


@pytest.mark.parametrize("model", ["../outside", "..", ".", "inside/../../outside",
                                   "base:../outside", "{outside}", "base:"])
def test_a_name_that_walks_out_of_lora_path_is_an_unknown_model(names, tmp_path, model):
    model = model.replace("{outside}", str(tmp_path / "outside"))
    with pytest.raises(OpenAIError) as caught:
        names.resolve(model)
    assert caught.value.status == 404 and "does not exist" in caught.value.message
    assert not any("outside" in path for path in names.modules.values())
