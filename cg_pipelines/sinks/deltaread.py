"""Reading a Delta table for :class:`~cg_pipelines.sinks.delta.DeltaSink`: rows (projected,
filtered), each key's last row (the state-sink contract), log statistics, data file URIs; and
the snapshot loading, filesystem and secret scrubbing the sink's writes share
(:class:`DeltaTableAccess`, the sink's base class).

Reads go through pyarrow datasets over a native pyarrow filesystem
(:func:`~cg_pipelines.sinks.storage.table_filesystem`), not delta-rs' default handler.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError

from cg_pipelines.core.errors import ColumnNotFoundError
from cg_pipelines.core.state import last_per_key
from cg_pipelines.core.write import Append, Merge
from cg_pipelines.sinks.base import PARTITION_COLUMN, FenceConflictError, partition_of
from cg_pipelines.sinks.deltastate import PartitionStates
from cg_pipelines.sinks.storage import safe_uri, scrubbed, table_filesystem

if TYPE_CHECKING:
    # Annotations only: pyarrow.dataset imports pandas (~0.3 s together), which importing the
    # sink (every load of a Dagster code location) need not pay; delta-rs'
    # DeltaTable.to_pyarrow_dataset imports it when a read needs it.
    import pyarrow.dataset as pads

__all__ = ["SNAPSHOT_RELOAD_VERSIONS", "DeltaTableAccess", "TableStats"]

SNAPSHOT_RELOAD_VERSIONS: Final = 20
"""A snapshot the sink holds (per app id for fencing, and the reader's) is loaded afresh, not
``update_incremental()``-ed, once it is this many versions past its last fresh load. Measured on
delta-rs 1.6.6 (local disk): a commit through a held ``DeltaTable`` gets slower with every
version it has applied since it was loaded (2.5 ms right after a load, 16 ms 110 versions
later, 67 ms 810 versions later; a fresh load, which starts from the latest checkpoint, took
9 ms there), whatever the table's age. 20 keeps that overhead near 1 ms for a fresh load's
cost every 20 versions."""


@dataclass(frozen=True)
class TableStats:
    """A Delta table version's size: ``version``, total ``rows``, ``partition_rows`` of one
    consumer-group partition (``None`` if not asked or not partitioned), Arrow ``schema``."""

    version: int
    rows: int
    partition_rows: int | None
    schema: pa.Schema


class DeltaTableAccess:
    """The read side of a :class:`~cg_pipelines.sinks.delta.DeltaSink` (its base class; the
    attributes below are set by the sink's constructor)."""

    _uri: str
    _options: dict[str, str]
    _schema: pa.Schema | None
    _write: Append | Merge
    _read_lock: threading.Lock
    _reader: DeltaTable | None
    _reader_base: int
    _read_fs: pafs.FileSystem | None
    _names: list[str]
    _states: PartitionStates | None
    _lock: threading.Lock
    # app id -> the snapshot its next commit is fenced against (None: no table then).
    _snapshots: dict[str, DeltaTable | None]
    # app id -> the lock its watermark, commits, state reads and upkeep take.
    _app_locks: dict[str, threading.Lock]
    # partition -> the app id whose watermark was read last (see _partition_snapshot).
    _run_apps: dict[int, str]

    def exists(self) -> bool:
        """Whether the Delta table exists (has a log).

        Raises:
            DeltaError / OSError: other read errors (e.g. a missing bucket).
        """
        with self._guard():
            return self._load() is not None

    def read(
        self, columns: list[str] | None = None, filter: pads.Expression | None = None
    ) -> pa.Table:
        """The latest snapshot's rows, optionally projected and filtered.

        Args:
            columns: column names to return (all if None).
            filter: a pyarrow dataset expression, e.g. ``pc.field("key") == "N123"``; used for
                file pruning (partition values, statistics) and row filtering.

        Returns:
            An Arrow table (timestamps in microseconds). If the table does not exist: no rows,
            with the ``schema`` given to the sink (projected to ``columns``) if any, else the
            requested ``columns`` as null-typed columns (or no columns).

        Raises:
            DeltaError / OSError / pyarrow errors: read failures, unknown columns.
        """
        with self._guard():
            with self._read_lock:  # serialize refreshes of the shared reader snapshot
                dt = self._latest()
                ds = dt.to_pyarrow_dataset(filesystem=self._filesystem()) if dt else None
            if ds is None:
                if self._schema is not None:
                    empty = self._schema.empty_table()
                    return empty.select(columns) if columns is not None else empty
                return pa.table({c: pa.nulls(0) for c in columns or []})
            try:
                return ds.to_table(columns=columns, filter=filter)
            except pa.ArrowNotImplementedError:
                if filter is None:
                    raise
                # Files written by delta-rs' MERGE (DataFusion) store strings as string_view;
                # pyarrow 2x cannot compare their statistics with a string literal while
                # pruning. Scan unpruned, filter in memory (the result is the same).
                names = list(dict.fromkeys([*(columns or ds.schema.names)]))
                whole = ds.to_table(columns=None if columns is None else
                                    list(dict.fromkeys([*names, *ds.schema.names])))
                return whole.filter(filter).select(names)

    def last_rows(
        self,
        key: str,
        keys: Sequence[object],
        columns: Sequence[str],
        order_by: str,
        partition: int | None = None,
    ) -> pa.Table:
        """The last committed row (greatest ``order_by``) of each of ``keys``: the per-key state
        of :class:`~cg_pipelines.core.state.KeyedState` (the state-sink contract,
        :class:`~cg_pipelines.sinks.base.StateSink`).

        In append mode, for one partition of a table partitioned by :data:`PARTITION_COLUMN`
        (the default), the rows come from the partition's state snapshot caught up from the
        files committed since (:mod:`cg_pipelines.sinks.deltastate`): the cost does not grow
        with the table's history. Otherwise (and in merge mode, where the table is the
        current state, one row per key) the table is read.

        Args:
            key: key column. keys: key values (Python values of the column's type).
            columns: columns to return (must include ``key`` and ``order_by``).
            order_by: ordering column.
            partition: when given and the table has :data:`PARTITION_COLUMN`, only that
                consumer-group partition's rows are read (its files alone, when the table is
                partitioned by it).

        Returns:
            One row per key found, sorted by key; no rows when ``keys`` is empty or the table
            does not exist yet.

        Raises:
            ColumnNotFoundError: ``key`` or ``order_by`` missing from the table.
            DeltaError / OSError / pyarrow errors: read failures.
        """
        cols = list(dict.fromkeys([key, order_by, *columns]))
        if not keys:
            return self.read(columns=cols).slice(0, 0) if self.exists() else pa.table(
                {c: pa.nulls(0) for c in cols})
        if partition is not None and not isinstance(self._write, Merge):
            got = self._snapshot_rows(key, keys, cols, order_by, partition)
            if got is not None:
                return got
        flt = pc.field(key).isin(list(keys))
        part = None
        if partition is not None and PARTITION_COLUMN in self._column_names():
            part = pc.field(PARTITION_COLUMN) == partition
        if isinstance(self._write, Merge):
            # The current table: one row per key, the partition's files read whole (pruned
            # by partition only: MERGE-written statistics are string_view, see read()).
            rows = self._partition_read(list(dict.fromkeys([*cols, PARTITION_COLUMN]))
                                        if part is not None else cols, part, partition)
            if rows.num_rows == 0:
                return rows.select(cols)
            return last_per_key(rows.filter(flt).select(cols), key, order_by)
        if part is not None:
            flt = flt & part
        return last_per_key(self.read(columns=cols, filter=flt), key, order_by)

    def _snapshot_rows(self, key: str, keys: Sequence[object], cols: list[str], order_by: str,
                       partition: int) -> pa.Table | None:
        """:meth:`last_rows` through the partition's state snapshot, or None when it does not
        apply (no table, no native filesystem, not partitioned by :data:`PARTITION_COLUMN`)."""
        states = self._partition_states()
        if states is None:
            return None
        with self._guard(), self._partition_snapshot(partition, wait=False) as dt:
            if dt is None:
                return None
            missing = [c for c in (key, order_by) if c not in dt.schema().to_arrow().names]
            if missing:
                raise ColumnNotFoundError(f"columns {missing} not in the table")
            return states.last_rows(dt, key, keys, cols, order_by, partition)

    def _partition_read(self, columns: list[str], filter: pads.Expression | None,
                        partition: int | None) -> pa.Table:
        """Merge mode's state read: :meth:`read` of ``columns``, rows matching ``filter``,
        from :meth:`_partition_snapshot` of ``partition`` when a run holds one, else from the
        latest snapshot."""
        with self._lock:
            held = partition is not None and int(partition) in self._run_apps
        if not held or partition is None:
            return self.read(columns=columns, filter=filter)
        with self._guard():
            with self._partition_snapshot(partition, wait=False) as dt:
                ds = dt.to_pyarrow_dataset(filesystem=self._filesystem()) \
                    if dt is not None else None
            if ds is None:  # no table: read() answers with the right empty shape
                return self.read(columns=columns, filter=filter)
            try:
                return ds.to_table(columns=columns, filter=filter)
            except pa.ArrowNotImplementedError:
                if filter is None:
                    raise
                # string_view statistics of MERGE-written files: see read()
                whole = ds.to_table(columns=list(dict.fromkeys([*columns, *ds.schema.names])))
                return whole.filter(filter).select(columns)

    def _app_lock(self, app_id: str) -> threading.Lock:
        """The lock of ``app_id``'s snapshot (created on first use)."""
        with self._lock:
            lock = self._app_locks.get(app_id)
            if lock is None:
                lock = self._app_locks[app_id] = threading.Lock()
            return lock

    def _remember_run(self, app_id: str) -> None:
        """Record that a run of ``app_id``'s partition read its watermark (see
        :meth:`_partition_snapshot`); app ids not shaped by
        :func:`~cg_pipelines.sinks.base.app_id_for` are not recorded."""
        partition = partition_of(app_id)
        if partition is not None:
            with self._lock:
                self._run_apps[partition] = app_id

    def _forget_runs(self, partition: int | None = None) -> None:
        """Stop serving ``partition``'s state reads and upkeep (every partition's with None)
        from a run's snapshot until its next :meth:`watermark`: after this sink rewrote the
        partition's files (compaction) or deleted files (VACUUM), that snapshot may name
        files that are gone."""
        with self._lock:
            if partition is None:
                self._run_apps.clear()
            else:
                self._run_apps.pop(int(partition), None)

    @contextmanager
    def _partition_snapshot(self, partition: int, wait: bool = True
                            ) -> Iterator[DeltaTable | None]:
        """The snapshot a state read or the upkeep of consumer-group ``partition`` uses,
        held for the ``with`` block (None: no table). ``wait=False`` (state reads): while the
        run's snapshot is busy (a commit of the run's previous batch in flight on another
        thread) use the latest version instead of waiting for the commit.

        The run's snapshot when there is one: the one the latest :meth:`watermark` of the
        partition's app id loaded, as that app id's commits advanced it, under that app id's
        lock. Exact for the partition's rows: the engine reads state and runs the upkeep only
        under the partition's lease, after the run's watermark read, so every commit of the
        partition is in it except the run's own later ones, whose keys the run's state cache
        holds (the upkeep runs after the last of them, which advanced this snapshot). It
        costs no log listing: each delta-rs snapshot update lists ``_delta_log`` (on local
        disk the whole directory: a cost that grows with the entries the log retention
        keeps). Else (no watermark read through this sink for the partition, e.g. a caller
        outside a run) the shared reader snapshot, brought up to the latest version, under
        the read lock."""
        with self._lock:
            app_id = self._run_apps.get(int(partition))
        if app_id is not None:
            lock = self._app_lock(app_id)
            if lock.acquire(blocking=wait):
                try:
                    with self._lock:
                        dt = self._snapshots.get(app_id)
                    if dt is not None:
                        yield dt
                        return
                finally:
                    lock.release()
        with self._read_lock:
            yield self._latest()

    def _partition_states(self) -> PartitionStates | None:
        """The table's state snapshots (None without a native pyarrow filesystem)."""
        if getattr(self, "_states", None) is None:
            fs = self._filesystem()
            self._states = PartitionStates(fs) if fs is not None else None
        return self._states

    def _latest(self) -> DeltaTable | None:
        """The shared reader snapshot brought up to the latest version (None: no table).
        Call with ``_read_lock`` held."""
        self._reader, self._reader_base = self._caught_up(self._reader, self._reader_base)
        return self._reader

    def _caught_up(self, dt: DeltaTable | None, base: int) -> tuple[DeltaTable | None, int]:
        """Held snapshot ``dt``, last loaded afresh at version ``base``, brought up to the
        latest version: ``(snapshot, base)``. ``update_incremental()``, or a fresh load when
        there is none yet or it is :data:`SNAPSHOT_RELOAD_VERSIONS` versions past ``base``.
        A base of -1 means "no table at the last load"."""
        if dt is not None and not self._stale(dt, base):
            dt.update_incremental()
            return dt, base
        return self._fresh()

    @staticmethod
    def _stale(dt: DeltaTable | None, base: int) -> bool:
        """Whether held snapshot ``dt`` is :data:`SNAPSHOT_RELOAD_VERSIONS` versions past
        ``base``, the version of its last fresh load."""
        return dt is not None and dt.version() - base >= SNAPSHOT_RELOAD_VERSIONS

    def _fresh(self) -> tuple[DeltaTable | None, int]:
        """A fresh snapshot of the latest version and its version (None and -1: no table)."""
        dt = self._load()
        return dt, dt.version() if dt is not None else -1

    def stats(self, partition: int | None = None) -> TableStats:
        """The latest version's statistics, from the Delta log (no data files are read).

        Args:
            partition: also count the rows of this consumer-group partition (from the files'
                partition values; ``None`` when the table is not partitioned by
                :data:`PARTITION_COLUMN`).

        Raises:
            TableNotFoundError: no table. DeltaError / OSError: read failures.
        """
        with self._guard():
            dt = self._load()
            if dt is None:
                raise TableNotFoundError(f"{self._safe_uri()}: no Delta table")
            actions = pa.table(dt.get_add_actions(flatten=True))
            rows = pc.sum(actions["num_records"]).as_py() or 0
            part_rows = None
            col = f"partition.{PARTITION_COLUMN}"
            if partition is not None and col in actions.column_names:
                mine = actions.filter(pc.equal(actions[col].cast(pa.int64()), partition))
                part_rows = pc.sum(mine["num_records"]).as_py() or 0
            return TableStats(dt.version(), int(rows), part_rows, pa.schema(dt.schema().to_arrow()))

    def file_uris(self) -> list[str]:
        """URIs of the latest version's data files (empty when there is no table)."""
        with self._guard():
            dt = self._load()
            return list(dt.file_uris()) if dt is not None else []

    def _column_names(self) -> list[str]:
        """Column names of the table (empty while it does not exist; cached once known)."""
        if not self._names:
            with self._guard():
                dt = self._load()
            self._names = [f.name for f in dt.schema().fields] if dt is not None else []
        return self._names

    def _partition_rows(self, dt: DeltaTable, partition: int) -> int:
        actions = pa.table(dt.get_add_actions(flatten=True))
        col = f"partition.{PARTITION_COLUMN}"
        if col in actions.column_names:
            mine = actions.filter(pc.equal(actions[col].cast(pa.int64()), partition))
            return int(pc.sum(mine["num_records"]).as_py() or 0)
        if PARTITION_COLUMN not in [f.name for f in dt.schema().fields]:
            return 0
        return dt.to_pyarrow_dataset(filesystem=self._filesystem()).count_rows(
            filter=pc.field(PARTITION_COLUMN) == partition)

    # ---------------------------------------------------------------- internals

    def _load(self) -> DeltaTable | None:
        """A fresh snapshot of the latest version, or None if there is no table."""
        try:
            return DeltaTable(self._uri, storage_options=self._options or None)
        except TableNotFoundError:
            return None

    def _filesystem(self) -> pafs.FileSystem | None:
        """A native pyarrow filesystem rooted at the table, or None (delta-rs' handler); see
        :func:`~cg_pipelines.sinks.storage.table_filesystem` (cached once found)."""
        if self._read_fs is None:
            self._read_fs = table_filesystem(self._uri, self._options)
        return self._read_fs

    def _safe_uri(self) -> str:
        """The URI without any user:password part."""
        return safe_uri(self._uri)

    def _guard(self) -> AbstractContextManager[None]:
        """Re-raise errors whose message contains a secret option value, scrubbed
        (:class:`FenceConflictError` unchanged)."""
        return scrubbed(self._options, keep=(FenceConflictError,))
