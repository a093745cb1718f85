"""Which FP8 scheme a model's linear layers use: read from the checkpoint's ``config.json``
(``quantization_config``) or asked for with ``quantization="fp8"``.

Supported, and nothing else (anything else is a ``ValueError`` naming it, at load):

- Qwen's FP8 checkpoints (``quant_method: "fp8"``, ``fmt: "e4m3"``, ``activation_scheme:
  "dynamic"``, ``weight_block_size: [bn, bk]``): block-scaled weights with ``weight_scale_inv``,
  activations per token and ``bk`` columns;
- compressed-tensors (llm-compressor) ``float-quantized`` checkpoints whose one config group
  targets ``Linear`` with 8-bit float, symmetric, static ``channel`` (``FP8_DYNAMIC``) or
  ``block`` weights and dynamic ``token`` (or ``group``) activations, scales in ``weight_scale``;
- on-the-fly: a 16/32-bit checkpoint with ``quantization="fp8"``, its linear weights quantized
  per output channel as they load, activations per token.

Embeddings and the LM head stay in the compute dtype. ``Fp8Config.for_modules`` says whether
one (fused) layer is quantized, from the checkpoint modules it fuses.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Fp8Config:
    """``block`` is ``(rows, cols)`` of one weight scale, or None for one scale per output
    channel; ``scale_name`` is the checkpoint's name of the scale tensor; ``ignored`` are
    module names (or ``re:`` patterns) left unquantized; ``source`` says where it came from."""

    block: tuple[int, int] | None
    scale_name: str
    source: str  # "fp8" (Qwen), "compressed-tensors" or "on-the-fly"
    ignored: tuple[str, ...] = ()

    @property
    def quantize_on_load(self) -> bool:
        return self.source == "on-the-fly"

    def describe(self) -> str:
        scales = "per channel" if self.block is None else f"{self.block[0]}x{self.block[1]} blocks"
        return f"fp8 e4m3 ({self.source}, weight scales {scales}, dynamic activations)"

    def check_shard(self, what: str, size: int, dim: int) -> None:
        """A fused part or tensor-parallel shard of ``size`` weight rows (dim 0) or columns
        (dim 1) must start and end on a scale block's edge."""
        if self.block is not None and size % self.block[dim] != 0:
            raise ValueError(f"{what} of {size} does not split into the checkpoint's "
                             f"{self.block[0]}x{self.block[1]} weight blocks")

    def _is_ignored(self, module: str) -> bool:
        for pattern in self.ignored:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module):
                    return True
            elif (module == pattern or module.endswith("." + pattern)
                  or module.startswith(pattern + ".")):  # a parent module: all inside it
                return True
        return False

    def for_modules(self, modules: list[str]) -> "Fp8Config | None":
        """This config for a layer fusing the checkpoint ``modules``, or None if they are
        left unquantized; a fused layer must be all one or all the other."""
        ignored = [self._is_ignored(m) for m in modules]
        if any(ignored) and not all(ignored):
            raise ValueError(f"quantization_config leaves {[m for m, i in zip(modules, ignored) if i]} "
                             f"unquantized but not {[m for m, i in zip(modules, ignored) if not i]}: "
                             f"nvray fuses these into one layer, so they must match")
        return None if all(ignored) else self


def quant_config_for(hf_config: Any, quantization: str | None) -> Fp8Config | None:
    """The checkpoint's FP8 scheme, else on-the-fly FP8 if ``quantization='fp8'``, else None
    (``quantization`` was validated by ``EngineConfig``)."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None:
        qc = qc if isinstance(qc, dict) else qc.to_dict()
        return _from_checkpoint(qc)
    if quantization == "fp8":
        return Fp8Config(block=None, scale_name="weight_scale", source="on-the-fly")
    return None


def _from_checkpoint(qc: dict[str, Any]) -> Fp8Config:
    method = qc.get("quant_method")
    if method == "fp8":
        return _from_qwen_fp8(qc)
    if method == "compressed-tensors":
        return _from_compressed_tensors(qc)
    raise ValueError(f"checkpoint quantization quant_method={method!r} is not supported; "
                     f"supported: 'fp8' (e4m3, block scales) and 'compressed-tensors' "
                     f"(FP8_DYNAMIC and FP8 block)")


def _checked_block(block: Any, what: str) -> tuple[int, int]:
    """A ``[rows, cols]`` weight block nvray's kernels take: any row count; columns a power
    of two from 16 to 128 or a multiple of 128 (the GEMM walks K in tiles of at most 128)."""
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)):
        raise _unsupported(what, block, "a [rows, cols] block is needed (per-tensor FP8 "
                           "checkpoints are not supported)")
    cols = block[1]
    if not ((16 <= cols <= 128 and cols & (cols - 1) == 0) or cols % 128 == 0):
        raise _unsupported(what, block, "block columns must be 16, 32, 64, 128 or a multiple "
                           "of 128")
    return int(block[0]), int(cols)


def _unsupported(what: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"checkpoint quantization_config {what}={value!r} is not supported: {allowed}")


def _from_qwen_fp8(qc: dict[str, Any]) -> Fp8Config:
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _unsupported("fmt", qc.get("fmt"), "only 'e4m3'")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise _unsupported("activation_scheme", qc.get("activation_scheme"), "only 'dynamic'")
    block = _checked_block(qc.get("weight_block_size"), "weight_block_size")
    ignored = tuple(qc.get("modules_to_not_convert") or ())
    return Fp8Config(block=block, scale_name="weight_scale_inv", source="fp8", ignored=ignored)


def _from_compressed_tensors(qc: dict[str, Any]) -> Fp8Config:
    if qc.get("format") != "float-quantized":
        raise _unsupported("format", qc.get("format"), "only 'float-quantized' (FP8)")
    for field in ("sparsity_config", "transform_config"):
        if qc.get(field):
            raise _unsupported(field, qc.get(field), "only dense FP8 checkpoints")
    if qc.get("kv_cache_scheme"):
        raise _unsupported("kv_cache_scheme", qc.get("kv_cache_scheme"),
                           "use kv_cache_dtype='fp8' instead of checkpoint KV scales")
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise _unsupported("config_groups", len(groups), "exactly one group")
    group = groups[0]
    if "Linear" not in (group.get("targets") or []):
        raise _unsupported("targets", group.get("targets"), "the group must target 'Linear'")
    if group.get("output_activations"):
        raise _unsupported("output_activations", group.get("output_activations"),
                           "output quantization is not supported")
    block = _ct_weights(group.get("weights") or {})
    _ct_activations(group.get("input_activations"), block)
    ignored = tuple(qc.get("ignore") or ())
    if not any(p.endswith("lm_head") for p in ignored):
        raise _unsupported("ignore", list(ignored), "lm_head must be left unquantized")
    return Fp8Config(block=block, scale_name="weight_scale", source="compressed-tensors",
                     ignored=ignored)


def _ct_is_fp8(args: dict[str, Any]) -> bool:
    return args.get("num_bits") == 8 and args.get("type") == "float" and args.get("symmetric", True)


def _ct_weights(w: dict[str, Any]) -> tuple[int, int] | None:
    if not _ct_is_fp8(w) or w.get("dynamic"):
        raise _unsupported("weights", w, "8-bit float, symmetric, static weights")
    strategy = w.get("strategy")
    if strategy == "channel":
        return None
    if strategy == "block":
        return _checked_block(w.get("block_structure"), "weights.block_structure")
    raise _unsupported("weights.strategy", strategy, "'channel' or 'block'")


def _ct_activations(a: dict[str, Any] | None, block: tuple[int, int] | None) -> None:
    if not a or not _ct_is_fp8(a) or not a.get("dynamic"):
        raise _unsupported("input_activations", a, "8-bit float, symmetric, dynamic "
                           "(static activation scales are not supported)")
    strategy = a.get("strategy")
    wanted = "token" if block is None else "group"
    if strategy != wanted:
        raise _unsupported("input_activations.strategy", strategy, f"'{wanted}' with "
                           f"{'channel' if block is None else 'block'} weights")
    if block is not None and a.get("group_size") != block[1]:
        raise _unsupported("input_activations.group_size", a.get("group_size"),
                           f"the weight block's column count, {block[1]}")
