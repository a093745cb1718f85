"""The Ray Data side of ``python -m nvray.batch``'s input: a validated input as a dataset.

Contract: ``read_dataset(spec, rows_per_block)`` gives a dataset whose rows have exactly
``nvray.batch.io.input_schema`` (``id``, ``prompt``, ``messages``, ``response_format`` as JSON
text, ``lora``; absent ones null), in input order, in blocks of about ``rows_per_block`` rows so that
every engine of a pool gets work. JSON Lines are parsed by ``json`` row by row (a
``response_format`` holds a free-form schema, which no Arrow type fits).
Every task it runs asks for a fraction of a CPU: on a small host the engines' placement groups
may hold all but a fraction of the CPUs, and a 1-CPU task would then wait forever. (That is
why Parquet is read by ``ParquetRowsDatasource`` and not by ``ray.data.read_parquet``, whose
file listing and sampling tasks take a whole CPU; JSON Lines go the same way.)
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Iterator

import pyarrow as pa
import ray.data
from ray.data.datasource import FileBasedDatasource

from nvray.batch.io import INPUT_COLUMNS, PARQUET, InputSpec, input_schema

_READ_CPUS = 0.25
_MAX_BLOCKS = 10_000


def normalize_rows(table: pa.Table, id_type: pa.DataType) -> pa.Table:
    """``table`` with exactly the input schema: ids cast, absent columns null, messages
    reduced to role and content, ``response_format`` as JSON text (so every block of a dataset
    has one schema)."""
    schema = input_schema(id_type)
    n = table.num_rows
    prompt = table["prompt"].cast(pa.string()) if "prompt" in table.column_names \
        else pa.nulls(n, pa.string())
    if "messages" in table.column_names:
        messages = pa.array([None if ms is None else
                             [{"role": m.get("role"), "content": m.get("content")} for m in ms]
                             for ms in table["messages"].to_pylist()],
                            type=schema.field("messages").type)
    else:
        messages = pa.nulls(n, schema.field("messages").type)
    formats = _json_text(table["response_format"]) if "response_format" in table.column_names \
        else pa.nulls(n, pa.string())
    lora = table["lora"].cast(pa.string()) if "lora" in table.column_names \
        else pa.nulls(n, pa.string())
    return pa.Table.from_arrays([table["id"].cast(id_type), prompt, messages, formats, lora],
                                schema=schema)


def _json_text(column: Any) -> pa.Array:
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        return column.cast(pa.string())
    return pa.array([None if v is None else json.dumps(v) for v in column.to_pylist()],
                    type=pa.string())


class JsonlRowsDatasource(FileBasedDatasource):
    """JSON Lines files as rows of the input schema, parsed by ``json`` (validated before)."""

    def __init__(self, paths: list[str], id_type: pa.DataType) -> None:
        super().__init__(paths, partitioning=None)
        self._id_type = id_type

    def _read_stream(self, f: Any, path: str) -> Iterator[pa.Table]:
        lines = (line for line in f.read_buffer().to_pybytes().splitlines() if line.strip())
        while chunk := list(itertools.islice(lines, 8192)):
            rows = [json.loads(line) for line in chunk]
            columns = {c: [row.get(c) for row in rows]
                       for c in ("id", "prompt", "messages", "lora")}
            formats = [row.get("response_format") for row in rows]
            columns["response_format"] = pa.array(
                [v if v is None or isinstance(v, str) else json.dumps(v) for v in formats],
                type=pa.string())
            yield normalize_rows(pa.table(columns), self._id_type)


class ParquetRowsDatasource(FileBasedDatasource):
    """Parquet files as rows of the input schema, one plain read task per file group."""

    def __init__(self, paths: list[str], id_type: pa.DataType) -> None:
        super().__init__(paths, partitioning=None)
        self._id_type = id_type

    def _read_stream(self, f: Any, path: str) -> Iterator[pa.Table]:
        import pyarrow.parquet as pq  # noqa: PLC0415

        pf = pq.ParquetFile(pa.BufferReader(f.read_buffer()))
        columns = [c for c in INPUT_COLUMNS if c in pf.schema_arrow.names]
        for batch in pf.iter_batches(columns=columns, batch_size=8192):
            yield normalize_rows(pa.Table.from_batches([batch]), self._id_type)


def read_dataset(spec: InputSpec, rows_per_block: int) -> Any:
    """The input's rows as a Ray Data dataset, in blocks of about ``rows_per_block`` rows."""
    num_blocks = min(_MAX_BLOCKS, max(1, -(-spec.num_rows // rows_per_block)))
    source = ParquetRowsDatasource if spec.format == PARQUET else JsonlRowsDatasource
    return ray.data.read_datasource(source(spec.files, spec.id_type), num_cpus=_READ_CPUS,
                                    override_num_blocks=num_blocks)
