"""Input and output of ``python -m nvray.batch``: find, validate, read and write row files.

Contract:

- An input is a JSON Lines file (``.jsonl`` or ``.json``, one object per line; blank lines are
  skipped), a Parquet file (``.parquet``), or a directory of files of one of those formats.
- Every row has an ``id`` (a string, or an integer; one kind for the whole input, unique) and
  exactly one of ``prompt`` (a string) or ``messages`` (a non-empty list of ``{role, content}``
  string pairs); it may have a ``response_format`` (OpenAI's: ``text``, ``json_object`` or
  ``json_schema``; an object, or its JSON text) for its own output, in place of the job's
  ``--json-schema``, and a ``lora`` (the name of an adapter the job declares with
  ``--lora-modules``, in place of the job's ``--lora``). Other columns are ignored.
- ``validate_input`` makes one plain pass over the input, before anything runs on Ray, and
  raises ``ValueError`` naming the file and the row (``line N`` for JSON Lines, 1-based;
  ``row N`` for Parquet, 1-based) of the first problem: bad JSON, a row that is not an object,
  a missing or ill-typed ``id``, ``prompt`` or ``messages``, a duplicate id, a
  ``response_format`` that is malformed or asks for what cannot be enforced (the field named),
  a ``lora`` the job does not declare.
- ``input_schema`` is the schema rows are read with (see ``nvray.batch.read``): ``id``,
  ``prompt``, ``messages``, ``response_format`` (JSON text), ``lora``; absent ones are null.
- An output is one JSON Lines (``.jsonl``/``.json``) or Parquet (``.parquet``) file with the
  columns of ``output_schema``; ``OutputWriter`` writes it to a temporary file next to the
  target and renames it into place only when the whole job succeeded.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterator

import pyarrow as pa

from nvray.structured_outputs import ResponseFormat, StructuredOutputsParams

JSONL, PARQUET = "jsonl", "parquet"
_EXTENSIONS = {".jsonl": JSONL, ".json": JSONL, ".parquet": PARQUET}
_INT64 = (-(2**63), 2**63 - 1)


@dataclass
class InputSpec:
    """A validated input: its files, their format, the ids' Arrow type, and the ids."""

    files: list[str]
    format: str
    id_type: pa.DataType = field(default_factory=pa.string)
    ids: set[Any] = field(default_factory=set)
    num_rows: int = 0


# ------------------------------------------------------------------------------ formats
def format_of(path: str, what: str) -> str:
    """The format ('jsonl' or 'parquet') that a file's extension names."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in _EXTENSIONS:
        raise ValueError(f"{what} {path!r}: unknown extension {ext!r}; use one of "
                         f"{sorted(_EXTENSIONS)}")
    return _EXTENSIONS[ext]


def find_input_files(path: str) -> tuple[str, list[str]]:
    """The format and the sorted absolute file list of an input file or directory."""
    path = os.path.abspath(path)
    if os.path.isfile(path):
        return format_of(path, "input"), [path]
    if not os.path.isdir(path):
        raise ValueError(f"input {path!r} does not exist")
    names = sorted(n for n in os.listdir(path) if not n.startswith((".", "_"))
                   and os.path.splitext(n)[1].lower() in _EXTENSIONS)
    files = [os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n))]
    if not files:
        raise ValueError(f"input directory {path!r} has no {sorted(_EXTENSIONS)} files")
    formats = {format_of(f, "input") for f in files}
    if len(formats) > 1:
        raise ValueError(f"input directory {path!r} mixes formats {sorted(formats)}; use one")
    return formats.pop(), files


def check_output_path(path: str, input_files: list[str]) -> tuple[str, str]:
    """The absolute output path and its format; its directory must exist."""
    path = os.path.abspath(path)
    fmt = format_of(path, "output")
    if os.path.isdir(path):
        raise ValueError(f"output {path!r} is a directory; name a file")
    if not os.path.isdir(os.path.dirname(path)):
        raise ValueError(f"output directory {os.path.dirname(path)!r} does not exist")
    if path in input_files:
        raise ValueError(f"output {path!r} is also an input file")
    return path, fmt


# --------------------------------------------------------------------------- validation
def _check_id(value: Any, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"{where}: 'id' must be a string or an integer, got {value!r}")
    if isinstance(value, str) and not value:
        raise ValueError(f"{where}: 'id' is an empty string")
    if isinstance(value, int) and not _INT64[0] <= value <= _INT64[1]:
        raise ValueError(f"{where}: 'id' {value} does not fit in 64 bits")


def _check_messages(messages: Any, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of "
                         "{'role': ..., 'content': ...} objects")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: messages[{i}] must be an object with string 'role' "
                             f"and 'content', got {m!r}")


def check_row(row: Any, where: str, loras: frozenset[str] = frozenset()) -> Any:
    """Check one row; returns its id. ``where`` names the row in error messages; ``loras``:
    the adapter names the job declares."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if row.get("id") is None:
        raise ValueError(f"{where}: row has no 'id'")
    _check_id(row["id"], where)
    prompt, messages = row.get("prompt"), row.get("messages")
    if prompt is None and messages is None:
        raise ValueError(f"{where}: row {row['id']!r} has neither 'prompt' nor 'messages'")
    if prompt is not None and messages is not None:
        raise ValueError(f"{where}: row {row['id']!r} has both 'prompt' and 'messages'; "
                         "give one")
    if prompt is not None and not isinstance(prompt, str):
        raise ValueError(f"{where}: 'prompt' must be a string, got {type(prompt).__name__}")
    if messages is not None:
        _check_messages(messages, where)
    if row.get("response_format") is not None:
        row_constraint(row["response_format"], where)
    lora = row.get("lora")
    if lora is not None and (not isinstance(lora, str) or lora not in loras):
        raise ValueError(f"{where}: row {row['id']!r} names LoRA adapter {lora!r}, which "
                         f"--lora-modules does not declare (declared: {sorted(loras) or 'none'})")
    return row["id"]


def row_constraint(response_format: Any, where: str = "") -> StructuredOutputsParams | None:
    """A row's ``response_format`` (an object or its JSON text) as the constraint it asks for
    (None: ``text``), checked as far as it can be without the model: ValueError naming
    ``where`` and the field."""
    try:
        constraint = ResponseFormat.parse(response_format).constraint()
        if constraint is not None:
            constraint.spec()
    except ValueError as e:
        message = str(e) if str(e).startswith("response_format") else f"response_format: {e}"
        raise ValueError(f"{where}: {message}" if where else message) from None
    return constraint


def _jsonl_rows(path: str) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object) for each non-blank line."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: line {n}: not UTF-8 ({e.reason})") from None
            if not line:
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {n}: invalid JSON: {e.msg} "
                                 f"(column {e.colno})") from None


def _parquet_rows(path: str) -> Iterator[tuple[int, Any]]:
    """(row number, row dict) for each row."""
    import pyarrow.parquet as pq  # noqa: PLC0415

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a readable Parquet file: {e}") from None
    names = set(pf.schema_arrow.names)
    if "id" not in names:
        raise ValueError(f"{path}: has no 'id' column (columns: {sorted(names)})")
    if not names & {"prompt", "messages"}:
        raise ValueError(f"{path}: has neither a 'prompt' nor a 'messages' column")
    columns = [c for c in INPUT_COLUMNS if c in names]
    n = 0
    for batch in pf.iter_batches(columns=columns, batch_size=4096):
        for row in batch.to_pylist():
            n += 1
            yield n, row


def validate_input(path: str, loras: frozenset[str] = frozenset()) -> InputSpec:
    """One pass over the input: every row checked (``loras``: the adapter names declared),
    ids unique and of one kind."""
    fmt, files = find_input_files(path)
    rows, unit = (_jsonl_rows, "line") if fmt == JSONL else (_parquet_rows, "row")
    first_seen: dict[Any, tuple[int, int]] = {}  # id -> (file index, row number)
    kind: type | None = None
    for i, file in enumerate(files):
        for n, row in rows(file):
            where = f"{file}: {unit} {n}"
            rid = check_row(row, where, loras)
            if kind is None:
                kind = type(rid)
            elif type(rid) is not kind:
                raise ValueError(f"{where}: id {rid!r} is a {type(rid).__name__} but earlier ids "
                                 f"are {kind.__name__}s; use one kind of id")
            if rid in first_seen:
                fi, fn = first_seen[rid]
                raise ValueError(f"{where}: duplicate id {rid!r} "
                                 f"(first at {files[fi]}: {unit} {fn})")
            first_seen[rid] = (i, n)
    if not first_seen:
        raise ValueError(f"input {path!r} has no rows")
    id_type = pa.int64() if kind is int else pa.string()
    return InputSpec(files=files, format=fmt, id_type=id_type, ids=set(first_seen),
                     num_rows=len(first_seen))


# ------------------------------------------------------------------------------ reading
INPUT_COLUMNS = ("id", "prompt", "messages", "response_format", "lora")


def input_schema(id_type: pa.DataType) -> pa.Schema:
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    return pa.schema([("id", id_type), ("prompt", pa.string()), ("messages", pa.list_(message)),
                      ("response_format", pa.string()), ("lora", pa.string())])


# ------------------------------------------------------------------------------ writing
def output_schema(id_type: pa.DataType, task: str = "generate") -> pa.Schema:
    if task == "embed":
        return pa.schema([("id", id_type), ("embedding", pa.list_(pa.float32())),
                          ("prompt_tokens", pa.int64()), ("error", pa.string())])
    return pa.schema([("id", id_type), ("text", pa.string()), ("finish_reason", pa.string()),
                      ("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()),
                      ("error", pa.string())])


class OutputWriter:
    """Writes output tables to ``path`` (JSON Lines or Parquet) through a temporary file.

    Used as a context manager: the file appears at ``path`` only if the block exits cleanly.
    """

    def __init__(self, path: str, fmt: str, schema: pa.Schema) -> None:
        self.path, self.fmt, self.schema = path, fmt, schema
        name = f".{os.path.basename(path)}.{os.getpid()}.tmp"
        self.tmp = os.path.join(os.path.dirname(path), name)
        self._file: Any = None
        self._parquet: Any = None

    def __enter__(self) -> "OutputWriter":
        if self.fmt == PARQUET:
            import pyarrow.parquet as pq  # noqa: PLC0415

            self._parquet = pq.ParquetWriter(self.tmp, self.schema)
        else:
            self._file = open(self.tmp, "w", encoding="utf-8")
        return self

    def write(self, table: pa.Table) -> None:
        table = table.select(list(self.schema.names)).cast(self.schema)
        if self._parquet is not None:
            self._parquet.write_table(table)
            return
        for row in table.to_pylist():
            self._file.write(json.dumps(row, ensure_ascii=False) + "\n")

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._parquet is not None:
            self._parquet.close()
        if self._file is not None:
            self._file.close()
        if exc_type is None:
            os.replace(self.tmp, self.path)
        elif os.path.exists(self.tmp):
            os.remove(self.tmp)
