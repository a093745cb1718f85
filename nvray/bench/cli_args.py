"""The bench subcommands' shared argument handling: comma-separated lists read and refused by
name (``SystemExit`` with the flag and what to give), the drafting workload's options of
``speculative`` and ``step-gap``, and the help formatter that shows each option's default."""

from __future__ import annotations

import argparse
from typing import Any


def word_list(flag: str, text: str, values: dict[str, Any]) -> tuple[Any, ...]:
    """``--flag a,b``: the values of comma-separated words from ``values``; others refused."""
    words = text.split(",")
    if any(w not in values for w in words):
        raise SystemExit(f"{flag} {text!r}: give {', '.join(values)} or {','.join(values)}")
    return tuple(values[w] for w in words)


def budgets(text: str | None) -> tuple[int | None, ...]:
    """``--max-num-batched-tokens a,b``: token budgets (None alone: the engine's)."""
    if text is None:
        return (None,)
    try:
        return tuple(int(b) for b in text.split(","))
    except ValueError:
        raise SystemExit(f"--max-num-batched-tokens {text!r}: give token counts, "
                         "e.g. 8192,16384") from None


def sizes(text: str, flag: str = "--tensor-parallel-size") -> tuple[int, ...]:
    try:
        return tuple(int(n) for n in text.split(","))
    except ValueError:
        raise SystemExit(f"{flag} {text!r}: give sizes, e.g. 1,2") from None


def names(flag: str, text: str, known: list[str]) -> tuple[str, ...]:
    """``--flag a,b``: the comma-separated names, each one of ``known``; others refused."""
    given = tuple(text.split(","))
    unknown = [n for n in given if n not in known]
    if unknown:
        raise SystemExit(f"{flag}: unknown {unknown}; choose from {known}")
    return given


def add_drafting_workload(parser: argparse.ArgumentParser, concurrency: str,
                          output_len: int) -> None:
    """The workload options of ``speculative`` and ``step-gap``."""
    from nvray.bench.checkpoints import SHAPES  # noqa: PLC0415

    parser.add_argument("--model", default=None,
                        help="checkpoint directory or 'tiny' (default: a random checkpoint of "
                             "--shape)")
    parser.add_argument("--shape", default="0.6b", choices=SHAPES)
    parser.add_argument("--concurrency", default=concurrency, help="comma-separated")
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="k")
    parser.add_argument("--mean-acceptance-length", type=float, default=3.0,
                        help="the oracle drafter's accepted drafts + 1, on average")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=output_len)


class DefaultsShown(argparse.HelpFormatter):
    """Each option's default after its help (options with no help text too), unless the help
    already says it or there is none to say."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not _has_default(action) or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def _has_default(action: argparse.Action) -> bool:
    return bool(action.option_strings) and not any(
        action.default is none for none in (None, argparse.SUPPRESS, False))


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """A subcommand's help gives every option's default (argparse prints no help line for an
    option without help text)."""
    parser.formatter_class = DefaultsShown
    for action in parser._actions:
        if action.help is None and _has_default(action):
            action.help = "(default: %(default)s)"
