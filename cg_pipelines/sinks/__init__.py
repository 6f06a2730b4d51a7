"""Where runs commit: the fenced Delta Lake sink (local directory or S3), in one of two write
modes: :class:`Append` (the default; the table is the history) or :class:`Merge` (a MERGE by
key; the table is each key's current row); and the fenced Apache Iceberg sink
(:class:`IcebergSink`, the ``iceberg`` extra), imported lazily: importing the Delta sink never
imports pyiceberg. The contract every sink fulfils (and the engine and the Dagster layer rely
on), :class:`TableSink`, and its one optional capability, :class:`MaintainedSink`, are in
:mod:`cg_pipelines.sinks.base`; an in-memory sink for users' tests is
:class:`cg_pipelines.testing.MemorySink`."""

from typing import Any

from cg_pipelines.core.write import Append, Merge
from cg_pipelines.sinks.base import (
    PARTITION_COLUMN,
    FenceConflictError,
    Fences,
    MaintainedSink,
    TableSink,
    TableStats,
)
from cg_pipelines.sinks.delta import LINEAGE_PREFIX, DeltaSink

__all__ = ["LINEAGE_PREFIX", "PARTITION_COLUMN", "Append", "DeltaSink", "FenceConflictError",
           "Fences", "IcebergSink", "MaintainedSink", "Merge", "TableSink",
           "TableStats"]


def __getattr__(name: str) -> Any:
    """``IcebergSink`` on first use (pyiceberg is an optional dependency)."""
    if name == "IcebergSink":
        from cg_pipelines.sinks.iceberg import IcebergSink

        return IcebergSink
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
