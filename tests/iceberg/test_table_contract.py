"""The table contract as the Dagster layer speaks it (issue 41): both warehouses make sinks that
are :class:`TableSink`\\ s, which report the same metadata keys whatever the format (no Delta
name on an Iceberg table), and so does any other table sink (the memory sink of users' tests);
the IO manager is the warehouse's. What every sink does with commits, fences and reads is the
conformance suite's (``tests/sinks/test_conformance.py``)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from cg_pipelines.dagster.io_manager import (
    DeltaTableIOManager,
    IcebergTableIOManager,
    table_io_manager,
)
from cg_pipelines.dagster.run import table_metadata
from cg_pipelines.dagster.warehouse import (
    DeltaWarehouseResource,
    IcebergWarehouseResource,
    Warehouse,
)
from cg_pipelines.sinks.base import TableSink
from cg_pipelines.testing import MemorySink

SCHEMA = pa.schema([("key", pa.string()), ("seq", pa.int64()), ("_partition", pa.int64())])


def _warehouse(fmt: str, root: Path) -> Warehouse:
    if fmt == "delta":
        return DeltaWarehouseResource(root=str(root))
    return IcebergWarehouseResource(warehouse=str(root))


def _sink(fmt: str, root: Path) -> TableSink:
    if fmt == "memory":
        return MemorySink("t")
    wh = _warehouse(fmt, root)
    sink = wh.sink("t")
    assert sink.table_format == wh.table_format
    return sink


def _rows(p: int, n: int, seq0: int) -> pa.Table:
    return pa.table({"key": [f"k{i}" for i in range(n)], "seq": list(range(seq0, seq0 + n)),
                     "_partition": [p] * n}, schema=SCHEMA)


@pytest.mark.parametrize("fmt", ["delta", "iceberg", "memory"])
def test_a_table_sink_reports_the_same_metadata_keys(fmt: str, tmp_path: Path) -> None:
    sink = _sink(fmt, tmp_path / "lake")
    assert isinstance(sink, TableSink) and sink.table_format == fmt
    md = table_metadata(sink, 0, "t")
    assert md == {"dagster/table_name": "t", "dagster/uri": sink.uri,
                  "dagster/storage_kind": fmt}
    sink.watermark("s/g/0")
    sink.commit(_rows(0, 3, 1), {"s/g/0": (0, 3)})
    sink.watermark("s/g/1")
    sink.commit(_rows(1, 2, 1), {"s/g/1": (0, 2)})
    md = table_metadata(sink, 1, "t")
    assert md["dagster/storage_kind"] == fmt
    assert md["dagster/row_count"].value == 5 and md["dagster/partition_row_count"].value == 2
    assert [c.name for c in md["dagster/column_schema"].schema.columns] == SCHEMA.names
    assert md["table_version"] >= 1
    assert not [k for k in md if "delta" in k.lower()]


def test_the_io_manager_is_the_warehouses(tmp_path: Path) -> None:
    delta = table_io_manager(DeltaWarehouseResource(root=str(tmp_path / "d")))
    iceberg = table_io_manager(IcebergWarehouseResource(warehouse=str(tmp_path / "i")))
    assert isinstance(delta, DeltaTableIOManager)
    assert isinstance(iceberg, IcebergTableIOManager)
