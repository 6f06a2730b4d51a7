"""Fenced commits into an Iceberg table: :class:`IcebergWriter`, the write part of an
:class:`~cg_pipelines.sinks.iceberg.IcebergSink` (watermark reads, commits, partition
replaces, table creation). The fencing rules are the sink's (:mod:`cg_pipelines.sinks.iceberg`).

Units: watermarks are stream sequences (``int``); snapshot ids are pyiceberg's.
"""

from __future__ import annotations

import random
import threading
import time
import warnings
from collections.abc import Iterable, Mapping
from typing import Final

import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import (
    CommitFailedException,
    NamespaceAlreadyExistsError,
    TableAlreadyExistsError,
)
from pyiceberg.expressions import AlwaysTrue, And, BooleanExpression
from pyiceberg.table import Table

from cg_pipelines.core.errors import ContractError, UsageError
from cg_pipelines.core.write import DELETE_COLUMN, Append, Merge
from cg_pipelines.sinks.base import PARTITION_COLUMN, FenceConflictError, Fences, check_fences
from cg_pipelines.sinks.iceberg_expr import equal_to, is_in
from cg_pipelines.sinks.iceberg_read import (
    WATERMARK_PREFIX,
    IcebergReader,
    key_tuples,
    moved,
    optional_schema,
    scan,
    watermark_of,
)
from cg_pipelines.sinks.iceberg_view import commit_view
from cg_pipelines.sinks.lineage import CommitLineage
from cg_pipelines.sinks.rows import conform, current_of

__all__ = ["IN_PRUNE_LIMIT", "MANIFEST_MERGE", "IcebergWriter"]

_NO_RETRY: Final = {"commit.retry.num-retries": "0"}

MANIFEST_MERGE: Final = {"commit.manifest-merge.enabled": "true",
                         "commit.manifest.min-count-to-merge": "8"}
"""Table properties the sink sets on the tables it creates or first writes to (unless the
table already sets them): pyiceberg's merge append. Its default fast append writes one
manifest per commit and merges none (pyiceberg 0.12, ``_FastAppendFiles``), so between two
compactions of a partition the manifest list grew by one per commit and every scan, state
read and compaction check read them all; a merge append folds the manifests into one once 8
of them (a 8 MiB bin, ``commit.manifest.target-size-bytes``) are there. Same snapshot
producer otherwise (``AssertRefSnapshotId``: the fence is unchanged)."""

IN_PRUNE_LIMIT: Final = 200
"""Merge batches with more distinct keys than this rewrite their partition whole (pyiceberg
0.12's metrics evaluators prune no data file by an IN predicate of more than 200 values)."""


def _backoff(attempt: int) -> None:
    """A short jittered pause before retrying a commit lost to another partition."""
    time.sleep(random.uniform(0.005, 0.02 * min(attempt + 1, 10)))


def _missing_properties(tbl: Table) -> dict[str, str]:
    """The table properties the sink's commits need and ``tbl`` lacks: pyiceberg's retry off
    (the fence), and :data:`MANIFEST_MERGE`'s where the table sets nothing of its own."""
    props = tbl.properties
    missing = {k: v for k, v in _NO_RETRY.items() if props.get(k) != v}
    missing.update({k: v for k, v in MANIFEST_MERGE.items() if k not in props})
    return missing


class IcebergWriter:
    """The write part of an :class:`~cg_pipelines.sinks.iceberg.IcebergSink`: every public
    method is the sink's of the same name (documented there in full). It holds, per app id,
    the table state the app id's last watermark read or commit left (the base of its next
    commit)."""

    def __init__(self, catalog: Catalog, identifier: str, reader: IcebergReader,
                 write: Append | Merge, lineage: CommitLineage, *, schema: pa.Schema | None,
                 commit_retries: int, metadata_versions: int) -> None:
        """
        Args:
            catalog / identifier: the table's catalog and ``namespace.table``.
            reader: the sink's reader (its ``load``/``require``).
            write: the write mode. lineage: the snapshot summaries.
            schema / commit_retries / metadata_versions: as the sink's.
        """
        self._catalog = catalog
        self._ident = identifier
        self._reader = reader
        self._write = write
        self._lineage = lineage
        self._schema = schema
        self._retries = commit_retries
        self._metadata_versions = metadata_versions
        self._lock = threading.Lock()
        self._tables: dict[str, Table] = {}
        self._snapshots: list[int] = []
        self.last_rows_written: int | None = None
        self.commit_retries_used = 0

    @property
    def snapshots_written(self) -> list[int]:
        """Snapshot ids this writer committed (the last snapshot of each commit)."""
        with self._lock:
            return list(self._snapshots)

    def forget(self, app_id: str) -> None:
        """Drop the table state held for ``app_id`` (stale after a compaction): its next
        commit loads the latest."""
        with self._lock:
            self._tables.pop(app_id, None)

    # ---------------------------------------------------------------- watermarks

    def watermark(self, app_id: str) -> int:
        """:meth:`IcebergSink.watermark <cg_pipelines.sinks.iceberg.IcebergSink.watermark>`."""
        tbl = self._reader.load()
        if tbl is None:
            return 0
        with self._lock:
            self._tables[app_id] = tbl
        return watermark_of(tbl, app_id)

    def watermarks(self, app_ids: Iterable[str]) -> dict[str, int]:
        """:meth:`IcebergSink.watermarks <cg_pipelines.sinks.iceberg.IcebergSink.watermarks>`."""
        tbl = self._reader.load()
        return {a: (watermark_of(tbl, a) if tbl is not None else 0) for a in app_ids}

    # ---------------------------------------------------------------- commits

    def commit(self, table: pa.Table | None, fences: Fences,
               markers: Mapping[str, int] | None = None, *,
               lineage: Mapping[str, object] | None = None) -> None:
        """:meth:`IcebergSink.commit <cg_pipelines.sinks.iceberg.IcebergSink.commit>`."""
        check_fences(fences)
        app_id = next(iter(fences))
        version = fences[app_id][1]
        with self._lock:
            tbl = self._tables.get(app_id)
        if tbl is None or moved(tbl, fences) is not None:
            tbl = self._reader.load()
        if tbl is None:
            tbl = self._first_table(table, fences)
        empty = table is None or table.num_rows == 0
        merge = isinstance(self._write, Merge) and not empty
        summary = self._lineage.commit(app_id, version, "merge" if merge else (
            "empty" if empty else "append"), lineage)
        props = {**{WATERMARK_PREFIX + a: str(v) for a, (_, v) in fences.items()},
                 **{WATERMARK_PREFIX + k: str(v) for k, v in (markers or {}).items()}}
        for attempt in range(self._retries + 1):
            tbl = self.no_pyiceberg_retry(tbl)
            conflict = moved(tbl, fences)
            if conflict is not None:
                with self._lock:
                    self._tables[app_id] = tbl
                raise FenceConflictError(*conflict)
            # built on THIS table state (a partition rewrite reads the partition's rows)
            target = tbl.schema().as_arrow()
            delete: BooleanExpression | None = None
            if empty:
                rows = target.empty_table()
            elif merge:
                assert table is not None
                rows, delete = self._merge_rows(tbl, table, target)
            else:
                assert table is not None
                rows = conform(table, target, self._ident)
            try:
                view = commit_view(tbl)  # the same commit, without copying old snapshots
                with view.transaction() as txn:
                    txn.set_properties(props)
                    if delete is not None:
                        with warnings.catch_warnings():  # "Delete operation did not match"
                            warnings.simplefilter("ignore", UserWarning)
                            txn.overwrite(rows, overwrite_filter=delete,
                                          snapshot_properties=summary)
                    else:
                        txn.append(rows, snapshot_properties=summary)
                tbl = view  # the catalog's full new metadata
                break
            except CommitFailedException:
                if attempt == self._retries:
                    raise
                self.commit_retries_used += 1
                _backoff(attempt)
                tbl = self._reader.require()
        self._after_commit(tbl, app_id)

    def _first_table(self, table: pa.Table | None, fences: Fences) -> Table:
        """The table a first commit creates (from ``table``'s schema, else the sink's), or
        a :class:`FenceConflictError` when a fence expects a watermark there is no table
        for."""
        if any(exp for exp, _ in fences.values()):
            first = next(a for a, (exp, _) in fences.items() if exp)
            raise FenceConflictError(first, fences[first][0], 0)
        schema = table.schema if table is not None and table.num_columns else self._schema
        if schema is None:
            raise UsageError(f"{self._ident}: no table yet and no schema to create it "
                             "with: pass schema= or call ensure_table() first")
        if isinstance(self._write, Merge) and table is not None and table.num_rows:
            self._write.check(table)
            schema = pa.schema([f for f in schema if f.name != DELETE_COLUMN])
        self.ensure_table(schema)
        return self._reader.require()

    def _merge_rows(self, tbl: Table, table: pa.Table, target: pa.Schema
                    ) -> tuple[pa.Table, BooleanExpression]:
        """Merge mode: the rows to append and the delete filter of one batch, against table
        state ``tbl``."""
        assert isinstance(self._write, Merge)
        cur = self._write.current(table)
        live = cur.filter(pc.invert(cur[DELETE_COLUMN])).drop_columns([DELETE_COLUMN])
        rows = conform(live, target, self._ident)
        part: BooleanExpression = AlwaysTrue()
        if PARTITION_COLUMN in target.names and PARTITION_COLUMN in cur.column_names:
            parts = pc.unique(cur[PARTITION_COLUMN]).to_pylist()
            if len(parts) != 1:
                raise ContractError(f"{self._ident}: a merge batch holds partitions {parts}")
            part = equal_to(PARTITION_COLUMN, int(parts[0]))
        keys = self._write.keys
        if len(keys) == 1 and 0 < cur.num_rows <= IN_PRUNE_LIMIT:
            return rows, And(part, is_in(keys[0], cur[keys[0]].to_pylist()))
        # Many keys (pyiceberg prunes no file by an IN of more than IN_PRUNE_LIMIT values, so
        # it would rewrite every file anyway) or a composite key: rewrite the partition whole,
        # current rows of other keys kept; it is then one file again.
        old = scan(tbl, part, None)
        if old.num_rows:
            mine = pc.is_in(key_tuples(old, keys), value_set=key_tuples(cur, keys))
            kept = conform(old.filter(pc.invert(mine)), target, self._ident)
            rows = pa.concat_tables([kept, rows])
        return rows, part

    def _after_commit(self, tbl: Table, app_id: str) -> None:
        """Remember ``tbl`` — pyiceberg updated it in place to the metadata our commit made
        (no reload) — as the base of ``app_id``'s next commit."""
        snap = tbl.current_snapshot()
        with self._lock:
            self._tables[app_id] = tbl
            if snap is not None:
                self._snapshots.append(snap.snapshot_id)

    # ---------------------------------------------------------------- table management

    def ensure_table(self, schema: pa.Schema) -> bool:
        """:meth:`IcebergSink.ensure_table
        <cg_pipelines.sinks.iceberg.IcebergSink.ensure_table>`."""
        ns = self._ident.rsplit(".", 1)[0]
        try:
            self._catalog.create_namespace(ns)
        except NamespaceAlreadyExistsError:
            pass
        if self._reader.load() is not None:
            return False
        schema = optional_schema(schema)
        props = {**_NO_RETRY, **MANIFEST_MERGE,
                 "write.metadata.delete-after-commit.enabled": "true",
                 "write.metadata.previous-versions-max": str(self._metadata_versions)}
        try:
            txn = self._catalog.create_table_transaction(self._ident, schema=schema,
                                                         properties=props)
            if PARTITION_COLUMN in schema.names:
                with txn.update_spec() as spec:
                    spec.add_identity(PARTITION_COLUMN)
            txn.commit_transaction()
        except (TableAlreadyExistsError, CommitFailedException):
            if self._reader.load() is None:
                raise
            return False
        return True

    def no_pyiceberg_retry(self, tbl: Table) -> Table:
        """``tbl``, or its fresh state after setting ``commit.retry.num-retries=0`` (and
        :data:`MANIFEST_MERGE`'s properties the table does not set) on a table created
        elsewhere or by an older sink (one property commit; lost races are retried).

        Raises:
            CommitFailedException: 20 property commits in a row lost their race.
        """
        missing = _missing_properties(tbl)
        if not missing:
            return tbl
        for _ in range(20):
            try:
                with tbl.transaction() as txn:
                    txn.set_properties(missing)
                return self._reader.require()
            except CommitFailedException:
                tbl = self._reader.require()
                missing = _missing_properties(tbl)
                if not missing:
                    return tbl
        raise CommitFailedException(f"{self._ident}: set commit.retry.num-retries=0 on the "
                                    "table (the fence needs pyiceberg's blind retry off) and "
                                    "commit again")

    def replace_partition(
        self, data: pa.RecordBatchReader, partition: int, app_id: str, expected: int,
        markers: Mapping[str, int] | None = None, *,
        lineage: Mapping[str, object] | None = None,
        fenced: Mapping[str, int] | None = None,
    ) -> int:
        """:meth:`IcebergSink.replace_partition
        <cg_pipelines.sinks.iceberg.IcebergSink.replace_partition>`."""
        with self._lock:
            tbl = self._tables.get(app_id)
        if tbl is None:
            tbl = self._reader.require()
        target = tbl.schema().as_arrow()
        if isinstance(self._write, Merge):
            rows = current_of(data, self._write, target, self._ident)
        else:
            rows = conform(data.read_all(), target, self._ident)
        self.last_rows_written = None
        where = equal_to(PARTITION_COLUMN, int(partition))
        if rows.num_rows and PARTITION_COLUMN in rows.column_names and not pc.all(
                pc.equal(rows[PARTITION_COLUMN], partition)).as_py():
            raise ContractError(f"{self._ident}: replacement rows of partition {partition} hold "
                                "other partitions")
        summary = self._lineage.commit(app_id, expected, "replace_partition",
                                       {"partition": partition, **(lineage or {})})
        props = {WATERMARK_PREFIX + k: str(v) for k, v in (markers or {}).items()}
        kept = {app_id: (expected, expected), **{a: (v, v) for a, v in (fenced or {}).items()}}
        for attempt in range(self._retries + 1):
            tbl = self.no_pyiceberg_retry(tbl)
            conflict = moved(tbl, kept)
            if conflict is not None:
                raise FenceConflictError(*conflict)
            before = tbl.scan(row_filter=where).count()
            try:
                view = commit_view(tbl)
                with view.transaction() as txn:
                    # the fence needs a new snapshot even when nothing changes
                    txn.set_properties({**{WATERMARK_PREFIX + a: str(v)
                                           for a, (v, _) in kept.items()}, **props})
                    txn.overwrite(rows, overwrite_filter=where, snapshot_properties=summary)
                tbl = view
                break
            except CommitFailedException:
                if attempt == self._retries:
                    raise
                _backoff(attempt)
                tbl = self._reader.require()
        self._after_commit(tbl, app_id)
        self.forget(app_id)
        self.last_rows_written = rows.num_rows
        return int(before)
