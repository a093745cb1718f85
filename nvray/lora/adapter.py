"""A LoRA adapter in PEFT's format on local disk: read, checked, scaled.

A PEFT LoRA directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``, ``alpha_pattern``, ...) and ``adapter_model.safetensors``, whose tensors are
named ``base_model.model.<module>.lora_A.weight`` ([r, in]) and ``....lora_B.weight`` ([out, r])
for each adapted ``<module>`` (a checkpoint module name, e.g. ``model.layers.0.self_attn.q_proj``).
The delta a module adds is ``scaling * (x @ A.T) @ B.T``, ``scaling = alpha / r`` (rsLoRA:
``alpha / sqrt(r)``; ``alpha`` from ``alpha_pattern`` where a pattern names the module).

``inspect_adapter`` reads the config and the tensors' shapes only (the safetensors header) and
checks them against the model's adaptable projections (``targets``: module name -> full
(in, out) features, what the ranks report) and ``max_lora_rank``; anything nvray cannot serve is
a ``ValueError`` naming the adapter and the reason, raised when a request names the adapter,
never mid-step. ``read_adapter_weights`` reads the tensors and each module's scaling (the ranks,
when the adapter gets a GPU slot).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import xxhash

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$")


@dataclass(frozen=True)
class LoRAAdapter:
    """A checked adapter: what the engine schedules by and the ranks load from."""

    name: str
    path: str  # its directory
    rank: int  # the largest r of its modules
    modules: tuple[str, ...]  # the checkpoint modules it adapts
    cache_salt: int  # the root of its prefix-cache hashes (no KV shared with the base or others)
    version: int = 0  # its weights file's modification time (ns): rewritten files are new

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.name, self.path, self.version)


def _fail(name: str, reason: str) -> ValueError:
    return ValueError(f"LoRA adapter {name!r}: {reason}")


def read_adapter_config(name: str, path: str) -> dict[str, Any]:
    """``adapter_config.json`` of the adapter at ``path``, with the features nvray does not
    serve refused."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise _fail(name, f"no {CONFIG_FILE} in {path!r} (a PEFT LoRA directory is expected)")
    try:
        with open(file) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise _fail(name, f"{file} cannot be read as JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise _fail(name, f"{file} holds a {type(cfg).__name__}, not a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    refusals = [
        (peft_type != "LORA", f"peft_type {peft_type!r} is not LoRA"),
        (bool(cfg.get("use_dora")), "DoRA (use_dora) is not supported"),
        (cfg.get("bias", "none") != "none", f"bias={cfg.get('bias')!r} is not supported "
                                            "(only 'none')"),
        (bool(cfg.get("modules_to_save")), f"modules_to_save={cfg.get('modules_to_save')} "
                                           "(whole trained modules) is not supported"),
        (bool(cfg.get("fan_in_fan_out")), "fan_in_fan_out is not supported"),
    ]
    for refused, reason in refusals:
        if refused:
            raise _fail(name, reason)
    return cfg


def _alpha_of(cfg: dict[str, Any], module: str) -> float:
    """PEFT's rule: the ``alpha_pattern`` key matching the end of the module's name, else
    ``lora_alpha``."""
    for pattern, alpha in (cfg.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return float(alpha)
    return float(cfg.get("lora_alpha", 8))


def scaling_of(cfg: dict[str, Any], module: str, rank: int) -> float:
    alpha = _alpha_of(cfg, module)
    return alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank


def _check_scaling(name: str, cfg: dict[str, Any], module: str, rank: int) -> None:
    """The scaling the ranks will compute, computed now: a bad alpha or pattern is refused."""
    try:
        scale = scaling_of(cfg, module, rank)
    except (ValueError, TypeError, ZeroDivisionError, re.error) as e:
        raise _fail(name, f"{module}: its scaling (lora_alpha / r) cannot be computed: "
                          f"{e}") from None
    if not math.isfinite(scale):
        raise _fail(name, f"{module}: its scaling {scale} is not finite")


def _tensor_shapes(name: str, path: str) -> dict[str, dict[str, tuple[int, ...]]]:
    """module -> {"A": shape, "B": shape}, from the safetensors header."""
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise _fail(name, f"no {WEIGHTS_FILE} in {path!r}")
    try:
        return _shapes_in(name, file)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - a truncated file, an LFS pointer, no permission
        raise _fail(name, f"{file} is not a readable safetensors file: {e}") from None


def _shapes_in(name: str, file: str) -> dict[str, dict[str, tuple[int, ...]]]:
    from safetensors import safe_open  # noqa: PLC0415

    shapes: dict[str, dict[str, tuple[int, ...]]] = {}
    with safe_open(file, framework="pt") as f:
        for key in f.keys():
            if "lora_embedding" in key or "lora_magnitude" in key:
                raise _fail(name, f"tensor {key!r}: only LoRA on linear projections is supported")
            m = _KEY.match(key)
            if m is None:
                raise _fail(name, f"it holds tensor {key!r}, which is not a LoRA A/B weight "
                                  "(nvray serves LoRA on the layers' linear projections only)")
            shapes.setdefault(m.group(1), {})[m.group(2)] = tuple(f.get_slice(key).get_shape())
    if not shapes:
        raise _fail(name, f"{WEIGHTS_FILE} holds no LoRA weights")
    return shapes


def inspect_adapter(name: str, path: str, targets: dict[str, tuple[int, int]],
                    max_lora_rank: int) -> LoRAAdapter:
    """Check the adapter at ``path`` against the model's adaptable projections ``targets``."""
    if not os.path.isdir(path):
        raise _fail(name, f"{path!r} is not a directory")
    path = os.path.realpath(path)
    cfg = read_adapter_config(name, path)
    shapes, rank = _tensor_shapes(name, path), 0
    for module, ab in sorted(shapes.items()):
        if set(ab) != {"A", "B"}:
            raise _fail(name, f"module {module!r} has lora_{''.join(ab)} but not both A and B")
        if module not in targets:
            kinds = sorted({t.rsplit(".", 1)[-1] for t in targets})
            raise _fail(name, f"it adapts {module!r}, which this model has no adaptable "
                              f"projection for (adaptable: {', '.join(kinds)} of each layer)")
        (r, a_in), (b_out, b_r) = ab["A"], ab["B"]
        in_features, out_features = targets[module]
        if (a_in, b_out, b_r) != (in_features, out_features, r):
            raise _fail(name, f"{module}: lora_A {ab['A']} / lora_B {ab['B']} do not fit the "
                              f"model's projection ({in_features} -> {out_features} features)")
        if r > max_lora_rank:
            raise _fail(name, f"{module} has rank {r}, above max_lora_rank={max_lora_rank}")
        if r < 1:
            raise _fail(name, f"{module} has rank {r}")
        _check_scaling(name, cfg, module, r)
        rank = max(rank, r)
    version = weights_version(path)
    salt = xxhash.xxh64_intdigest(f"lora\0{name}\0{path}\0{version}".encode())
    return LoRAAdapter(name, path, rank, tuple(sorted(shapes)), salt, version)


def weights_version(path: str) -> int:
    """The adapter's weights file's modification time (ns); -1 when it is gone."""
    try:
        return os.stat(os.path.join(path, WEIGHTS_FILE)).st_mtime_ns
    except OSError:
        return -1


def read_adapter_weights(adapter: LoRAAdapter, pin: bool = False
                         ) -> dict[str, tuple[Any, Any, float]]:
    """module -> (A [r, in], B [out, r], its scaling), as the file stores them, in host memory:
    with ``pin``, views of one pinned buffer (one allocation for the whole adapter), so that the
    copies to the GPU run asynchronously."""
    from safetensors.torch import load_file  # noqa: PLC0415

    if weights_version(adapter.path) != adapter.version:  # the scheduler checked just before
        raise RuntimeError(f"LoRA adapter {adapter.name!r}: {adapter.path} changed on disk (or "
                           "went) after it was checked; its files must stay while it is in use")
    cfg = read_adapter_config(adapter.name, adapter.path)
    tensors = load_file(os.path.join(adapter.path, WEIGHTS_FILE))
    if pin:
        tensors = _pinned(tensors)
    parts: dict[str, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        assert m is not None, key  # inspect_adapter checked every name
        parts.setdefault(m.group(1), {})[m.group(2)] = tensor
    return {module: (ab["A"], ab["B"], scaling_of(cfg, module, ab["A"].shape[0]))
            for module, ab in parts.items()}


def _pinned(tensors: dict[str, Any]) -> dict[str, Any]:
    """The tensors copied into one pinned host buffer, each a view of it (64-byte aligned)."""
    import torch  # noqa: PLC0415

    spans = {key: -(-t.nbytes // 64) * 64 for key, t in tensors.items()}
    buffer = torch.empty(sum(spans.values()), dtype=torch.uint8, pin_memory=True)
    views, offset = {}, 0
    for key, t in tensors.items():
        view = buffer[offset:offset + t.nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        views[key] = view
        offset += spans[key]
    return views
