"""Writing rows into a Delta table: the schema a table is created with, the MERGE of
:class:`~cg_pipelines.core.write.Merge` mode (the batch fitted to the table's columns by
:func:`~cg_pipelines.sinks.rows.conform`), and the log errors that mean a stale snapshot.

Merge mode runs a Delta MERGE by key (``DeltaTable.merge`` with the commit's
``CommitProperties``, so the data change and the watermark are ONE Delta version). The batch is
first reduced to each key's last row in stream order; a key whose last row is a delete marker
is deleted. The merge matches keys within the batch's consumer-group partition
(``_partition = p`` in the predicate): delta-rs then reads and rewrites only that partition's
files, and merges of different partitions do not conflict.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable, PostCommitHookProperties
from deltalake.exceptions import CommitFailedError, DeltaError

from cg_pipelines.core.write import DELETE_COLUMN, Merge
from cg_pipelines.sinks.base import PARTITION_COLUMN
from cg_pipelines.sinks.rows import conform

__all__ = ["COMMIT_HOOKS", "cut_snapshot", "delta_schema", "delta_type", "merge_into"]

COMMIT_HOOKS = PostCommitHookProperties(create_checkpoint=True, cleanup_expired_logs=False)
"""delta-rs' post-commit hooks for every commit of the sink (data, empty, replace, compaction,
VACUUM): a checkpoint every ``delta.checkpointInterval`` versions, but no expired-log cleanup.
delta-rs' default runs that cleanup after each checkpoint and it lists the whole
``_delta_log``, so a commit's cost grew with the log's entries (delta-rs 1.6.6,
``bench/delta_log_cost.py``, an append with the default hooks: local disk 5.9 ms at 62 log
files, 83 ms at 3,340; moto S3 84 ms at 50, 520 ms at 1,127; docs/growth.md). The cleanup
is :meth:`DeltaMaintainer.maintain
<cg_pipelines.sinks.maintenance.DeltaMaintainer.maintain>`'s job, once per
``vacuum_interval_s``."""


def cut_snapshot(e: BaseException) -> bool:
    """Whether ``e`` is delta-rs 1.6.6 failing on a snapshot whose following log entries the
    log window deleted (:func:`~cg_pipelines.sinks.logwindow.clean_log`): a commit from it
    (``DeltaError: Invalid table version: <v>``) or a read of its own log segment, e.g.
    ``transaction_version`` (``Kernel error: File not found: ..._delta_log/<v>.json``).
    Nothing was written (``tests/months/test_log_cut_fence.py``): the snapshot is stale, and a
    fresh one decides the fence. A ``CommitFailedError`` (a conflict) is not this."""
    if not isinstance(e, DeltaError) or isinstance(e, CommitFailedError):
        return False
    msg = str(e)
    return "Invalid table version" in msg or ("File not found" in msg and "_delta_log" in msg)


def delta_type(t: pa.DataType) -> pa.DataType:
    """``t`` with nanosecond timestamps (also nested in structs/lists) turned into microseconds."""
    if pa.types.is_timestamp(t) and t.unit == "ns":
        return pa.timestamp("us", tz=t.tz)
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(delta_type(f.type)) for f in t])
    if pa.types.is_large_list(t):
        return pa.large_list(t.value_field.with_type(delta_type(t.value_type)))
    if pa.types.is_list(t):
        return pa.list_(t.value_field.with_type(delta_type(t.value_type)))
    return t


def delta_schema(schema: pa.Schema) -> pa.Schema:
    """The schema a table is created with: ``schema`` with timestamps at microsecond precision."""
    return pa.schema([f.with_type(delta_type(f.type)) for f in schema], metadata=schema.metadata)


def merge_into(dt: DeltaTable, table: pa.Table, mode: Merge, props: CommitProperties,
               where: str, hooks: PostCommitHookProperties | None = COMMIT_HOOKS) -> None:
    """MERGE ``table`` into snapshot ``dt`` by ``mode``'s key (see the module docstring),
    with post-commit ``hooks`` (``None``: delta-rs' defaults); ``where`` names the table in
    errors."""
    target = pa.schema(dt.schema().to_arrow())
    src = conform(mode.current(table), target, where, keep=[DELETE_COLUMN])
    on = [f"t.`{k}` = s.`{k}`" for k in mode.keys]
    if PARTITION_COLUMN in target.names and PARTITION_COLUMN in src.column_names:
        parts = pc.unique(src[PARTITION_COLUMN]).to_pylist()
        on.append(f"t.`{PARTITION_COLUMN}` = {int(parts[0])}" if len(parts) == 1 else
                  f"t.`{PARTITION_COLUMN}` = s.`{PARTITION_COLUMN}`")
    flag = f"s.`{DELETE_COLUMN}`"
    (dt.merge(src, " AND ".join(on), source_alias="s", target_alias="t",
              commit_properties=props, post_commithook_properties=hooks)
       .when_matched_delete(predicate=flag)
       .when_matched_update_all(predicate=f"NOT {flag}", except_cols=[DELETE_COLUMN])
       .when_not_matched_insert_all(predicate=f"NOT {flag}", except_cols=[DELETE_COLUMN])
       .execute())
