"""Fenced commits into a Delta table: :class:`DeltaWriter`, the write part of a
:class:`~cg_pipelines.sinks.delta.DeltaSink` (watermark reads, commits, partition replaces,
table creation), over the sink's :class:`~cg_pipelines.sinks.deltahandle.DeltaHandle`. The
fencing rules are the sink's (:mod:`cg_pipelines.sinks.delta`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Final

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError

from cg_pipelines.core.errors import UsageError
from cg_pipelines.core.write import Append, Merge
from cg_pipelines.sinks.base import PARTITION_COLUMN, FenceConflictError, Fences, check_fences
from cg_pipelines.sinks.deltahandle import DeltaHandle, known_txn, known_txns, txn
from cg_pipelines.sinks.deltaread import partition_rows
from cg_pipelines.sinks.deltawrite import cut_snapshot, delta_schema, merge_into
from cg_pipelines.sinks.lineage import CommitLineage
from cg_pipelines.sinks.maintenance import Maintenance
from cg_pipelines.sinks.rows import counting, current_of

__all__ = ["CONFLICT_RETRIES", "DeltaWriter"]

CONFLICT_RETRIES: Final = 3
"""Times a commit is tried again after losing a race to a commit that did not move its
watermark (a compaction of the same files, for instance); a moved watermark is a fence."""


def _moved(dt: DeltaTable | None, watermarks: Mapping[str, tuple[int, int]],
           lookup: Callable[[DeltaTable | None, str], int] = txn
           ) -> tuple[str, int, int] | None:
    """``(app id, expected, found)`` of the first watermark not as expected in ``dt``, or None
    (``lookup``: how a watermark is read, :func:`~cg_pipelines.sinks.deltahandle.txn`)."""
    for app_id, (expected, _) in watermarks.items():
        found = lookup(dt, app_id)
        if found != expected:
            return app_id, expected, found
    return None


def _stale(dt: DeltaTable | None, watermarks: Mapping[str, tuple[int, int]],
           lookup: Callable[[DeltaTable | None, str], int] = txn) -> bool:
    """Whether held snapshot ``dt`` cannot decide the fence: a watermark is not as expected
    in it (it may only be older than the caller's read), or the log window deleted the log
    entries after it (:func:`~cg_pipelines.sinks.deltawrite.cut_snapshot`: delta-rs can
    neither read its transactions nor commit from it). Either way the latest snapshot
    decides."""
    try:
        return _moved(dt, watermarks, lookup) is not None
    except DeltaError as e:
        if cut_snapshot(e):
            return True
        raise


class DeltaWriter:
    """The write part of a :class:`~cg_pipelines.sinks.delta.DeltaSink`: every method is the
    sink's of the same name (documented there in full)."""

    def __init__(self, handle: DeltaHandle, write: Append | Merge, lineage: CommitLineage,
                 policy: Maintenance, *, schema: pa.Schema | None,
                 partition_by: list[str] | None, checkpoint_interval: int) -> None:
        """
        Args:
            handle: the sink's table handle. write: the write mode.
            lineage: the commits' ``custom_metadata``.
            policy: the maintenance policy (its commit hooks and a new table's properties).
            schema / partition_by / checkpoint_interval: as the sink's (a new table's).
        """
        self._t = handle
        self._write = write
        self._lineage = lineage
        self._policy = policy
        self._schema = schema
        self._partition_by = partition_by
        self._checkpoint_interval = checkpoint_interval
        self._versions: list[int] = []
        self.last_rows_written: int | None = None

    @property
    def versions_written(self) -> list[int]:
        """Delta versions this writer committed so far (commits and replaces, in order)."""
        with self._t.lock:
            return list(self._versions)

    def watermark(self, app_id: str) -> int:
        """:meth:`DeltaSink.watermark <cg_pipelines.sinks.delta.DeltaSink.watermark>`."""
        with self._t.guard(), self._t.app_lock(app_id):
            _, dt, base = self._t.held(app_id)
            dt, base = self._t.caught_up(dt, base)
            self._t.hold(app_id, dt, base, run_starts=True)
            return txn(dt, app_id)

    def watermarks(self, app_ids: Iterable[str]) -> dict[str, int]:
        """:meth:`DeltaSink.watermarks <cg_pipelines.sinks.delta.DeltaSink.watermarks>`."""
        with self._t.guard():
            dt = self._t.load()
            return {a: txn(dt, a) for a in app_ids}

    def commit(self, table: pa.Table | None, watermarks: Fences,
               markers: Mapping[str, int] | None = None, *,
               lineage: Mapping[str, object] | None = None) -> None:
        """:meth:`DeltaSink.commit <cg_pipelines.sinks.delta.DeltaSink.commit>`."""
        moving = check_fences(watermarks)
        app_id = next(iter(watermarks))
        version = watermarks[app_id][1]
        with self._t.guard(), self._t.app_lock(app_id):
            remembered, dt, base = self._t.held(app_id)
            checked = False  # every fence found as expected in dt (no second look)
            if not remembered or self._t.stale(dt, base):
                dt, base = self._t.fresh()  # see SNAPSHOT_RELOAD_VERSIONS; safe as below
            elif _stale(dt, watermarks, known_txn):  # a cut dt fails its write: handled below
                # The remembered snapshot may just be older than the caller's ``expected`` (it
                # read the watermark elsewhere), or cut by the log window: decide on the latest
                # snapshot. Safe because an app id's versions only grow (``expected <
                # version`` is enforced), so a watermark that moved away from ``expected``
                # never comes back to it.
                dt, base = self._t.fresh()
            else:
                checked = True
            if dt is None:
                if any(exp for exp, _ in watermarks.values()):
                    first = next(a for a, (exp, _) in watermarks.items() if exp)
                    raise FenceConflictError(first, watermarks[first][0], 0)
                schema = table.schema if table is not None and table.num_columns else self._schema
                if schema is not None and isinstance(self._write, Merge) and table is not None \
                        and table.num_columns:
                    self._write.check(table)
                if schema is None:
                    raise UsageError(f"{self._t.safe_uri()}: no table yet and no schema to create "
                                     "it with: pass schema= or call ensure_table() first")
                self.ensure_table(schema)
                dt, base, checked = *self._t.fresh(), False
                if dt is None:  # ensure_table returned, so someone deleted it since
                    raise TableNotFoundError(f"{self._t.safe_uri()}: table vanished after creation")
            conflict = None if checked else _moved(dt, watermarks)
            if conflict is not None:
                self._t.hold(app_id, dt, base)
                raise FenceConflictError(*conflict)
            empty = table is None or table.num_rows == 0
            merge = isinstance(self._write, Merge) and not empty
            props = CommitProperties(app_transactions=[
                *(Transaction(a, v) for a, (_, v) in watermarks.items()),
                *(Transaction(k, v) for k, v in (markers or {}).items())],
                custom_metadata=self._lineage.commit(app_id, version, "merge" if merge else (
                    "empty" if empty else "append"), lineage))
            hooks = self._policy.commit_hooks()
            for attempt in range(CONFLICT_RETRIES + 1):
                try:
                    if empty:
                        self._empty_commit(dt, props)
                    elif merge:
                        assert table is not None and isinstance(self._write, Merge)
                        merge_into(dt, table, self._write, props, self._t.safe_uri(), hooks)
                        if txn(dt, moving) != watermarks[moving][1]:
                            # delta-rs commits no version for a merge that changes no row: record
                            # the watermark alone, fenced against the same snapshot.
                            self._empty_commit(dt, props)
                    elif table is not None:  # always, when not empty
                        write_deltalake(dt, table, mode="append", commit_properties=props,
                                        post_commithook_properties=hooks)
                    break
                except DeltaError as e:
                    # A lost race (CommitFailedError), or the log window deleted the entries
                    # after the snapshot between its check and this commit (cut_snapshot):
                    # nothing was written either way; the latest snapshot decides.
                    if not isinstance(e, CommitFailedError) and not cut_snapshot(e):
                        raise
                    fresh, base = self._t.fresh()
                    conflict = _moved(fresh, watermarks)
                    self._t.hold(app_id, fresh, base)
                    if conflict is not None:
                        raise FenceConflictError(*conflict) from e
                    if "concurrent transaction failed" in str(e).lower():
                        raise FenceConflictError(app_id, watermarks[app_id][0], None) from e
                    if attempt == CONFLICT_RETRIES or fresh is None:
                        raise
                    # The watermark did not move: a commit that is not a data commit of this
                    # partition (e.g. someone's OPTIMIZE of the files a merge reads) won the
                    # race. Nothing was written: try again, fenced against the new snapshot.
                    dt = fresh
            # write_deltalake and merge advance dt in place to the version they wrote,
            # create_write_transaction does not.
            if txn(dt, moving) != watermarks[moving][1]:
                before = dt.version()
                dt.update_incremental()
                written = self._find_version(dt, before, moving, watermarks[moving][1])
            else:
                written = dt.version()
                # what this commit wrote is what dt holds at its version
                known_txns(dt, written, {
                    **{a: v for a, (_, v) in watermarks.items()}, **(markers or {})})
            self._t.hold(app_id, dt, base)
            if written is not None:
                self._t.wrote(watermarks, written, carrier=app_id)
                with self._t.lock:
                    self._versions.append(written)

    def _empty_commit(self, dt: DeltaTable, props: CommitProperties) -> None:
        """A commit with no data actions (only the transactions and the commit info)."""
        hooks = self._policy.commit_hooks()
        dt.create_write_transaction(actions=[], mode="append", schema=dt.schema(),
                                    commit_properties=props, post_commithook_properties=hooks)

    def _find_version(self, dt: DeltaTable, before: int, app_id: str, watermark: int
                      ) -> int | None:
        """The version (after ``before``, up to snapshot ``dt``'s) whose commit first records
        ``app_id`` at ``watermark``: ``before + 1`` when no one else committed meanwhile,
        else found by loading the versions in between (rare; never ``history()``, which hangs
        on moto's S3 listing). None if not found."""
        latest = dt.version()
        if latest == before + 1:
            return latest
        for v in range(before + 1, latest + 1):
            snap = DeltaTable(self._t.uri, version=v, storage_options=self._t.options or None)
            if txn(snap, app_id) == watermark:
                return v
        return None

    # ---------------------------------------------------------------- table management

    def ensure_table(self, schema: pa.Schema) -> bool:
        """:meth:`DeltaSink.ensure_table <cg_pipelines.sinks.delta.DeltaSink.ensure_table>`."""
        with self._t.guard():
            if self._t.load() is not None:
                return False
            try:
                DeltaTable.create(
                    self._t.uri,
                    delta_schema(schema),
                    mode="error",
                    partition_by=self._partition_columns(schema),
                    configuration={"delta.checkpointInterval": str(self._checkpoint_interval),
                                   **self._policy.table_properties()},
                    storage_options=self._t.options or None,
                    # No retry: a losing creator must not re-create the table at version 1.
                    commit_properties=CommitProperties(max_commit_retries=0,
                                                       custom_metadata=self._lineage.create()),
                )
            except DeltaError:
                if self._t.load() is None:
                    raise
                return False
            return True

    def replace_partition(
        self,
        data: pa.RecordBatchReader,
        partition: int,
        app_id: str,
        expected: int,
        markers: Mapping[str, int] | None = None,
        *,
        lineage: Mapping[str, object] | None = None,
        fenced: Mapping[str, int] | None = None,
    ) -> int:
        """:meth:`DeltaSink.replace_partition
        <cg_pipelines.sinks.delta.DeltaSink.replace_partition>`."""
        with self._t.guard(), self._t.app_lock(app_id):
            _, dt, _ = self._t.held(app_id)
            if dt is None:
                dt = self._t.load()
            if dt is None:
                raise TableNotFoundError(f"{self._t.safe_uri()}: no Delta table to replace in")
            kept = {app_id: (expected, expected),
                    **{a: (v, v) for a, v in (fenced or {}).items()}}
            if _stale(dt, kept):  # older than the caller's read, or cut: the latest decides
                dt = self._t.load()
                if dt is None:
                    raise TableNotFoundError(f"{self._t.safe_uri()}: no Delta table")
            conflict = _moved(dt, kept)
            if conflict is not None:
                raise FenceConflictError(*conflict)
            before = partition_rows(dt, partition, self._t.filesystem())
            props = CommitProperties(app_transactions=[
                *(Transaction(a, v) for a, (v, _) in kept.items()),
                *(Transaction(k, v) for k, v in (markers or {}).items())],
                custom_metadata=self._lineage.commit(app_id, expected, "replace_partition",
                                              {"partition": partition, **(lineage or {})}))
            counted: dict[str, int] = {"rows": 0}
            source: pa.RecordBatchReader | pa.Table
            if isinstance(self._write, Merge):
                source = current_of(data, self._write, pa.schema(dt.schema().to_arrow()),
                                    self._t.safe_uri())
                counted["rows"] = source.num_rows
            else:
                source = counting(data, counted)
            try:
                write_deltalake(dt, source, mode="overwrite",
                                predicate=f"{PARTITION_COLUMN} = {int(partition)}",
                                commit_properties=props,
                                post_commithook_properties=self._policy.commit_hooks())
            except CommitFailedError as e:
                fresh, base = self._t.fresh()
                conflict = _moved(fresh, kept)
                self._t.hold(app_id, fresh, base)
                if conflict is not None:
                    raise FenceConflictError(*conflict) from e
                raise
            self._t.release(app_id)
            with self._t.lock:
                self._versions.append(dt.version())
            self.last_rows_written = counted["rows"]
            return before

    def _partition_columns(self, schema: pa.Schema) -> list[str] | None:
        """A new table's partition columns: ``partition_by`` as given (``[]``: none), else
        :data:`PARTITION_COLUMN` when ``schema`` has it."""
        if self._partition_by is not None:
            return self._partition_by or None
        return [PARTITION_COLUMN] if PARTITION_COLUMN in schema.names else None
