"""``python -m nvray.batch --input IN --output OUT``: offline batch inference as a Ray job.

Contract:

- The input (JSON Lines or Parquet, a file or a directory; see ``nvray.batch.io``) has rows
  with an ``id`` and a ``prompt`` string or chat ``messages``. It is validated in one plain
  pass before anything starts on Ray: a malformed file, a row without an id or a prompt, or a
  duplicate id ends the run at once with exit status 2 and a message naming the file and row.
- Ray Data reads the rows and streams them, ``--batch-size`` at a time, through a pool of
  ``--concurrency`` actors, each owning one whole nvray engine (driver + tensor-parallel ranks
  in their own placement group; see ``nvray.batch.udf``).
- Every input row yields exactly one output row (``id``, ``text``, ``finish_reason``,
  ``prompt_tokens``, ``completion_tokens``, ``error``), in input order. With ``--task embed``
  a row's prompt is embedded instead (``nvray/pooling.py``: prefill only): its output row is
  ``id``, ``embedding`` (float32 values, ``--dimensions`` of them if given), ``prompt_tokens``,
  ``error``. A request that fails
  (say, a prompt longer than ``--max-model-len``) gets an ``error`` and the job goes on. The
  output file (JSON Lines or Parquet, by extension) appears only when the job succeeded.
- Ray Data shows progress while it runs; a summary (rows, errors, tokens, wall time, output
  tokens/s) is printed at the end.
- It runs the same directly (joining the running cluster, ``RAY_ADDRESS``, or a new local one)
  and as a submitted job: ``ray job submit --working-dir . -- python -m nvray.batch ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from nvray.batch.io import InputSpec, OutputWriter, check_output_path, output_schema, \
    validate_input
from nvray.config import EngineConfig, exposed_options
from nvray.options import Option
from nvray.sampling_params import SamplingParams

EXIT_BAD_INPUT = 2
_ENGINE = EngineConfig()  # the engine's defaults: the one source of each
_SUBMITTED_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray for `ray job submit` drivers


@dataclass
class BatchPlan:
    """Everything a run needs, checked before Ray starts."""

    input: InputSpec
    output: str
    output_format: str
    engine_kwargs: dict[str, Any]
    sampling_params: dict[str, Any]
    concurrency: int = 1
    batch_size: int = 64
    batches_per_engine: int = 2
    max_engine_restarts: int = 1
    task: str = "generate"  # or "embed"
    dimensions: int | None = None  # embed: Matryoshka truncation
    loras: dict[str, str] | None = None  # LoRA adapters by name (--lora-modules)
    default_lora: str | None = None  # the adapter of rows without a 'lora' (--lora)


@dataclass
class Summary:
    """Totals over the output rows; also checks that each input id comes back exactly once."""

    pending: set[Any]
    rows: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, table: Any) -> None:
        cols = table.to_pydict()
        for row_id in cols["id"]:
            if row_id not in self.pending:
                raise RuntimeError(f"output id {row_id!r} is not a pending input id; "
                                   "no output written")
            self.pending.discard(row_id)
        self.rows += table.num_rows
        self.errors += sum(e is not None for e in cols["error"])
        self.prompt_tokens += sum(t or 0 for t in cols["prompt_tokens"])
        self.completion_tokens += sum(t or 0 for t in cols.get("completion_tokens", ()))

    def check_complete(self) -> None:
        if self.pending:
            raise RuntimeError(f"{len(self.pending)} input rows got no output row (e.g. id "
                               f"{next(iter(self.pending))!r}); no output written")

    def format(self, wall_s: float, output: str, task: str = "generate") -> str:
        per_s = (lambda n: n / wall_s if wall_s > 0 else 0.0)  # noqa: E731
        head = f"nvray.batch: {self.rows} rows, {self.errors} errors -> {output}\n"
        if task == "embed":
            return (head + f"  prompt tokens {self.prompt_tokens}, wall time {wall_s:.1f} s, "
                    f"{per_s(self.rows):.1f} rows/s, {per_s(self.prompt_tokens):.1f} prompt "
                    "tokens/s")
        return (head + f"  prompt tokens {self.prompt_tokens}, completion tokens "
                f"{self.completion_tokens}, wall time {wall_s:.1f} s, "
                f"{per_s(self.completion_tokens):.1f} output tokens/s")


# ------------------------------------------------------------------------------ arguments
def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m nvray.batch",
                                description="Batch inference on Ray Data with nvray engines.")
    p.add_argument("--input", required=True, help="JSON Lines / Parquet file or directory")
    p.add_argument("--output", required=True, help="output file: .jsonl or .parquet")
    p.add_argument("--model", default=_ENGINE.model, help="checkpoint directory or 'tiny' (default)")
    p.add_argument("--concurrency", type=_positive_int, default=1,
                   help="engines in the pool (one Ray Data actor each)")
    p.add_argument("--batch-size", type=_positive_int, default=64,
                   help="rows per Ray Data batch; one batch's requests go to an engine at once")
    p.add_argument("--batches-per-engine", type=_positive_int, default=2,
                   help="batches an engine works on at the same time")
    p.add_argument("--max-engine-restarts", type=int, default=1,
                   help="new engines an actor may start after its engine died")
    p.add_argument("--task", default="generate", choices=["generate", "embed"],
                   help="'embed': each row's prompt becomes an embedding column (prefill only)")
    p.add_argument("--dimensions", type=_positive_int, default=None,
                   help="--task embed: keep this many values of each embedding (Matryoshka)")
    p.add_argument("--max-tokens", type=_positive_int, default=256)
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="every output follows this JSON schema (a .json file)")
    p.add_argument("--engine-options", type=_json_object, default={}, metavar="JSON",
                   help="any other EngineConfig option, e.g. '{\"cpu_kvcache_space_gib\": 1}'")
    _add_engine_flags(p.add_argument_group("engine options (EngineConfig)"))
    p.add_argument("--lora-modules", action="append", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) rows may name in a 'lora' column "
                        "(repeatable, or comma-separated)")
    p.add_argument("--lora", default=None, metavar="NAME",
                   help="the adapter of the rows that name none (default: the base model)")
    return p.parse_args(argv)


def _add_engine_flags(group: Any) -> None:
    """A flag per engine option EngineConfig exposes, with its default, help, bounds and
    choices: booleans as ``--x/--no-x``, objects as JSON."""
    for opt in exposed_options():
        flag, kind = "--" + opt.name.replace("_", "-"), opt.scalar_type
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=opt.default,
                               help=opt.help)
        elif kind is dict:
            group.add_argument(flag, type=_json_object, default=opt.default, metavar="JSON",
                               help=opt.help)
        else:
            choices = None if opt.choices is None else [c for c in opt.choices if c is not None]
            group.add_argument(flag, type=_bounded(kind, opt), default=opt.default,
                               choices=choices, help=opt.help)


def _bounded(kind: type, opt: Option) -> Any:
    """Parse a flag's text as ``kind`` within the option's bounds."""
    def parse(text: str) -> Any:
        value = kind(text)
        if not opt.within_bounds(value):
            raise argparse.ArgumentTypeError(f"{opt.allowed()}, got {value}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value"
    return parse


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(value).__name__}")
    return value


def sampling_params_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling parameters as a dict, validated (ValueError names a bad one)."""
    if args.task == "embed":
        if args.json_schema is not None:
            raise ValueError("--json-schema does not apply to --task embed")
        return {"max_tokens": 0, "pool": []}
    if args.dimensions is not None:
        raise ValueError("--dimensions applies to --task embed only")
    params = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
              "max_tokens": args.max_tokens, "min_tokens": args.min_tokens, "seed": args.seed,
              "stop": list(args.stop or ()), "ignore_eos": args.ignore_eos}
    if args.json_schema is not None:
        params["structured_outputs"] = {"json": _read_schema(args.json_schema)}
    checked = SamplingParams(**params)
    if checked.structured_outputs is not None:
        checked.structured_outputs.spec()  # a keyword that can't be enforced: refused now
    return params


def _read_schema(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise ValueError(f"--json-schema {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--json-schema {path}: not valid JSON ({e.msg}, line {e.lineno})") from None


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options as EngineConfig keyword arguments, validated."""
    kwargs = {"model": args.model, **{o.name: getattr(args, o.name) for o in exposed_options()}}
    doubled = sorted(set(args.engine_options) & set(kwargs))
    if doubled:
        raise ValueError(f"--engine-options {doubled}: each has a flag of its own; give it "
                         "as one")
    kwargs.update(args.engine_options)
    if args.lora_modules:
        kwargs["enable_lora"] = True
    EngineConfig.from_kwargs(**kwargs)
    return kwargs


def loras_from_args(args: argparse.Namespace) -> dict[str, str]:
    """``--lora-modules`` as name -> path (each a directory), and ``--lora`` among them."""
    from nvray.lora.adapter import CONFIG_FILE  # noqa: PLC0415

    loras = {}
    for item in (i for arg in args.lora_modules or () for i in arg.split(",") if i):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {item!r}: expected NAME=PATH")
        if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
            raise ValueError(f"--lora-modules {name}={path}: no {CONFIG_FILE} there (a PEFT "
                             "LoRA directory is expected)")
        loras[name] = os.path.abspath(path)
    if args.lora is not None and args.lora not in loras:
        raise ValueError(f"--lora {args.lora!r} is not among --lora-modules "
                         f"({sorted(loras) or 'none given'})")
    return loras


def build_plan(args: argparse.Namespace) -> BatchPlan:
    """Check the options and the whole input; raises ValueError naming the first problem."""
    if args.max_engine_restarts < 0:
        raise ValueError(f"--max-engine-restarts={args.max_engine_restarts} must be >= 0")
    engine_kwargs = engine_kwargs_from_args(args)
    sampling = sampling_params_from_args(args)
    if os.environ.get(_SUBMITTED_JOB_ENV) and not os.path.isabs(args.output):
        raise ValueError(f"--output {args.output!r}: give an absolute path in a submitted job "
                         "(its working directory is a temporary copy, deleted afterwards)")
    loras = loras_from_args(args)
    spec = validate_input(args.input, frozenset(loras))
    output, output_format = check_output_path(args.output, spec.files)
    return BatchPlan(input=spec, output=output, output_format=output_format,
                     engine_kwargs=engine_kwargs, sampling_params=sampling,
                     concurrency=args.concurrency, batch_size=args.batch_size,
                     batches_per_engine=args.batches_per_engine,
                     max_engine_restarts=args.max_engine_restarts, task=args.task,
                     dimensions=args.dimensions, loras=loras, default_lora=args.lora)


# ------------------------------------------------------------------------------ running
def check_cluster_fits(plan: BatchPlan) -> None:
    """Fail fast if the cluster cannot hold ``concurrency`` engines at once, or if what it has
    free now cannot (a job would otherwise wait minutes for a placement, then die)."""
    from nvray.runtime.cluster import cluster_has_gpus  # noqa: PLC0415
    from nvray.runtime.placement import check_engines_fit  # noqa: PLC0415

    config = EngineConfig.from_kwargs(**plan.engine_kwargs)
    use_gpu = config.device == "cuda" or (config.device == "auto" and cluster_has_gpus())
    try:
        check_engines_fit(config, use_gpu, plan.concurrency, free_now=True)
    except ValueError as e:
        raise ValueError(f"{e}; lower --concurrency, --tensor-parallel-size or "
                         "--num-cpus-per-rank, or free the cluster first") from None


def build_dataset(plan: BatchPlan) -> Any:
    """Read the input and map it through the pool of engine actors."""
    from ray.data import ActorPoolStrategy, DataContext  # noqa: PLC0415

    from nvray.batch.read import read_dataset  # noqa: PLC0415
    from nvray.batch.udf import GenerateBatch  # noqa: PLC0415

    DataContext.get_current().execution_options.preserve_order = True
    pool = ActorPoolStrategy(size=plan.concurrency,
                             max_concurrent_calls_per_actor=plan.batches_per_engine,
                             enable_true_multi_threading=True)
    return read_dataset(plan.input, plan.batch_size).map_batches(
        GenerateBatch, batch_size=plan.batch_size, batch_format="pyarrow", compute=pool,
        num_cpus=0, fn_constructor_kwargs={"engine_kwargs": plan.engine_kwargs,
                                           "sampling_params": plan.sampling_params,
                                           "max_engine_restarts": plan.max_engine_restarts,
                                           "dimensions": plan.dimensions,
                                           "loras": plan.loras,
                                           "default_lora": plan.default_lora})


def connect(plan: BatchPlan) -> None:
    """Join (or start) Ray and check that the engines fit; ValueError if they cannot."""
    from nvray.runtime.cluster import ensure_ray  # noqa: PLC0415

    ensure_ray()
    check_cluster_fits(plan)


def run(plan: BatchPlan) -> Summary:
    """Run the job and write the output; every input id must come back exactly once."""
    summary = Summary(pending=plan.input.ids)  # consumed: ids are checked off as rows arrive
    schema = output_schema(plan.input.id_type, plan.task)
    with OutputWriter(plan.output, plan.output_format, schema) as out:
        for table in build_dataset(plan).iter_batches(batch_format="pyarrow", batch_size=None):
            summary.add(table)
            out.write(table)
        summary.check_complete()
    return summary


def main(argv: list[str] | None = None) -> int:
    start = time.perf_counter()
    args = parse_args(argv)
    try:
        plan = build_plan(args)
        print(f"nvray.batch: {plan.input.num_rows} rows from {len(plan.input.files)} "
              f"{plan.input.format} file(s); {plan.concurrency} engine(s) of {args.model!r}",
              flush=True)
        connect(plan)
    except ValueError as e:
        print(f"nvray.batch: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    summary = run(plan)
    print(summary.format(time.perf_counter() - start, plan.output, plan.task), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
