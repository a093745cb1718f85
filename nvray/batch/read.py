"""The Ray Data side of ``python -m nvray.batch``'s input: a validated input as a dataset.

Contract: ``read_dataset(spec, rows_per_block)`` gives a dataset whose rows have exactly
``nvray.batch.io.input_schema`` (``id``, ``prompt``, ``messages``; absent ones null), in input
order, in blocks of about ``rows_per_block`` rows so that every engine of a pool gets work.
Every task it runs asks for a fraction of a CPU: on a small host the engines' placement groups
may hold all but a fraction of the CPUs, and a 1-CPU task would then wait forever. (That is
why Parquet is read by ``ParquetRowsDatasource`` and not by ``ray.data.read_parquet``, whose
file listing and sampling tasks take a whole CPU.)
"""

from __future__ import annotations

from typing import Any, Iterator

import pyarrow as pa
import ray.data
from ray.data.datasource import FileBasedDatasource

from nvray.batch.io import PARQUET, InputSpec, input_schema

_READ_CPUS = 0.25
_MAX_BLOCKS = 10_000


def normalize_rows(table: pa.Table, id_type: pa.DataType) -> pa.Table:
    """``table`` with exactly the input schema: ids cast, absent columns null, messages
    reduced to role and content (so every block of a dataset has one schema)."""
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
    return pa.Table.from_arrays([table["id"].cast(id_type), prompt, messages], schema=schema)


class ParquetRowsDatasource(FileBasedDatasource):
    """Parquet files as rows of the input schema, one plain read task per file group."""

    def __init__(self, paths: list[str], id_type: pa.DataType) -> None:
        super().__init__(paths, partitioning=None)
        self._id_type = id_type

    def _read_stream(self, f: Any, path: str) -> Iterator[pa.Table]:
        import pyarrow.parquet as pq  # noqa: PLC0415

        pf = pq.ParquetFile(pa.BufferReader(f.read_buffer()))
        columns = [c for c in ("id", "prompt", "messages") if c in pf.schema_arrow.names]
        for batch in pf.iter_batches(columns=columns, batch_size=8192):
            yield normalize_rows(pa.Table.from_batches([batch]), self._id_type)


def read_dataset(spec: InputSpec, rows_per_block: int) -> Any:
    """The input's rows as a Ray Data dataset, in blocks of about ``rows_per_block`` rows."""
    num_blocks = min(_MAX_BLOCKS, max(1, -(-spec.num_rows // rows_per_block)))
    if spec.format == PARQUET:
        return ray.data.read_datasource(ParquetRowsDatasource(spec.files, spec.id_type),
                                        num_cpus=_READ_CPUS, override_num_blocks=num_blocks)
    import pyarrow.json as pajson  # noqa: PLC0415

    parse = pajson.ParseOptions(explicit_schema=input_schema(spec.id_type),
                                unexpected_field_behavior="ignore")
    return ray.data.read_json(spec.files, num_cpus=_READ_CPUS, partitioning=None,
                              override_num_blocks=num_blocks, parse_options=parse)
