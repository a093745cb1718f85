"""Engine options as data: each ``EngineConfig`` field declares its help text, bounds and
choices once (``option()``), and everything that offers engine options reads them from here.

- ``EngineConfig`` checks each value against its field's bounds and choices (``check``), with
  one message shape: ``name=value is invalid: must be ...``.
- The Serve app's arguments (``deployments/args.py``) and the batch job's flags
  (``nvray/batch/__main__.py``) are made from the fields marked ``exposed``
  (``nvray.config.exposed_options``), with the engine's
  default and help; the other fields reach the engine through each surface's pass-through
  (``engine_options``). A new engine option is therefore one field: declared with ``option()``
  it is checked, documented, and (when exposed) an app argument, an ``nvray serve`` flag and a
  batch flag.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any


def option(default: Any, help: str, *, ge: float | None = None, gt: float | None = None,
           le: float | None = None, choices: tuple[Any, ...] | None = None,
           exposed: bool = False) -> Any:
    """A dataclass field with its help, bounds (``ge``/``gt``/``le``), allowed ``choices`` and
    whether the app and the batch job offer it as an argument of its own (``exposed``)."""
    return field(default=default, metadata={"help": help, "ge": ge, "gt": gt, "le": le,
                                            "choices": choices, "exposed": exposed})


@dataclass(frozen=True)
class Option:
    """One engine option: its field's name, resolved type, default and declared metadata."""

    name: str
    annotation: Any
    default: Any
    help: str
    ge: float | None
    gt: float | None
    le: float | None
    choices: tuple[Any, ...] | None
    exposed: bool

    @property
    def optional(self) -> bool:
        """``None`` is allowed (and means the engine decides)."""
        return type(None) in typing.get_args(self.annotation)

    @property
    def scalar_type(self) -> Any:
        """The type without ``None`` or parameters: ``int`` for ``int | None``, ``dict`` for
        ``dict[str, Any] | None``."""
        bare = self.annotation
        if isinstance(bare, types.UnionType):
            (bare,) = [a for a in typing.get_args(bare) if a is not type(None)]
        return typing.get_origin(bare) or bare

    def allowed(self) -> str | None:
        """What the bounds allow, as the error message says it (None: no bounds)."""
        low = f"[{self.ge}" if self.ge is not None else f"({self.gt}" if self.gt is not None \
            else None
        if low is not None and self.le is not None:
            text = f"must be in {low}, {self.le}]"
        elif low is not None:
            text = f"must be {'>=' if self.ge is not None else '>'} {low[1:]}"
        elif self.le is not None:
            text = f"must be <= {self.le}"
        else:
            return None
        return text + (" or None" if self.optional else "")

    def within_bounds(self, value: Any) -> bool:
        if value is None and self.optional:
            return True
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le))

    def check(self, value: Any) -> None:
        """Raise ``ValueError`` naming the option when ``value`` breaks its bounds or choices."""
        if not self.within_bounds(value):
            raise ValueError(f"{self.name}={value!r} is invalid: {self.allowed()}")
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{self.name}={value!r} is invalid: must be one of "
                             f"{list(self.choices)}")


def options_of(cls: type) -> list[Option]:
    """Every field of the dataclass ``cls`` declared with ``option()``, in field order."""
    hints = typing.get_type_hints(cls)
    return [Option(f.name, hints[f.name], f.default, f.metadata["help"], f.metadata["ge"],
                   f.metadata["gt"], f.metadata["le"], f.metadata["choices"],
                   f.metadata["exposed"])
            for f in dataclasses.fields(cls) if "help" in f.metadata]
