"""Where partition runs commit: the fenced Delta Lake sink (local directory or S3)."""

from cg_pipelines.sinks.delta import PARTITION_COLUMN, DeltaSink, TableStats

__all__ = ["PARTITION_COLUMN", "DeltaSink", "TableStats"]
