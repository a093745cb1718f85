"""Speculative methods as plug-ins: one class per ``speculative_config`` method, a registry.

A method's class declares what the engine and the ranks ask of it, and nothing else does:

- ``on_ranks``: its drafts are proposed on the ranks (a model beside the target's shards), not
  by a proposer on the engine's host; such a method needs ``pipeline_parallel_size=1`` and a
  target whose layers all attend fully;
- ``rows_lag``: its drafter's row at a position holds the next token (a head reading the
  target's hidden states), so a block's last row depends on the block after it;
- ``refeeds_accepted``: its rows of accepted drafts are fed again once verified (they were
  computed from its own hidden states; the target's now exist for them);
- ``model``: what ``speculative_config`` ``model`` is for it: ``"checkpoint"`` (the drafter's
  directory, required), ``"target"`` (the head is the target checkpoint's own; none given) or
  ``"none"`` (none given);
- ``host_proposer(config)``: the proposer run on the engine's host (a host method);
- ``build_drafter(...)``: its drafter on a rank (``nvray/worker/drafter.py`` and subclasses),
  imported there, so the host never imports torch for it;
- ``refuse_as_target(path, architectures)``: a checkpoint of its drafter given as the model to
  serve is refused with where it goes instead.

``SPECULATIVE_METHODS`` maps each name to its class (``SpeculativeConfig.method_class``). A new
method is one class here (``@register``) and, for a method on the ranks, its drafter module.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from nvray.speculative import NgramProposer, SpeculativeConfig
    from nvray.worker.drafter import Drafter

SPECULATIVE_METHODS: dict[str, type[SpeculativeMethod]] = {}


def register(cls: type[SpeculativeMethod]) -> type[SpeculativeMethod]:
    SPECULATIVE_METHODS[cls.name] = cls
    return cls


def refuse_drafter_served(path: str, hf_config: Any) -> None:
    """A drafter's checkpoint given as the model to serve: say where it goes."""
    archs = set(getattr(hf_config, "architectures", None) or [])
    for method in SPECULATIVE_METHODS.values():
        method.refuse_as_target(path, archs)


class SpeculativeMethod:
    """A method's declarations (the module docstring); subclasses override what differs."""

    name: ClassVar[str]
    on_ranks: ClassVar[bool] = False
    rows_lag: ClassVar[bool] = False
    refeeds_accepted: ClassVar[bool] = False
    model: ClassVar[str] = "none"

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
    def host_proposer(cls, config: SpeculativeConfig) -> NgramProposer | None:
        """The proposer the engine's host runs (None: the drafts come from the ranks)."""
        return None

    @classmethod
    def build_drafter(cls, spec: SpeculativeConfig, args: tuple[Any, ...],
                      target: Any, target_path: str) -> Drafter:
        """The drafter on a rank: ``args`` are ``Drafter``'s, ``target`` the target model."""
        raise TypeError(f"speculative method {cls.name!r} drafts on the host, not on a rank")

    @classmethod
    def refuse_as_target(cls, path: str, architectures: set[str]) -> None:
        """Raise when ``path`` (of ``architectures``) is this method's drafter, not a model."""


@register
class Ngram(SpeculativeMethod):
    """Prompt lookup over a sequence's own tokens, on the engine's host."""

    name = "ngram"

    @classmethod
    def host_proposer(cls, config: SpeculativeConfig) -> NgramProposer:
        from nvray.speculative import NgramProposer  # noqa: PLC0415 (speculative imports us)

        return NgramProposer(config)


@register
class DraftModel(SpeculativeMethod):
    """A small model with the target's vocabulary, run on the target's ranks."""

    name = "draft_model"
    on_ranks = True
    model = "checkpoint"

    @classmethod
    def build_drafter(cls, spec: SpeculativeConfig, args: tuple[Any, ...],
                      target: Any, target_path: str) -> Drafter:
        from nvray.worker.drafter import Drafter  # noqa: PLC0415 (torch: ranks only)

        return Drafter(spec, *args)


@register
class Eagle3(SpeculativeMethod):
    """An EAGLE-3 head reading the target's hidden states on its ranks."""

    name = "eagle3"
    on_ranks = True
    rows_lag = True
    refeeds_accepted = True
    model = "checkpoint"

    @classmethod
    def build_drafter(cls, spec: SpeculativeConfig, args: tuple[Any, ...],
                      target: Any, target_path: str) -> Drafter:
        from nvray.worker.eagle_drafter import Eagle3Drafter  # noqa: PLC0415

        return Eagle3Drafter(spec, *args, target=target)

    @classmethod
    def refuse_as_target(cls, path: str, architectures: set[str]) -> None:
        from nvray.models.eagle3 import ARCHITECTURES  # noqa: PLC0415

        if architectures & set(ARCHITECTURES):
            raise ValueError(f"{path} is an EAGLE-3 drafter, not a model to serve: pass it "
                             "beside its target as speculative_config={'method': 'eagle3', "
                             f"'model': {path!r}}}")


@register
class Mtp(SpeculativeMethod):
    """Qwen3.5's multi-token-prediction head from the target's own checkpoint."""

    name = "mtp"
    on_ranks = True
    rows_lag = True
    refeeds_accepted = True
    model = "target"

    @classmethod
    def build_drafter(cls, spec: SpeculativeConfig, args: tuple[Any, ...],
                      target: Any, target_path: str) -> Drafter:
        from nvray.worker.mtp_drafter import MtpDrafter  # noqa: PLC0415

        own = dataclasses.replace(spec, model=target_path)  # the head is the target's own
        return MtpDrafter(own, *args, target=target)

    @classmethod
    def refuse_as_target(cls, path: str, architectures: set[str]) -> None:
        from nvray.models.qwen3_5_mtp import ARCHITECTURE  # noqa: PLC0415

        if ARCHITECTURE in architectures:
            raise ValueError(f"{path} names Qwen3.5's MTP head ({ARCHITECTURE}), not a model "
                             "to serve: serve the Qwen3.5 checkpoint that holds it, with "
                             "speculative_config={'method': 'mtp'}")
