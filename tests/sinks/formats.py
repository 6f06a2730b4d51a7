"""The sink formats the conformance suite (:mod:`tests.sinks.test_conformance`) runs over: one
class per format, each making a new table and a second handle on it (what a zombie holder has).
A new format is one more class here and one more entry in :data:`FORMATS`."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from cg_pipelines.core.write import Merge
from cg_pipelines.sinks.base import TableSink
from cg_pipelines.sinks.delta import DeltaSink
from cg_pipelines.sinks.iceberg import IcebergSink
from cg_pipelines.sinks.iceberg_read import sqlite_wal
from cg_pipelines.testing import MemorySink


class Format:
    """A sink format: :meth:`make` a sink over a new table under ``root``; :meth:`reopen` another
    sink object over the same table (a second process's, as a zombie holder has)."""

    name = "?"

    def make(self, root: Path, *, schema: pa.Schema | None = None,
             write: Merge | None = None) -> TableSink:
        raise NotImplementedError

    def reopen(self, sink: TableSink) -> TableSink:
        raise NotImplementedError


class DeltaFormat(Format):
    """Delta Lake on the local disk."""

    name = "delta"

    def make(self, root: Path, *, schema: pa.Schema | None = None,
             write: Merge | None = None) -> TableSink:
        return DeltaSink(str(root / "table"), schema=schema, write=write)

    def reopen(self, sink: TableSink) -> TableSink:
        return DeltaSink(sink.uri, write=sink.write)


class IcebergFormat(Format):
    """Iceberg through pyiceberg's SQL catalog on SQLite, data on the local disk (a second
    sink shares the catalog object and holds table states of its own)."""

    name = "iceberg"

    def make(self, root: Path, *, schema: pa.Schema | None = None,
             write: Merge | None = None) -> TableSink:
        (root / "wh").mkdir(parents=True)
        sqlite_wal(str(root / "catalog.db"))
        props = {"type": "sql", "uri": f"sqlite:///{root / 'catalog.db'}",
                 "warehouse": f"file://{root / 'wh'}", "init_catalog_tables": "true"}
        return IcebergSink("cg.table", catalog=props, schema=schema, write=write)

    def reopen(self, sink: TableSink) -> TableSink:
        assert isinstance(sink, IcebergSink)
        return IcebergSink(sink.identifier, catalog=sink.catalog, write=sink.write)


class MemoryFormat(Format):
    """:class:`cg_pipelines.testing.MemorySink`: the table is the object, so every holder
    shares it."""

    name = "memory"

    def make(self, root: Path, *, schema: pa.Schema | None = None,
             write: Merge | None = None) -> TableSink:
        return MemorySink("table", schema=schema, write=write)

    def reopen(self, sink: TableSink) -> TableSink:
        return sink


FORMATS: list[Format] = [DeltaFormat(), IcebergFormat(), MemoryFormat()]
