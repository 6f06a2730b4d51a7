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

The sink is composed of parts over one object it owns
(:class:`~cg_pipelines.sinks.deltahandle.DeltaHandle`: the table's location, filesystem,
snapshots and locks): :class:`~cg_pipelines.sinks.deltacommit.DeltaWriter` (watermarks and
fenced commits), :class:`~cg_pipelines.sinks.deltaread.DeltaReader` (reads and state reads) and
:class:`~cg_pipelines.sinks.maintenance.DeltaMaintainer` (upkeep); commit infos come from
:class:`~cg_pipelines.sinks.lineage.CommitLineage`.

Upkeep (:mod:`cg_pipelines.sinks.maintenance`, :meth:`DeltaSink.maintain`, called by the
engine after a run's last commit): compaction of the partition's small files, the per-partition
state snapshots that keep :meth:`last_rows` independent of the table's age
(:mod:`cg_pipelines.sinks.partstate`), VACUUM and log cleanup. ``docs/growth.md`` lists what
grows and what bounds it.

One snapshot per run: a run's state reads (:meth:`last_rows` with the run's ``app_id``) and its
upkeep (:meth:`maintain`) use the snapshot its :meth:`watermark` read loaded, as its commits
advanced it, instead of a snapshot update of their own (delta-rs lists ``_delta_log`` for each:
on local disk the whole directory, whose entries the log retention bounds). Exact under the
engine's contract (:meth:`~cg_pipelines.sinks.base.TableSink.last_rows`,
:class:`~cg_pipelines.sinks.base.MaintainedSink`); a state read without ``app_id``, or outside
a run, reads the latest version. ``docs/growth.md`` has the figures.

Reads go through pyarrow datasets over a native pyarrow filesystem (local or ``S3FileSystem``),
not delta-rs' default Python filesystem handler: with that handler the interpreter sometimes
aborts at exit ("terminate called without an active exception", delta-rs issue #2184).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

import pyarrow as pa

from cg_pipelines.core.errors import UsageError
from cg_pipelines.core.storage_keys import check_storage_options
from cg_pipelines.core.write import Append, Merge
from cg_pipelines.sinks.base import Fences, TableStats
from cg_pipelines.sinks.deltacommit import DeltaWriter
from cg_pipelines.sinks.deltahandle import DeltaHandle
from cg_pipelines.sinks.deltaread import DeltaReader
from cg_pipelines.sinks.deltawrite import delta_schema
from cg_pipelines.sinks.lineage import LINEAGE_PREFIX, CommitLineage
from cg_pipelines.sinks.maintenance import DeltaMaintainer, Maintenance
from cg_pipelines.sinks.storage import mask_options, s3_options

if TYPE_CHECKING:
    import pyarrow.dataset as pads  # imports pandas: annotations only

__all__ = ["LINEAGE_PREFIX", "DeltaSink", "Maintenance", "TableStats"]


class DeltaSink:
    """A :class:`~cg_pipelines.sinks.base.TableSink` (and
    :class:`~cg_pipelines.sinks.base.MaintainedSink`) over one Delta table (local path or
    ``s3://``).

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
            storage_options: delta-rs object store options (see :meth:`s3_options`), checked
                against the keys the store of ``uri`` reads
                (:mod:`cg_pipelines.core.storage_keys`: the S3, Azure and GCS keys of
                object_store and delta-rs); secret values never appear in ``repr`` or in
                exceptions raised here.
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
            ConfigError: a storage option key the store of ``uri`` does not read (named,
                with the nearest known key), or a value that is not a string.
        """
        if maintenance is not None and not isinstance(maintenance, Maintenance):
            raise UsageError(f"maintenance must be a Maintenance, got {maintenance!r}")
        if checkpoint_interval < 1:
            raise UsageError("checkpoint_interval must be >= 1")
        if write is not None and not isinstance(write, (Append, Merge)):
            raise UsageError(f"write must be Append() or Merge(key=...), got {write!r}")
        self._write: Append | Merge = write if write is not None else Append()
        policy = maintenance if maintenance is not None else Maintenance()
        lineage = CommitLineage(self._write.name, commit_metadata)
        table_schema = delta_schema(schema) if schema is not None else None
        self._partition_by = list(partition_by) if partition_by is not None else None
        options = dict(storage_options or {})
        check_storage_options(uri, options)
        self._handle = DeltaHandle(uri, options)
        self._reader = DeltaReader(self._handle, self._write, table_schema)
        self._writer = DeltaWriter(self._handle, self._write, lineage, policy,
                                   schema=table_schema, partition_by=self._partition_by,
                                   checkpoint_interval=checkpoint_interval)
        self._maintainer = DeltaMaintainer(self._handle, policy, self._write, lineage)

    # ---------------------------------------------------------------- configuration helpers

    #: delta-rs storage options for S3 or an S3-compatible endpoint (see
    #: :func:`cg_pipelines.sinks.storage.s3_options`).
    s3_options = staticmethod(s3_options)

    @property
    def uri(self) -> str:
        """The table root as given."""
        return self._handle.uri

    @property
    def write(self) -> Append | Merge:
        """The write mode (:class:`Append` or :class:`Merge`)."""
        return self._write

    @property
    def maintenance(self) -> Maintenance:
        """The maintenance policy."""
        return self._maintainer.policy

    @property
    def versions_written(self) -> list[int]:
        """Delta versions this sink object committed so far (commits and replaces, in order)."""
        return self._writer.versions_written

    @property
    def last_rows_written(self) -> int | None:
        """The rows the last :meth:`replace_partition` wrote (None before any)."""
        return self._writer.last_rows_written

    def __repr__(self) -> str:
        return (
            f"DeltaSink(uri={self._handle.safe_uri()!r}, "
            f"storage_options={mask_options(self._handle.options)!r}, "
            f"partition_by={self._partition_by!r}, write={self._write!r})"
        )

    # ---------------------------------------------------------------- the TableSink contract

    def watermark(self, app_id: str) -> int:
        """The last committed version (sequence) of ``app_id``, 0 if none or no table yet.

        Loads the latest snapshot (``update_incremental`` of the one this sink holds for
        ``app_id``, else, or when that one is
        :data:`~cg_pipelines.sinks.deltahandle.SNAPSHOT_RELOAD_VERSIONS` versions past its last
        fresh load, a fresh load) and remembers it: the next :meth:`commit` for ``app_id`` is
        fenced against it. Creates nothing.

        Raises:
            DeltaError / OSError: the table cannot be read (not retried).
        """
        return self._writer.watermark(app_id)

    def watermarks(self, app_ids: Iterable[str]) -> dict[str, int]:
        """The committed watermark of each of ``app_ids`` from ONE load of the latest snapshot
        (0 for none, or no table yet). Read-only: unlike :meth:`watermark`, nothing is
        remembered to fence a later commit (for observers such as the backlog sensor).

        Raises:
            DeltaError / OSError: the table cannot be read.
        """
        return self._writer.watermarks(app_ids)

    def commit(self, table: pa.Table | None, fences: Fences, *,
               markers: Mapping[str, int] | None = None,
               lineage: Mapping[str, object] | None = None) -> None:
        """Write ``table`` (append, or merge by key in :class:`Merge` mode) and move every
        watermark of ``fences`` (``{app id: (expected, version)}``) in ONE Delta commit, only
        if each is still its ``expected`` (:meth:`TableSink.commit
        <cg_pipelines.sinks.base.TableSink.commit>`). Every app id is an application
        transaction of the commit; the first is the commit's ``cg.app_id`` and the one whose
        remembered snapshot (:meth:`watermark`) the commit is fenced against, so delta-rs
        rejects it when a commit after that snapshot carries any of them. ``markers`` (``{key:
        version}``) are recorded as further application transactions (not fenced; read back
        with :meth:`watermark`). ``lineage`` (e.g. ``stream``, ``group``, ``partition``,
        ``first_seq``, ``last_seq``) goes into the commit's ``custom_metadata`` as
        ``cg.<name>`` (values as strings).

        ``table``: rows to append (any schema the table accepts; ``None`` or 0 rows records
        only the watermarks). Creates the table (schema only, see :meth:`ensure_table`) if it
        does not exist. A one-input commit is the one-fence case
        (:func:`~cg_pipelines.sinks.base.commit_one`).

        Raises:
            FenceConflictError: a watermark is not its ``expected`` (in the remembered
                snapshot, and in the latest one), or a concurrent commit with the first app id
                won after that snapshot; nothing was written.
            UsageError: no fence, a ``version < expected``, no version moves, or the table
                does not exist, ``table`` has no columns and no ``schema`` was given.
            ContractError: in merge mode, a required column is missing, a key is null, or the
                output's columns differ from the table's.
            DeltaError / OSError: I/O or schema errors from delta-rs (not retried); a
                ``CommitFailedError`` that is not a fence conflict (e.g. a concurrent metadata
                change) is re-raised as is; nothing was written.
        """
        self._writer.commit(table, fences, markers, lineage=lineage)

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
        return self._writer.ensure_table(schema)

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
        return self._writer.replace_partition(
            data, partition, app_id, expected, markers, lineage=lineage, fenced=fenced)

    def exists(self) -> bool:
        """Whether the Delta table exists (has a log).

        Raises:
            DeltaError / OSError: other read errors (e.g. a missing bucket).
        """
        return self._reader.exists()

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
        return self._reader.read(columns, filter)

    def read_partitions(self, partitions: Sequence[int] | None = None) -> pa.Table:
        """:meth:`read` of the rows of ``partitions`` (``None``: all), pruned by the
        partition column (the :class:`~cg_pipelines.sinks.base.TableSink` read).

        Raises:
            DeltaError / OSError / pyarrow errors: read failures.
        """
        return self._reader.read_partitions(partitions)

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
        :meth:`TableSink.last_rows <cg_pipelines.sinks.base.TableSink.last_rows>`).

        In append mode, for one partition of a table partitioned by :data:`PARTITION_COLUMN`
        (the default), the rows come from the partition's state snapshot caught up from the
        files committed since (:mod:`cg_pipelines.sinks.partstate`): the cost does not grow
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
                then come from the snapshot the run's watermark read loaded, with no reload
                (:meth:`DeltaHandle.run_view
                <cg_pipelines.sinks.deltahandle.DeltaHandle.run_view>`); exact only under the
                engine's contract
                (:meth:`TableSink.last_rows <cg_pipelines.sinks.base.TableSink.last_rows>`:
                after that read, under the lease, never for a key the run committed since).
                None (any other caller): the latest version.

        Returns:
            One row per key found, sorted by key; no rows when ``keys`` is empty or the table
            does not exist yet.

        Raises:
            ColumnNotFoundError: ``key`` or ``order_by`` missing from the table.
            DeltaError / OSError / pyarrow errors: read failures.
        """
        return self._reader.last_rows(key, keys, columns, order_by, partition, app_id=app_id)

    def stats(self, partition: int | None = None) -> TableStats:
        """The latest version's statistics, from the Delta log (no data files are read).

        Args:
            partition: also count the rows of this consumer-group partition (from the files'
                partition values; ``None`` when the table is not partitioned by
                :data:`PARTITION_COLUMN`).

        Raises:
            TableNotFoundError: no table. DeltaError / OSError: read failures.
        """
        return self._reader.stats(partition)

    def file_uris(self) -> list[str]:
        """URIs of the latest version's data files (empty when there is no table)."""
        return self._reader.file_uris()

    def maintain(self, partition: int, app_id: str) -> dict[str, int | float | str]:
        """Maintain ``partition`` (see the module docstring); call it while holding its lease,
        after the last commit. Never raises for a maintenance failure: returns it as
        ``error`` (with the figures so far).

        Returns:
            Figures for run metadata: ``maintain_s`` (seconds), ``files_live`` (the partition's
            live data files afterwards), ``compact`` ("no", "done", "fenced", "failed"),
            ``files_compacted``, ``files_added``, ``snapshots_written``, ``vacuum`` ("no",
            "done"), ``files_vacuumed``, ``log_cleanup`` ("done" when it ran),
            ``log_keep_from`` (the oldest version kept), ``log_files_deleted``.
        """
        return self._maintainer.maintain(partition, app_id)
