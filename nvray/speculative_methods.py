"""Speculative methods as plug-ins: one class per ``speculative_config`` method, a registry.

A method's class declares what the engine and the ranks ask of it, and nothing else does:

- ``on_ranks``: its drafts are proposed on the ranks (a model beside the target's shards), not
  by a proposer on the engine's host; such a method needs ``pipeline_parallel_size=1`` and a
  target whose layers all attend fully;
- ``rows_lag``: its drafter's row at a position holds the next token (a head reading the
  target's hidden states), so a block's last row depends on the block after it;
- ``reads_target``: its drafter reads the target model's hidden states (built with it);
- ``refeeds_accepted``: its rows of accepted drafts are fed again once verified (they were
  computed from its own hidden states; the target's now exist for them);
- ``model``: what ``speculative_config`` ``model`` is for it: ``"checkpoint"`` (the drafter's
  directory, required), ``"target"`` (the head is the target checkpoint's own; none given) or
  ``"none"`` (none given);
- ``host_proposer(config)``: the proposer run on the engine's host (a host method);
- ``drafter``: its drafter class on a rank (``nvray/worker/drafter.py`` and subclasses), named
  ``"module:Class"`` and imported there by ``build_drafter``, so the host never imports torch
  for it (a head's drafter also gets the target model);
- ``drafter_architectures``: the architectures its drafter's checkpoints name: such a
  checkpoint given as the model to serve is refused with where it goes instead
  (``refuse_as_target``).

``SPECULATIVE_METHODS`` maps each name to its class (``SpeculativeConfig.method_class``). A new
method is one class here (``@register``) and, for a method on the ranks, its drafter module.
"""

from __future__ import annotations

import dataclasses
import importlib
from array import array
from typing import Any, ClassVar

SPECULATIVE_METHODS: dict[str, type[SpeculativeMethod]] = {}


def register(cls: type[SpeculativeMethod]) -> type[SpeculativeMethod]:
    SPECULATIVE_METHODS[cls.name] = cls
    return cls


def refuse_drafter_served(path: str, hf_config: Any) -> None:
    """A drafter's checkpoint given as the model to serve: say where it goes."""
    archs = set(getattr(hf_config, "architectures", None) or [])
    for method in SPECULATIVE_METHODS.values():
        method.refuse_as_target(path, archs)


class NgramProposer:
    """Prompt lookup over a sequence's own tokens (prompt and output)."""

    def __init__(self, config: Any) -> None:  # a SpeculativeConfig
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``token_ids`` (none when no suffix recurs)."""
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        raw = array("i", token_ids).tobytes()  # int32: a match must start on a 4-byte edge
        length = len(token_ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = raw[4 * (length - n):]
            end = 4 * (length - 1)  # an earlier occurrence ends before the last token
            while (at := raw.rfind(suffix, 0, end)) >= 0:
                if at % 4 == 0:
                    return self._copy(token_ids, at // 4 + n, k)
                end = at + len(suffix) - 1  # misaligned: look further left
        return []

    @staticmethod
    def _copy(token_ids: list[int], follow: int, k: int) -> list[int]:
        """``k`` tokens copied from ``follow`` on, the copy reading its own output past the end
        (an overlapping copy, as LZ77's)."""
        drafts = token_ids[follow:follow + k]
        period = len(token_ids) - follow
        while len(drafts) < k:
            drafts.append(drafts[len(drafts) - period])
        return drafts


def _load(path: str) -> Any:
    """``"package.module:Name"``: that object, its module imported now (drafters and model
    modules import torch: the ranks load them, the host never does)."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


class SpeculativeMethod:
    """A method's declarations (the module docstring); subclasses override what differs."""

    name: ClassVar[str]
    on_ranks: ClassVar[bool] = False
    rows_lag: ClassVar[bool] = False
    refeeds_accepted: ClassVar[bool] = False
    reads_target: ClassVar[bool] = False  # its drafter reads the target model's hidden states
    model: ClassVar[str] = "none"
    drafter: ClassVar[str | None] = None  # its drafter class on a rank, "module:Class"
    drafter_architectures: ClassVar[str | None] = None  # "module:NAMES" its checkpoints name

    @classmethod
    def check_model(cls, model: str | None) -> str | None:
        """The refusal of ``speculative_config`` ``model`` for this method (None: accepted)."""
        if cls.model == "checkpoint":
            if not (isinstance(model, str) and model):
                return f"method {cls.name!r} needs the drafter's checkpoint directory"
            return None
        if model is not None:
            own = " (the head is the target checkpoint's own)" if cls.model == "target" else ""
            return f"method {cls.name!r} takes no model{own}"
        return None

    @classmethod
    def host_proposer(cls, config: Any) -> NgramProposer | None:
        """The proposer the engine's host runs for ``config`` (a ``SpeculativeConfig``; None:
        the drafts come from the ranks)."""
        return None

    @classmethod
    def build_drafter(cls, spec: Any, args: tuple[Any, ...], target: Any,
                      target_path: str) -> Any:
        """The drafter on a rank for ``spec`` (a ``SpeculativeConfig``): ``args`` are
        ``Drafter``'s after it, ``target`` the target model, ``target_path`` its checkpoint."""
        if cls.drafter is None:
            raise TypeError(f"speculative method {cls.name!r} drafts on the host, not on a rank")
        if cls.model == "target":  # the head is the target checkpoint's own
            spec = dataclasses.replace(spec, model=target_path)
        extra = {"target": target} if cls.reads_target else {}
        return _load(cls.drafter)(spec, *args, **extra)

    @classmethod
    def refuse_as_target(cls, path: str, architectures: set[str]) -> None:
        """Raise when ``path`` (of ``architectures``) is this method's drafter, not a model."""
        if cls.drafter_architectures is None:
            return
        names = _load(cls.drafter_architectures)
        if architectures & ({names} if isinstance(names, str) else set(names)):
            raise ValueError(f"{path} {cls.served_refusal(path, names)}")

    @classmethod
    def served_refusal(cls, path: str, names: Any) -> str:
        """What a checkpoint of this method's drafter (of ``names``) given as the model is."""
        return f"is a drafter ({names}), not a model to serve"


@register
class Ngram(SpeculativeMethod):
    """Prompt lookup over a sequence's own tokens, on the engine's host."""

    name = "ngram"

    @classmethod
    def host_proposer(cls, config: Any) -> NgramProposer:
        return NgramProposer(config)


@register
class DraftModel(SpeculativeMethod):
    """A small model with the target's vocabulary, run on the target's ranks."""

    name = "draft_model"
    on_ranks = True
    model = "checkpoint"
    drafter = "nvray.worker.drafter:Drafter"


@register
class Eagle3(SpeculativeMethod):
    """An EAGLE-3 head reading the target's hidden states on its ranks."""

    name = "eagle3"
    on_ranks = True
    rows_lag = True
    refeeds_accepted = True
    reads_target = True
    model = "checkpoint"
    drafter = "nvray.worker.eagle_drafter:Eagle3Drafter"
    drafter_architectures = "nvray.models.eagle3:ARCHITECTURES"

    @classmethod
    def served_refusal(cls, path: str, names: Any) -> str:
        return ("is an EAGLE-3 drafter, not a model to serve: pass it beside its target as "
                f"speculative_config={{'method': 'eagle3', 'model': {path!r}}}")


@register
class Mtp(SpeculativeMethod):
    """Qwen3.5's multi-token-prediction head from the target's own checkpoint."""

    name = "mtp"
    on_ranks = True
    rows_lag = True
    refeeds_accepted = True
    reads_target = True
    model = "target"
    drafter = "nvray.worker.mtp_drafter:MtpDrafter"
    drafter_architectures = "nvray.models.qwen3_5_mtp:ARCHITECTURE"

    @classmethod
    def served_refusal(cls, path: str, names: Any) -> str:
        return (f"names Qwen3.5's MTP head ({names}), not a model to serve: serve the Qwen3.5 "
                "checkpoint that holds it, with speculative_config={'method': 'mtp'}")
