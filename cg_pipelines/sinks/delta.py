"""Delta Lake sink over ``deltalake`` (delta-rs): fenced, exactly-once commits without Spark.

One :meth:`DeltaSink.commit` is ONE Delta commit that appends the rows and records the
application transaction ``txn(appId=<app_id>, version=<last sequence>)``. The partition's
watermark is that transaction's version (``DeltaTable.transaction_version``).

Fencing (checked by experiment on deltalake 1.6.6, local disk and moto S3; see the tests):

* ``watermark(app_id)`` loads the latest snapshot and remembers it for ``app_id``.
* ``commit`` checks the remembered snapshot still says ``expected``, then writes *through that
  snapshot's* ``DeltaTable`` object. delta-rs' conflict checker then rejects the commit if any
  commit after the snapshot carries a transaction with the same app id ("Concurrent transaction
  failed"), so of two writers that read the same watermark exactly one wins. Commits with other
  app ids (other partitions) do not conflict (appends are retried at the next log version).
* The log entry itself is written put-if-absent: on S3, delta-rs 1.x sends ``If-None-Match: *``
  by default (no locking provider, no ``AWS_S3_ALLOW_UNSAFE_RENAME``); moto 5.2 answers 412.
* A table that does not exist yet is NOT fenced by delta-rs: two concurrent first appends with
  the same app id both succeed (the loser is silently retried as version 1). So the sink never
  creates a table by appending: :meth:`DeltaSink.ensure_table` creates it empty, with the schema
  only, with ``max_commit_retries=0`` (exactly one concurrent creator wins; the losers find the
  table and go on), and the fenced append runs against a snapshot of the existing table.
* An empty batch (``None`` or 0 rows) still records the transaction: a commit with only a
  ``txn`` action (``DeltaTable.create_write_transaction(actions=[])``), fenced the same way.

Watermarks are ``txn`` actions: they survive checkpoints (checked) and never expire unless
someone sets ``delta.setTransactionRetentionDuration`` on the table — do not: an expired
watermark reads as 0 and the partition would be reprocessed.

Timestamps are stored at microsecond precision: a nanosecond timestamp in a schema given to the
sink is created as microseconds (a ``timestamp[ns]`` column would switch on the
``timestampNanos`` reader feature, which delta-rs' own pyarrow reader and Spark cannot read),
and delta-rs truncates nanosecond data to microseconds on append.

Write modes (:mod:`cg_pipelines.core.write`): :class:`Append` (the default) appends every row;
:class:`Merge` runs a Delta MERGE by key (``DeltaTable.merge`` with the same
``CommitProperties``), so the data change and the watermark are still ONE Delta version and a
zombie or a replay changes nothing. The batch is first reduced to each key's last row in stream
order; a key whose last row is a delete marker is deleted. The merge matches keys within the
batch's consumer-group partition (``_partition = p`` in the predicate): delta-rs then reads and
rewrites only that partition's files, and merges of different partitions do not conflict. A
merge that changes no row (e.g. deletes of absent keys) commits nothing in delta-rs 1.6.6, so
the watermark is then recorded by an empty transaction fenced against the same snapshot.

Lineage: every commit (append, merge, empty, replace) carries ``custom_metadata``:
``cg.stream``, ``cg.group``, ``cg.partition``, ``cg.first_seq``, ``cg.last_seq`` (what the
caller passes as ``lineage``), ``cg.app_id``, ``cg.watermark``, ``cg.write_mode``,
``cg.operation``, ``cg.library_version``, the sink's own ``commit_metadata`` (the Dagster
integration adds ``cg.dagster_run_id``), and the same, less the machine-read ``cg.coverage``,
as one JSON object in ``userMetadata`` (the column Spark's ``DESCRIBE HISTORY`` shows).
``DeltaTable.history()`` returns them as top-level keys of each version.

Races that are not fences: a commit that loses to a commit which did not move its watermark
(delta-rs' "a concurrent transaction(s) added/deleted data", e.g. a compaction of the files a
MERGE reads) wrote nothing and is tried again against the new snapshot, up to
:data:`CONFLICT_RETRIES` times; a moved watermark, or delta-rs' "Concurrent transaction failed"
(a commit with the same app id won), is a fence.

Upkeep (:mod:`cg_pipelines.sinks.maintenance`, :meth:`DeltaSink.maintain`, called by the
engine after a run's last commit): compaction of the partition's small files, the per-partition
state snapshots that keep :meth:`last_rows` independent of the table's age
(:mod:`cg_pipelines.sinks.deltastate`), VACUUM and log cleanup. ``docs/growth.md`` lists what
grows and what bounds it.

One snapshot per run: a run's state reads (:meth:`last_rows` with the run's ``app_id``) and its
upkeep (:meth:`maintain`) use the snapshot its :meth:`watermark` read loaded, as its commits
advanced it, instead of a snapshot update of their own (delta-rs lists ``_delta_log`` for each:
on local disk the whole directory, whose entries the log retention bounds). Exact under the
engine's contract (:class:`~cg_pipelines.sinks.base.StateSink`,
:class:`~cg_pipelines.sinks.base.MaintainedSink`); a state read without ``app_id``, or outside
a run, reads the latest version. ``docs/growth.md`` has the figures.

Reads go through pyarrow datasets over a native pyarrow filesystem (local or ``S3FileSystem``),
not delta-rs' default Python filesystem handler: with that handler the interpreter sometimes
aborts at exit ("terminate called without an active exception", delta-rs issue #2184).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Mapping
from typing import ClassVar, Final

import pyarrow as pa
import pyarrow.fs as pafs
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError

from cg_pipelines.core.coverage import COVERAGE_KEY
from cg_pipelines.core.errors import UsageError
from cg_pipelines.core.write import Append, Merge
from cg_pipelines.sinks.base import PARTITION_COLUMN, FenceConflictError, check_watermarks
from cg_pipelines.sinks.deltastate import TableView
from cg_pipelines.sinks.deltawrite import counting, current_of, delta_schema, merge_into
from cg_pipelines.sinks.maintenance import DeltaMaintenance, Maintenance
from cg_pipelines.sinks.storage import mask_options, s3_options
from cg_pipelines.sinks.table import TableStats
from cg_pipelines.version import __version__

__all__ = ["LINEAGE_PREFIX", "DeltaSink", "Maintenance", "TableStats"]

CONFLICT_RETRIES: Final = 3
"""Times a commit is tried again after losing a race to a commit that did not move its
watermark (a compaction of the same files, for instance); a moved watermark is a fence."""

LINEAGE_PREFIX: Final = "cg."
"""Prefix of the lineage keys in each Delta version's commit info (``cg.stream`` ...)."""


def _lineage_key(name: str) -> str:
    """``name`` with the ``cg.`` prefix (kept when present)."""
    return name if name.startswith(LINEAGE_PREFIX) else LINEAGE_PREFIX + name


def _moved(dt: DeltaTable | None, watermarks: Mapping[str, tuple[int, int]]
           ) -> tuple[str, int, int] | None:
    """``(app id, expected, found)`` of the first watermark not as expected in ``dt``, or None."""
    for app_id, (expected, _) in watermarks.items():
        found = _txn(dt, app_id)
        if found != expected:
            return app_id, expected, found
    return None


def _txn(dt: DeltaTable | None, app_id: str) -> int:
    """The application transaction version of ``app_id`` in snapshot ``dt`` (0 if none)."""
    if dt is None:
        return 0
    return dt.transaction_version(app_id) or 0


class DeltaSink(DeltaMaintenance):
    """A :class:`~cg_pipelines.sinks.base.Sink` over one Delta table (local path or ``s3://``).

    Thread-safe for concurrent use with *different* app ids (one snapshot per app id); calls for
    one app id must not overlap (the engine runs one holder per partition).

    Errors: :class:`FenceConflictError` when the watermark moved (never retried here); delta-rs
    errors (``DeltaError`` and subclasses, ``OSError``) for I/O and schema problems, unchanged and
    not retried (with any secret storage option value scrubbed from the message).
    """

    table_format: ClassVar[str] = "delta"
    """The table format (Dagster's ``dagster/storage_kind``)."""

    def __init__(
        self,
        uri: str,
        *,
        storage_options: dict[str, str] | None = None,
        partition_by: list[str] | None = None,
        schema: pa.Schema | None = None,
        checkpoint_interval: int = 10,
        write: Append | Merge | None = None,
        commit_metadata: Mapping[str, str] | None = None,
        maintenance: Maintenance | None = None,
    ) -> None:
        """
        Args:
            uri: the table root: a local directory (created on first commit) or
                ``s3://bucket/path`` (the bucket must exist).
            storage_options: delta-rs object store options (see :meth:`s3_options`); secret
                values never appear in ``repr`` or in exceptions raised here.
            partition_by: partition columns, used only when this sink creates the table. By
                default a table whose schema has :data:`PARTITION_COLUMN` is partitioned by it
                (each consumer-group partition's rows in files of their own); ``[]`` for none.
            schema: the table's schema, used only when this sink creates the table and the first
                commit carries no rows (otherwise the first batch's schema is used).
            checkpoint_interval: ``delta.checkpointInterval`` (commits between checkpoints) of a
                table this sink creates. Delta's own default is 10, delta-rs' is 100; delta-rs
                1.6 re-reads every JSON commit since the last checkpoint on each snapshot load
                and each commit, so on S3 the latency grows with this number (moto: median
                commit ~0.5 s at 100 vs ~0.15 s at 10 over 120 commits).
            write: :class:`~cg_pipelines.core.write.Append` (default, ``None`` alike) or
                :class:`~cg_pipelines.core.write.Merge` (upserts/deletes by key; see the module
                docstring).
            commit_metadata: extra lineage recorded in every commit's ``custom_metadata``
                (string keys and values; keys without the ``cg.`` prefix get it), e.g.
                ``{"dagster_run_id": run_id}``.
            maintenance: what :meth:`maintain` does after a run's commits (compaction,
                state snapshots, vacuum; :class:`~cg_pipelines.sinks.maintenance.Maintenance`,
                on by default; ``Maintenance.off()`` for nothing).

        Raises:
            UsageError: ``checkpoint_interval < 1``; ``write`` is not Append/Merge/None;
                ``maintenance`` is not a Maintenance.
        """
        if maintenance is not None and not isinstance(maintenance, Maintenance):
            raise UsageError(f"maintenance must be a Maintenance, got {maintenance!r}")
        self._maintenance = maintenance if maintenance is not None else Maintenance()
        self._states = None
        if checkpoint_interval < 1:
            raise UsageError("checkpoint_interval must be >= 1")
        if write is not None and not isinstance(write, (Append, Merge)):
            raise UsageError(f"write must be Append() or Merge(key=...), got {write!r}")
        self._write: Append | Merge = write if write is not None else Append()
        self._extra_md = {_lineage_key(k): str(v) for k, v in (commit_metadata or {}).items()}
        self._versions: list[int] = []
        self.last_rows_written: int | None = None
        self._uri = uri
        self._options: dict[str, str] = dict(storage_options or {})
        self._partition_by = list(partition_by) if partition_by is not None else None
        self._schema = delta_schema(schema) if schema is not None else None
        self._checkpoint_interval = checkpoint_interval
        self._lock = threading.Lock()
        self._read_lock = threading.Lock()
        # app id -> the snapshot its next commit is fenced against (None: no table then).
        self._snapshots: dict[str, DeltaTable | None] = {}
        # app id -> the version its snapshot was last loaded afresh at (see _caught_up).
        self._bases: dict[str, int] = {}
        self._app_locks: dict[str, threading.Lock] = {}
        self._views: dict[str, TableView | None] = {}
        self._reader: DeltaTable | None = None
        self._reader_base = -1
        self._read_fs: pafs.FileSystem | None = None
        self._names: list[str] = []

    # ---------------------------------------------------------------- configuration helpers

    #: delta-rs storage options for S3 or an S3-compatible endpoint (see
    #: :func:`cg_pipelines.sinks.storage.s3_options`).
    s3_options = staticmethod(s3_options)

    @property
    def uri(self) -> str:
        """The table root as given."""
        return self._uri

    @property
    def write(self) -> Append | Merge:
        """The write mode (:class:`Append` or :class:`Merge`)."""
        return self._write

    @property
    def versions_written(self) -> list[int]:
        """Delta versions this sink object committed so far (commits and replaces, in order)."""
        with self._lock:
            return list(self._versions)

    def __repr__(self) -> str:
        return (
            f"DeltaSink(uri={self._safe_uri()!r}, "
            f"storage_options={mask_options(self._options)!r}, "
            f"partition_by={self._partition_by!r}, write={self._write!r})"
        )

    # ---------------------------------------------------------------- the Sink protocol

    def watermark(self, app_id: str) -> int:
        """The last committed version (sequence) of ``app_id``, 0 if none or no table yet.

        Loads the latest snapshot (``update_incremental`` of the one this sink holds for
        ``app_id``, else, or when that one is
        :data:`~cg_pipelines.sinks.deltaread.SNAPSHOT_RELOAD_VERSIONS` versions past its last
        fresh load, a fresh load) and remembers it: the next :meth:`commit` for ``app_id`` is
        fenced against it. Creates nothing.

        Raises:
            DeltaError / OSError: the table cannot be read (not retried).
        """
        with self._guard(), self._app_lock(app_id):
            with self._lock:
                dt = self._snapshots.get(app_id)
                base = self._bases.get(app_id, -1)
            dt, base = self._caught_up(dt, base)
            with self._lock:
                self._snapshots[app_id] = dt
                self._bases[app_id] = base
                self._views[app_id] = None  # a run of app_id is on (see _run_view)
            return _txn(dt, app_id)

    def watermarks(self, app_ids: Iterable[str]) -> dict[str, int]:
        """The committed watermark of each of ``app_ids`` from ONE load of the latest snapshot
        (0 for none, or no table yet). Read-only: unlike :meth:`watermark`, nothing is
        remembered to fence a later commit (for observers such as the backlog sensor).

        Raises:
            DeltaError / OSError: the table cannot be read.
        """
        with self._guard():
            dt = self._load()
            return {a: _txn(dt, a) for a in app_ids}

    def commit(self, table: pa.Table | None, app_id: str, version: int, expected: int,
               markers: Mapping[str, int] | None = None, *,
               lineage: Mapping[str, object] | None = None) -> None:
        """Write ``table`` (append, or merge by key in :class:`Merge` mode) and set ``app_id``'s
        watermark to ``version``, in one Delta commit, only if the watermark is still
        ``expected``. ``markers`` (``{app id: version}``) are recorded in the same commit as
        further application transactions (not fenced; read back with :meth:`watermark`).
        ``lineage`` (e.g. ``stream``, ``group``, ``partition``, ``first_seq``, ``last_seq``)
        goes into the commit's ``custom_metadata`` as ``cg.<name>`` (values as strings).

        Args:
            table: rows to append (any schema the table accepts; ``None`` or 0 rows records only
                the watermark). Creates the table (schema only, see :meth:`ensure_table`) if it
                does not exist.
            app_id: the partition's watermark key, e.g. ``"<stream>/<group>/<partition>"``.
            version: the new watermark (last sequence of the batch); must be > ``expected``.
            expected: the watermark this commit is based on (from :meth:`watermark` or the
                previous commit).

        Raises:
            FenceConflictError: the watermark is not ``expected`` (in the remembered snapshot,
                and in the latest one), or a concurrent commit with the same app id won after
                that snapshot; nothing was written.
            UsageError: ``version <= expected``, or the table does not exist, ``table`` has no
                columns and no ``schema`` was given.
            ContractError: in merge mode, a required column is missing, a key is null, or the
                output's columns differ from the table's.
            DeltaError / OSError: I/O or schema errors from delta-rs (not retried); a
                ``CommitFailedError`` that is not a fence conflict (e.g. a concurrent metadata
                change) is re-raised as is; nothing was written.
        """
        if not 0 <= expected < version:
            raise UsageError(f"commit of {app_id}: need 0 <= expected < version, "
                             f"got expected={expected} version={version}")
        self.commit_inputs(table, {app_id: (expected, version)}, markers, lineage=lineage)

    def commit_inputs(self, table: pa.Table | None, watermarks: Mapping[str, tuple[int, int]],
                      markers: Mapping[str, int] | None = None, *,
                      lineage: Mapping[str, object] | None = None) -> None:
        """Write ``table`` and move every watermark of ``watermarks`` (``{app id: (expected,
        version)}``) in ONE Delta commit, only if each is still its ``expected``: the
        co-partitioned run's commit (:class:`~cg_pipelines.sinks.base.JoinSink`). An app id
        whose input had nothing in the batch keeps its version (``version == expected``) and
        is fenced all the same. The first app id is the commit's ``cg.app_id`` and the one
        whose remembered snapshot (:meth:`watermark`) the commit is fenced against; every app
        id is an application transaction of the commit, so delta-rs rejects it when a commit
        after that snapshot carries any of them. :meth:`commit` is this with one app id.

        Raises:
            FenceConflictError: one of the watermarks is not its ``expected`` (the first found
                is named); nothing was written.
            UsageError: no watermark, a ``version < expected``, or no version moves.
            Otherwise as :meth:`commit`.
        """
        moving = check_watermarks(watermarks)
        app_id = next(iter(watermarks))
        version = watermarks[app_id][1]
        with self._guard(), self._app_lock(app_id):
            with self._lock:
                remembered = app_id in self._snapshots
                dt = self._snapshots.get(app_id)
                base = self._bases.get(app_id, -1)
            if not remembered or self._stale(dt, base):
                dt, base = self._fresh()  # see SNAPSHOT_RELOAD_VERSIONS; safe as below
            elif _moved(dt, watermarks) is not None:
                # The remembered snapshot may just be older than the caller's ``expected`` (it
                # read the watermark elsewhere): decide on the latest snapshot. Safe because an
                # app id's versions only grow (``expected < version`` is enforced), so a
                # watermark that moved away from ``expected`` never comes back to it.
                dt, base = self._fresh()
            if dt is None:
                if any(exp for exp, _ in watermarks.values()):
                    first = next(a for a, (exp, _) in watermarks.items() if exp)
                    raise FenceConflictError(first, watermarks[first][0], 0)
                schema = table.schema if table is not None and table.num_columns else self._schema
                if schema is not None and isinstance(self._write, Merge) and table is not None \
                        and table.num_columns:
                    self._write.check(table)
                if schema is None:
                    raise UsageError(f"{self._safe_uri()}: no table yet and no schema to create "
                                     "it with: pass schema= or call ensure_table() first")
                self.ensure_table(schema)
                dt, base = self._fresh()
                if dt is None:  # ensure_table returned, so someone deleted it since
                    raise TableNotFoundError(f"{self._safe_uri()}: table vanished after creation")
            conflict = _moved(dt, watermarks)
            if conflict is not None:
                with self._lock:
                    self._snapshots[app_id] = dt
                    self._bases[app_id] = base
                raise FenceConflictError(*conflict)
            empty = table is None or table.num_rows == 0
            merge = isinstance(self._write, Merge) and not empty
            props = CommitProperties(app_transactions=[
                *(Transaction(a, v) for a, (_, v) in watermarks.items()),
                *(Transaction(k, v) for k, v in (markers or {}).items())],
                custom_metadata=self._lineage(app_id, version, "merge" if merge else (
                    "empty" if empty else "append"), lineage))
            hooks = self._maintenance.commit_hooks()
            for attempt in range(CONFLICT_RETRIES + 1):
                try:
                    if empty:
                        self._empty_commit(dt, props)
                    elif merge:
                        assert table is not None and isinstance(self._write, Merge)
                        merge_into(dt, table, self._write, props, self._safe_uri(), hooks)
                        if _txn(dt, moving) != watermarks[moving][1]:
                            # delta-rs commits no version for a merge that changes no row: record
                            # the watermark alone, fenced against the same snapshot.
                            self._empty_commit(dt, props)
                    elif table is not None:  # always, when not empty
                        write_deltalake(dt, table, mode="append", commit_properties=props,
                                        post_commithook_properties=hooks)
                    break
                except CommitFailedError as e:
                    fresh, base = self._fresh()
                    conflict = _moved(fresh, watermarks)
                    with self._lock:
                        self._snapshots[app_id] = fresh
                        self._bases[app_id] = base
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
            if _txn(dt, moving) != watermarks[moving][1]:
                before = dt.version()
                dt.update_incremental()
                written = self._find_version(dt, before, moving, watermarks[moving][1])
            else:
                written = dt.version()
            with self._lock:
                self._snapshots[app_id] = dt
                self._bases[app_id] = base
                if written is not None:
                    self._versions.append(written)

    def _empty_commit(self, dt: DeltaTable, props: CommitProperties) -> None:
        """A commit with no data actions (only the transactions and the commit info)."""
        hooks = self._maintenance.commit_hooks()
        dt.create_write_transaction(actions=[], mode="append", schema=dt.schema(),
                                    commit_properties=props, post_commithook_properties=hooks)

    def _lineage(self, app_id: str, watermark: int, operation: str,
                 lineage: Mapping[str, object] | None) -> dict[str, str]:
        """The commit's ``custom_metadata`` (see the module docstring)."""
        md = {_lineage_key(k): str(v) for k, v in (lineage or {}).items() if v is not None}
        md.update({"cg.app_id": app_id, "cg.watermark": str(watermark),
                   "cg.write_mode": self._write.name, "cg.operation": operation,
                   "cg.library_version": __version__})
        md.update(self._extra_md)
        # The coverage (up to ~3 bytes a message, machine-read by reconcile) is written once:
        # userMetadata is the human-facing copy (Spark's DESCRIBE HISTORY).
        md["userMetadata"] = json.dumps(
            {k[len(LINEAGE_PREFIX):]: v for k, v in sorted(md.items())
             if k != _lineage_key(COVERAGE_KEY)}, separators=(",", ":"))
        return md

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
            snap = DeltaTable(self._uri, version=v, storage_options=self._options or None)
            if _txn(snap, app_id) == watermark:
                return v
        return None

    # ---------------------------------------------------------------- table management

    def ensure_table(self, schema: pa.Schema) -> bool:
        """Create the table empty (schema, partitioning, ``delta.checkpointInterval``, the
        retention properties of :meth:`Maintenance.table_properties
        <cg_pipelines.sinks.maintenance.Maintenance.table_properties>`; no data, no
        transaction) unless it exists. Idempotent and safe under concurrency: of concurrent
        creators exactly one writes version 0, the others see the table and return.

        Args:
            schema: the table's columns (nanosecond timestamps are created as microseconds).

        Returns:
            True if this call created the table.

        Raises:
            DeltaError / OSError: the table could not be created and does not exist.
        """
        with self._guard():
            if self._load() is not None:
                return False
            try:
                DeltaTable.create(
                    self._uri,
                    delta_schema(schema),
                    mode="error",
                    partition_by=self._partition_columns(schema),
                    configuration={"delta.checkpointInterval": str(self._checkpoint_interval),
                                   **self._maintenance.table_properties()},
                    storage_options=self._options or None,
                    # No retry: a losing creator must not re-create the table at version 1.
                    commit_properties=CommitProperties(max_commit_retries=0,
                                                       custom_metadata=self._create_lineage()),
                )
            except DeltaError:
                if self._load() is None:
                    raise
                return False
            return True

    def _create_lineage(self) -> dict[str, str]:
        """Version 0's ``custom_metadata``: ``cg.operation`` = ``create``, ``cg.write_mode``,
        ``cg.library_version`` and the sink's own ``commit_metadata`` (no partition, app id or
        watermark: the table is created for every partition)."""
        md = {"cg.operation": "create", "cg.write_mode": self._write.name,
              "cg.library_version": __version__, **self._extra_md}
        md["userMetadata"] = json.dumps({k[len(LINEAGE_PREFIX):]: v for k, v in sorted(md.items())},
                                        separators=(",", ":"))
        return md

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
        """Replace every row of consumer-group ``partition`` with ``data``, keeping ``app_id``'s
        watermark at ``expected``, in ONE Delta commit, fenced like :meth:`commit`: it is
        written only if the watermark is still ``expected`` in the snapshot :meth:`watermark`
        remembered (and no commit of ``app_id`` came after it). ``fenced`` (``{app id:
        watermark}``): further watermarks kept at their value and fenced the same way (a
        co-partitioned rebuild keeps every input's).

        Append mode: ``data`` is streamed into the new files (never held whole in memory).
        Merge mode: ``data`` is the partition's output rows in stream order (a replay of its
        history); it is reduced as it is read to each key's last row (memory: one row per key
        plus one batch), keys whose last row is a delete marker are dropped, and the rest
        replace the partition's rows: the table then equals what draining the same history
        would have left. Every row must have ``PARTITION_COLUMN == partition`` (delta-rs checks
        the replace predicate). A failure while reading ``data`` (e.g. the transform raising)
        writes nothing. ``lineage`` as for :meth:`commit`. Afterwards
        :attr:`last_rows_written` holds the rows written.

        Returns:
            The number of rows the partition had before (the rows replaced).

        Raises:
            FenceConflictError: another holder committed ``app_id`` since the snapshot.
            DeltaError / OSError: I/O, schema or predicate errors; nothing was committed.
        """
        with self._guard(), self._app_lock(app_id):
            with self._lock:
                dt = self._snapshots.get(app_id)
            if dt is None:
                dt = self._load()
            if dt is None:
                raise TableNotFoundError(f"{self._safe_uri()}: no Delta table to replace in")
            kept = {app_id: (expected, expected),
                    **{a: (v, v) for a, v in (fenced or {}).items()}}
            conflict = _moved(dt, kept)
            if conflict is not None:
                raise FenceConflictError(*conflict)
            before = self._partition_rows(dt, partition)
            props = CommitProperties(app_transactions=[
                *(Transaction(a, v) for a, (v, _) in kept.items()),
                *(Transaction(k, v) for k, v in (markers or {}).items())],
                custom_metadata=self._lineage(app_id, expected, "replace_partition",
                                              {"partition": partition, **(lineage or {})}))
            counted: dict[str, int] = {"rows": 0}
            source: pa.RecordBatchReader | pa.Table
            if isinstance(self._write, Merge):
                source = current_of(data, self._write, pa.schema(dt.schema().to_arrow()),
                                    self._safe_uri())
                counted["rows"] = source.num_rows
            else:
                source = counting(data, counted)
            try:
                write_deltalake(dt, source, mode="overwrite",
                                predicate=f"{PARTITION_COLUMN} = {int(partition)}",
                                commit_properties=props,
                                post_commithook_properties=self._maintenance.commit_hooks())
            except CommitFailedError as e:
                fresh, base = self._fresh()
                conflict = _moved(fresh, kept)
                with self._lock:
                    self._snapshots[app_id] = fresh
                    self._bases[app_id] = base
                if conflict is not None:
                    raise FenceConflictError(*conflict) from e
                raise
            with self._lock:
                self._snapshots.pop(app_id, None)
                self._bases.pop(app_id, None)
                self._views.pop(app_id, None)
                self._versions.append(dt.version())
            self.last_rows_written = counted["rows"]
            return before

    def _partition_columns(self, schema: pa.Schema) -> list[str] | None:
        if self._partition_by is not None:
            return self._partition_by or None
        return [PARTITION_COLUMN] if PARTITION_COLUMN in schema.names else None
