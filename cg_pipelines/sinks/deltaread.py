"""Reading a Delta table for :class:`~cg_pipelines.sinks.delta.DeltaSink`: rows (projected,
filtered), each key's last row (the state-sink contract), log statistics, data file URIs; and
the snapshot loading, filesystem and secret scrubbing the sink's writes share
(:class:`DeltaTableAccess`, the sink's base class).

Reads go through pyarrow datasets over a native pyarrow filesystem
(:func:`~cg_pipelines.sinks.storage.table_filesystem`), not delta-rs' default handler.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Final

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError

from cg_pipelines.core.errors import ColumnNotFoundError
from cg_pipelines.core.state import last_per_key
from cg_pipelines.core.write import Append, Merge
from cg_pipelines.sinks.base import PARTITION_COLUMN, FenceConflictError
from cg_pipelines.sinks.deltastate import PartitionStates, TableView
from cg_pipelines.sinks.storage import safe_uri, scrubbed, table_filesystem
from cg_pipelines.sinks.table import TableStats

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
    # app id -> the lock its watermark read, commits and upkeep take.
    _app_locks: dict[str, threading.Lock]
    # app id -> the view of its run's snapshot (see _run_view): present from a watermark read
    # to the run's upkeep; None until a state read takes it.
    _views: dict[str, TableView | None]

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
            return _to_table(ds, columns, filter)

    def read_partitions(self, partitions: Sequence[int] | None = None) -> pa.Table:
        """:meth:`read` of the rows of ``partitions`` (``None``: all), pruned by the
        partition column (the :class:`~cg_pipelines.sinks.table.TableSink` read).

        Raises:
            DeltaError / OSError / pyarrow errors: read failures.
        """
        return self.read(filter=None if partitions is None
                         else pc.field(PARTITION_COLUMN).isin(list(partitions)))

    def last_rows(
        self,
        key: str,
        keys: Sequence[object],
        columns: Sequence[str],
        order_by: str,
        partition: int | None = None,
        *,
        app_id: str | None = None,
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
            app_id: the run's app id, which the engine passes (with ``partition``): the rows
                then come from the snapshot the run's :meth:`watermark` read loaded, with no
                reload (see :meth:`_run_view`); exact only under the engine's contract
                (:meth:`StateSink.last_rows <cg_pipelines.sinks.base.StateSink.last_rows>`:
                after that read, under the lease, never for a key the run committed since).
                None (any other caller): the latest version.

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
        view = self._run_view(app_id) if partition is not None else None
        if partition is not None and not isinstance(self._write, Merge):
            got = self._snapshot_rows(key, keys, cols, order_by, partition, view)
            if got is not None:
                return got
        flt = pc.field(key).isin(list(keys))
        part = None
        if partition is not None and PARTITION_COLUMN in self._column_names():
            part = pc.field(PARTITION_COLUMN) == partition
        if isinstance(self._write, Merge):
            # The current table: one row per key, the partition's files read whole (pruned
            # by partition only: MERGE-written statistics are string_view, see read()).
            wanted = list(dict.fromkeys([*cols, PARTITION_COLUMN])) if part is not None else cols
            rows = _to_table(view.dataset, wanted, part) \
                if view is not None and view.dataset is not None \
                else self.read(columns=wanted, filter=part)
            if rows.num_rows == 0:
                return rows.select(cols)
            return last_per_key(rows.filter(flt).select(cols), key, order_by)
        if part is not None:
            flt = flt & part
        return last_per_key(self.read(columns=cols, filter=flt), key, order_by)

    def _snapshot_rows(self, key: str, keys: Sequence[object], cols: list[str], order_by: str,
                       partition: int, view: TableView | None) -> pa.Table | None:
        """:meth:`last_rows` through the partition's state snapshot, on ``view`` (else the
        latest version), or None when it does not apply (no table, no native filesystem, not
        partitioned by :data:`PARTITION_COLUMN`)."""
        states = self._partition_states()
        if states is None:
            return None
        with self._guard():
            if view is None:
                view = self._latest_view()
            if view is None:
                return None
            missing = [c for c in (key, order_by) if c not in view.columns]
            if missing:
                raise ColumnNotFoundError(f"columns {missing} not in the table")
            return states.last_rows(view, key, keys, cols, order_by, partition)

    def _latest_view(self) -> TableView | None:
        """A view of the shared reader snapshot brought up to the latest version (None: no
        table), its dataset made at once (under the read lock: the reader snapshot is shared
        and moves)."""
        with self._read_lock:
            dt = self._latest()
            if dt is None:
                return None
            view = TableView.of(dt, self._filesystem())
            _ = view.dataset  # made now, while the shared snapshot cannot move
            return view

    def _app_lock(self, app_id: str) -> threading.Lock:
        """The lock of ``app_id``'s snapshot (created on first use)."""
        with self._lock:
            lock = self._app_locks.get(app_id)
            if lock is None:
                lock = self._app_locks[app_id] = threading.Lock()
            return lock

    def _run_dataset(self, app_id: str) -> pads.Dataset | None:
        """The dataset of ``app_id``'s run snapshot as it is now (under its lock: not in the
        middle of a commit); None without a native filesystem or a snapshot."""
        fs = self._filesystem()
        with self._app_lock(app_id):
            with self._lock:
                dt = self._snapshots.get(app_id)
            return dt.to_pyarrow_dataset(filesystem=fs) if dt is not None and fs else None

    def _run_view(self, app_id: str | None) -> TableView | None:
        """The view of the snapshot the run of ``app_id`` reads its state from, or None (no
        run of ``app_id`` on in this sink, no table yet, or ``app_id`` None).

        A run is on from its :meth:`watermark` read to its upkeep (:meth:`maintain
        <cg_pipelines.sinks.maintenance.DeltaMaintenance.maintain>`) or a
        :meth:`replace_partition`. The view is taken once, by the run's first state read,
        of the snapshot that read loaded as the run's commits advanced it (under ``app_id``'s
        lock, so never in the middle of a commit), and then serves every state read of the
        run with no reload; its dataset, made only when a read must read data files, is
        taken under that lock too (the files the view names are still in the snapshot:
        nothing rewrites the partition's files during its run). Exact under the engine's contract
        (:class:`~cg_pipelines.sinks.base.StateSink`): every commit of the partition before
        the watermark read is in it, and the run's own later commits hold none of the keys
        asked for. What it saves: each delta-rs snapshot update lists ``_delta_log`` (on local
        disk the whole directory, whose entries grow with the log retention)."""
        if app_id is None:
            return None
        with self._lock:
            if app_id not in self._views:
                return None
            view = self._views[app_id]
        if view is not None:
            return view
        with self._app_lock(app_id):
            with self._lock:
                if app_id not in self._views:
                    return None
                view, dt = self._views[app_id], self._snapshots.get(app_id)
            if view is None and dt is not None:
                view = TableView.of(dt, self._filesystem(), lambda: self._run_dataset(app_id))
                with self._lock:
                    if app_id in self._views:
                        self._views[app_id] = view
            return view

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
        return int(dt.to_pyarrow_dataset(filesystem=self._filesystem()).count_rows(
            filter=pc.field(PARTITION_COLUMN) == partition))

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


def _to_table(ds: pads.Dataset, columns: list[str] | None,
              filter: pads.Expression | None) -> pa.Table:
    """``ds.to_table(columns, filter)``, also for files written by delta-rs' MERGE."""
    try:
        return ds.to_table(columns=columns, filter=filter)
    except pa.ArrowNotImplementedError:
        if filter is None:
            raise
        # Files written by delta-rs' MERGE (DataFusion) store strings as string_view; pyarrow
        # 2x cannot compare their statistics with a string literal while pruning. Scan
        # unpruned, filter in memory (the result is the same).
        names = list(dict.fromkeys([*(columns or ds.schema.names)]))
        whole = ds.to_table(columns=None if columns is None else
                            list(dict.fromkeys([*names, *ds.schema.names])))
        return whole.filter(filter).select(names)
