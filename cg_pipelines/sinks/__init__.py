"""Where partition runs commit: the fenced Delta Lake sink (local directory or S3), in one of
two write modes: :class:`Append` (the default; the table is the history) or :class:`Merge`
(a MERGE by key; the table is each key's current row)."""

from cg_pipelines.core.write import Append, Merge
from cg_pipelines.sinks.delta import LINEAGE_PREFIX, PARTITION_COLUMN, DeltaSink, TableStats

__all__ = ["LINEAGE_PREFIX", "PARTITION_COLUMN", "Append", "DeltaSink", "Merge", "TableStats"]
