"""``nvray``: the command line (also ``python -m nvray``).

- ``nvray serve [MODEL] [--option value ...]``: the OpenAI-compatible app, the same one as
  ``serve run deployments:build_app model=MODEL option=value ...`` (Serve's own ``serve run``
  deploys it, streams its logs and cleans up on Ctrl-C). Every app argument
  (``deployments.args.AppArgs``) is a flag with its help and default; the arguments are
  validated, and the model checked, before anything starts on Ray, and a bad one exits with
  status 2 naming it. ``--address``, ``--name``, ``--route-prefix`` and ``--non-blocking``
  are ``serve run``'s; its ``--working-dir`` and ``--runtime-env`` are not offered (use
  ``serve run`` itself to ship code to a cluster).
- ``nvray generate``, ``nvray batch``, ``nvray bench``: ``python -m nvray.generate``,
  ``python -m nvray.batch`` and ``python -m nvray.bench``, with the same arguments.

``nvray --help`` imports neither torch nor Ray; ``nvray serve --help`` no torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

EXIT_BAD_ARGUMENTS = 2
_DELEGATED = {  # subcommand -> (module, what it does)
    "generate": ("nvray.generate", "offline generation from the command line"),
    "batch": ("nvray.batch.__main__", "batch inference over a file, as a Ray job"),
    "bench": ("nvray.bench.__main__", "benchmarks that print and save figures"),
}
_SERVE_RUN_OPTIONS = (  # (flag, help): passed to `serve run` as they are
    ("--address", "Ray cluster address (default: RAY_ADDRESS, the running cluster or a new "
                  "local one)"),
    ("--name", "Serve application name (default: 'default')"),
    ("--route-prefix", "the app's route prefix (default: '/')"),
)


def _flag(name: str) -> str:
    """An app argument's flag: ``max_model_len`` -> ``--max-model-len``."""
    return "--" + name.replace("_", "-")


def _default_text(field: Any) -> str:
    """A field's default as the help shows it (objects and lists as JSON)."""
    default = field.get_default(call_default_factory=True)
    return json.dumps(default) if isinstance(default, (dict, list)) else str(default)


def _is_bool(field: Any) -> bool:
    """A yes/no argument (``--x`` / ``--no-x``)."""
    return field.annotation in (bool, bool | None)


def add_app_arguments(parser: argparse.ArgumentParser) -> None:
    """Every AppArgs field but ``model`` as ``--the-name``: booleans as ``--x/--no-x``, the
    rest as text that AppArgs validates (JSON for objects and lists)."""
    from deployments.args import AppArgs

    group = parser.add_argument_group("app arguments (serve run deployments:build_app key=value)")
    for name, field in AppArgs.model_fields.items():
        if name == "model":
            continue
        help_text = f"{field.description} (default: {_default_text(field)})".replace("%", "%%")
        if _is_bool(field):
            group.add_argument(_flag(name), dest=name, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help_text)
        else:
            group.add_argument(_flag(name), dest=name, metavar="VALUE",
                               default=argparse.SUPPRESS, help=help_text)


def _serve_parser(subparsers: Any, with_app_arguments: bool) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="the OpenAI-compatible app on Ray Serve (serve run deployments:build_app)",
        description="Serve MODEL over HTTP on Ray Serve (127.0.0.1:8000 unless Serve already "
                    "runs on the cluster): the app of `serve run deployments:build_app`.")
    p.add_argument("model", nargs="?", default="tiny",
                   help="HF checkpoint directory, or 'tiny' for the embedded random-weight "
                        "Qwen3 (default: tiny)")
    for flag, help_text in _SERVE_RUN_OPTIONS:
        p.add_argument(flag, default=None, help=help_text)
    p.add_argument("--non-blocking", action="store_true",
                   help="deploy and return, leaving the app running (default: block, stream "
                        "its logs, and delete it on Ctrl-C)")
    if with_app_arguments:
        add_app_arguments(p)
    return p


def build_parser(with_app_arguments: bool = True) -> argparse.ArgumentParser:
    """``with_app_arguments=False``: ``serve`` without its app flags (``nvray --help``)."""
    parser = argparse.ArgumentParser(prog="nvray", description="nvray: LLM inference on Ray.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _serve_parser(subparsers, with_app_arguments)
    for name, (_, help_text) in _DELEGATED.items():
        subparsers.add_parser(name, help=f"{help_text} (nvray {name} --help)", add_help=False)
    return parser


def _as_text(value: Any) -> str:
    """A value as ``serve run``'s ``key=value`` text, which AppArgs parses back."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def app_arguments(namespace: argparse.Namespace) -> dict[str, Any]:
    """The app arguments given on the command line (and the model), as AppArgs takes them; a
    local checkpoint directory as an absolute path (the replicas may run elsewhere)."""
    from deployments.args import AppArgs

    args = {name: value for name, value in vars(namespace).items()
            if name in AppArgs.model_fields}
    empty = [_flag(name) for name, value in args.items() if value == ""]
    if empty:  # `serve run` cannot pass `key=` (and none of them means nothing)
        raise ValueError(f"{', '.join(empty)}: give a value (or leave the flag out)")
    if os.path.isdir(args["model"]):
        args["model"] = os.path.abspath(args["model"])
    return args


def serve(namespace: argparse.Namespace) -> int:
    """``nvray serve``: check, then run ``serve run deployments:build_app`` in this process."""
    from deployments.args import parse_args
    from nvray.preflight import check_model

    try:
        args = app_arguments(namespace)
        check_model(parse_args(args).engine_config())
    except ValueError as e:
        print(f"nvray serve: error: {e}", file=sys.stderr)
        return EXIT_BAD_ARGUMENTS
    options = [f"{flag}={value}" for flag, value in (
        ("--address", namespace.address), ("--name", namespace.name),
        ("--route-prefix", namespace.route_prefix)) if value is not None]
    if namespace.non_blocking:
        options.append("--non-blocking")
    from ray.serve.scripts import cli

    # Serve's own command: it exits with its status (Ctrl-C included) as `serve run` does
    return cli.main(args=["run", *options, "deployments:build_app",
                          *(f"{k}={_as_text(v)}" for k, v in args.items())], prog_name="serve")


def main(argv: list[str] | None = None) -> int:
    """The ``nvray`` console script: a subcommand and its arguments; the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _DELEGATED:  # their own parsers take everything after the name
        import importlib

        module = importlib.import_module(_DELEGATED[argv[0]][0])
        return module.main(argv[1:]) or 0
    namespace = build_parser(with_app_arguments=bool(argv) and argv[0] == "serve").parse_args(argv)
    return serve(namespace)


if __name__ == "__main__":
    sys.exit(main())
