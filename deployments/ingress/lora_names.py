"""LoRANames: the adapters an app serves by name, and the ``LoRARequest`` each name resolves to.

A request's ``model`` is the base model's name (no adapter), an adapter's name, or
``<base>:<adapter>`` (Ray Serve LLM's form). Adapters come from three places:

- ``lora_modules`` (app args): declared at start, name -> PEFT directory;
- ``lora_path`` (app args): a directory whose subdirectories are adapters; a name not declared
  is looked up there on first use (Ray Serve LLM's dynamic loading, from local disk);
- ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (with
  ``allow_runtime_lora_updating``, as vLLM's flag): added and removed at run time.

An unknown name is a 404 naming it. The engine checks an adapter's files when a request first
uses it (``nvray/lora/registry.py``); ``load`` checks them at once against the engine's
adaptable projections (``inspect_adapter``), so a bad adapter is refused with its reason when
it is loaded. The table is this ingress replica's: with several, declare adapters with
``lora_modules`` or ``lora_path``, which every replica reads.
"""

from __future__ import annotations

import os
from typing import Any

from deployments.ingress.errors import OpenAIError
from nvray.lora.adapter import CONFIG_FILE, inspect_adapter
from nvray.lora.request import LoRARequest


def parse_lora_modules(value: Any) -> dict[str, str]:
    """vLLM's ``--lora-modules`` forms: ``name=path`` strings, ``{"name", "path"}`` objects, or
    one ``{name: path}`` object."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return {str(k): os.path.abspath(str(v)) for k, v in value.items()}
    modules = {}
    for item in value:
        if isinstance(item, str) and "=" in item:
            name, _, path = item.partition("=")
        elif isinstance(item, dict) and {"name", "path"} <= set(item):
            name, path = item["name"], item["path"]
        else:
            raise ValueError(f"lora_modules entry {item!r}: expected 'name=path' or "
                             "{'name': ..., 'path': ...}")
        modules[str(name)] = os.path.abspath(str(path))
    return modules


def _not_found(model: str, why: str = "") -> OpenAIError:
    return OpenAIError(404, f"the model '{model}' does not exist{why}", "model",
                       "model_not_found")


class LoRANames:
    def __init__(self, base: str, modules: dict[str, str], lora_path: str | None) -> None:
        self.base = base
        self.modules = dict(modules)
        self.lora_path = os.path.abspath(lora_path) if lora_path else None

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter ``model`` names (None: the base model); a 404 for an unknown name."""
        if model is None or model == self.base:
            return None
        name = model
        if model.startswith(self.base + ":"):
            name = model[len(self.base) + 1:]
        path = self.modules.get(name) or self._found_on_disk(name)
        if path is None:
            raise _not_found(model)
        return LoRARequest(name, 0, path)

    def _found_on_disk(self, name: str) -> str | None:
        """``lora_path/<name>`` if it holds an adapter (a plain directory name only)."""
        if not self.lora_path or not name or name in (".", "..") or os.sep in name:
            return None
        path = os.path.join(self.lora_path, name)
        if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
            return None
        self.modules[name] = path
        return path

    def load(self, name: str, path: str, info: dict[str, Any]) -> None:
        """Add an adapter at run time, checked at once against the engine (``info``: its
        ``lora_targets`` and ``max_lora_rank``)."""
        if not name or name == self.base or ":" in name:
            raise OpenAIError(400, f"lora_name {name!r} is not a valid adapter name",
                              "lora_name")
        if name in self.modules:
            raise OpenAIError(400, f"the LoRA adapter '{name}' is already loaded", "lora_name")
        path = os.path.abspath(path)  # the engine's working directory is not this one's
        try:
            inspect_adapter(name, path, info.get("lora_targets") or {},
                            info.get("max_lora_rank", 0))
        except ValueError as e:
            raise OpenAIError(400, str(e), "lora_path") from None
        self.modules[name] = path

    def unload(self, name: str) -> None:
        if self.modules.pop(name, None) is None:
            raise OpenAIError(404, f"the LoRA adapter '{name}' is not loaded", "lora_name",
                              "model_not_found")

    def cards(self, created: int) -> list[dict[str, Any]]:
        """``/v1/models`` entries of the adapters known so far (vLLM's: parent and root)."""
        return [{"id": name, "object": "model", "created": created, "owned_by": "nvray",
                 "parent": self.base, "root": path} for name, path in sorted(self.modules.items())]
