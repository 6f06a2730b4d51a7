"""Apache Iceberg sink over ``pyiceberg`` 0.12: fenced, exactly-once commits beside Delta.

The contract is :class:`~cg_pipelines.sinks.base.TableSink` (as
:class:`~cg_pipelines.sinks.delta.DeltaSink`'s): one :meth:`IcebergSink.commit` is ONE catalog
commit that writes the batch's rows and moves every side's watermark, only if each is still
the one the batch was based on.

Watermarks: the table PROPERTY ``cg.watermark.<app_id>`` (table properties are cumulative in
Iceberg; snapshot summary properties belong to one snapshot), set by the same transaction as
the data. Markers (``{app id: version}``) are properties too. Each commit's snapshot summary
carries the Delta sink's lineage keys (:mod:`cg_pipelines.sinks.lineage`).

The fence (checked by experiment on pyiceberg 0.12.0, SQL catalog on SQLite and Postgres,
local disk and moto S3; see ``tests/iceberg``):

* pyiceberg's own retry is out of the way: a table this sink creates (or first writes to) has
  ``commit.retry.num-retries = 0``. Otherwise a commit that lost a race is refreshed and
  replayed by pyiceberg on the NEW table state without any validation for appends — a
  zombie's append would land (checked: ``tests/iceberg/test_iceberg_sink.py``).
* Every commit of this sink adds a snapshot to ``main`` (an empty batch commits an empty
  append), and each of pyiceberg's snapshot producers asserts ``main`` is still the snapshot
  the transaction was built on (``AssertRefSnapshotId``), checked by the catalog under its
  compare-and-swap of the metadata location. So the watermark read from that table state
  cannot have moved unseen: if any commit landed in between, the catalog refuses ours
  (``CommitFailedException``).
* On that refusal the sink reloads the table and re-reads the watermark: moved →
  :class:`~cg_pipelines.sinks.base.FenceConflictError` (nothing written; the files of the
  failed attempt are deleted by pyiceberg); unchanged → the commit was lost to another
  partition (or to maintenance): it is rebuilt on the fresh table and tried again (up to
  ``commit_retries`` times, with a short jittered back-off) — another partition's commit is
  retried, never fenced.

Write modes (:mod:`cg_pipelines.core.write`): :class:`Append` appends (one snapshot per
batch). :class:`Merge` reduces the batch to each key's last row (deletes when it is a delete
marker) and, in ONE transaction, deletes the partition's rows of those keys (copy-on-write:
pyiceberg rewrites the data files that hold them) and appends the live rows: one commit, with
up to two snapshots (``overwrite``/``delete`` then ``append``), both carrying the summary. A
composite key, or more than :data:`IN_PRUNE_LIMIT` keys in the batch, rewrites the batch's
partition whole (one file afterwards).

Tables: identity-partitioned on :data:`~cg_pipelines.sinks.base.PARTITION_COLUMN` when the
schema has it; columns are created optional (nullable); nanosecond timestamps are stored as
microseconds (Iceberg v2 has no nanoseconds; batches are truncated on write).

Catalogs: any pyiceberg catalog (``catalog=`` a :class:`pyiceberg.catalog.Catalog` or the
properties of :func:`pyiceberg.catalog.load_catalog`): :func:`sqlite_catalog` (embedded, no
server), a Postgres-backed SQL catalog (:func:`sql_catalog`), REST (``{"type": "rest",
"uri": ...}``; the fence only needs ``AssertRefSnapshotId``, which REST servers check).

Maintenance (:meth:`IcebergSink.maintain`, under the partition's lease): the partition's
small files compacted in one fenced transaction (:mod:`cg_pipelines.sinks.iceberg_compact`,
the thresholds of Delta's :class:`~cg_pipelines.sinks.maintenance.Maintenance`), then snapshot
expiry; the catalog keeps ``write.metadata.previous-versions-max`` old metadata files. pyiceberg
0.12 deletes no file: those compacted or expired away stay until Spark/Java Iceberg's
``remove_orphan_files`` deletes them. Append mode reads state through per-partition snapshots
(:mod:`cg_pipelines.sinks.iceberg_state`).

The sink is composed of parts, as :class:`~cg_pipelines.sinks.delta.DeltaSink` is:
:class:`~cg_pipelines.sinks.iceberg_read.IcebergReader` (loads, reads, state reads,
statistics), :class:`~cg_pipelines.sinks.iceberg_write.IcebergWriter` (watermarks, fenced
commits, partition replaces, table creation; it holds each app id's base table state) and
:class:`~cg_pipelines.sinks.iceberg_maintain.IcebergMaintainer` (upkeep); snapshot summaries
come from :class:`~cg_pipelines.sinks.lineage.CommitLineage`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.catalog import Catalog, load_catalog
from pyiceberg.expressions import BooleanExpression
from pyiceberg.table import Table

from cg_pipelines.core.errors import UsageError
from cg_pipelines.core.write import Append, Merge
from cg_pipelines.sinks.base import Fences, TableStats
from cg_pipelines.sinks.iceberg_maintain import IcebergMaintainer
from cg_pipelines.sinks.iceberg_read import (
    WATERMARK_PREFIX,
    IcebergReader,
    iceberg_s3_properties,
    optional_schema,
    sql_catalog,
    sqlite_catalog,
)
from cg_pipelines.sinks.iceberg_state import IcebergStates
from cg_pipelines.sinks.iceberg_write import IN_PRUNE_LIMIT, MANIFEST_MERGE, IcebergWriter
from cg_pipelines.sinks.lineage import CommitLineage
from cg_pipelines.sinks.maintenance import Maintenance
from cg_pipelines.sinks.storage import mask_options

__all__ = ["IN_PRUNE_LIMIT", "MANIFEST_MERGE", "WATERMARK_PREFIX", "IcebergSink",
           "iceberg_s3_properties", "sql_catalog", "sqlite_catalog"]


class IcebergSink:
    """A :class:`~cg_pipelines.sinks.base.TableSink` (and
    :class:`~cg_pipelines.sinks.base.MaintainedSink`) over one Iceberg table.

    Thread-safe for concurrent use with different app ids; calls for one app id must not
    overlap (the engine runs one holder per partition).

    Errors: :class:`~cg_pipelines.sinks.base.FenceConflictError` when a watermark moved;
    pyiceberg errors (``CommitFailedException`` after ``commit_retries`` lost races,
    ``NoSuchTableError``, ``ValidationException``), ``OSError`` for I/O, ``UsageError`` (a
    ``ValueError``) for bad input.
    """

    table_format: ClassVar[str] = "iceberg"
    """The table format (Dagster's ``dagster/storage_kind``)."""

    def __init__(
        self,
        identifier: str,
        *,
        catalog: Catalog | Mapping[str, str],
        schema: pa.Schema | None = None,
        write: Append | Merge | None = None,
        commit_metadata: Mapping[str, str] | None = None,
        commit_retries: int = 100,
        keep_snapshots: int = 20,
        metadata_versions: int = 20,
        maintenance: Maintenance | None = None,
    ) -> None:
        """
        Args:
            identifier: ``namespace.table`` (the namespace is created when missing).
            catalog: a pyiceberg catalog, or ``load_catalog`` properties (``name`` key
                optional, default ``"cg"``; secret values never appear in ``repr``).
            schema: the table's schema when it is created by an empty first commit.
            write: :class:`Append` (default) or :class:`Merge`.
            commit_metadata: extra lineage in every snapshot summary (``cg.`` prefixed).
            commit_retries: commits lost to OTHER partitions retried before giving up.
            keep_snapshots: :meth:`maintain` expires all but the newest this many snapshots
                once there are half as many more (default 20: time travel only, expiry deletes
                no file). Commits are built on a view without the old snapshots
                (:mod:`cg_pipelines.sinks.iceberg_view`), so their cost no longer grows with
                this number (pyiceberg 0.12 deep-copies the metadata ~25 times a commit);
                loading the table still parses them all.
            metadata_versions: ``write.metadata.previous-versions-max`` of a created table
                (default 20; copied with the metadata as above).
            maintenance: :meth:`maintain`'s compaction (``compact``, ``compact_min_files``,
                ``target_size``; default :class:`~cg_pipelines.sinks.maintenance.Maintenance`'s:
                16 small files, 128 MiB) and ``snapshots`` (append: state snapshots carried
                over a compaction); its Delta settings (VACUUM, log) do not apply.

        Raises:
            UsageError: no namespace in ``identifier``; ``write`` not Append/Merge/None;
                ``commit_retries < 0`` or ``keep_snapshots < 1``.
        """
        if "." not in identifier:
            raise UsageError(f"identifier must be 'namespace.table', got {identifier!r}")
        if write is not None and not isinstance(write, (Append, Merge)):
            raise UsageError(f"write must be Append() or Merge(key=...), got {write!r}")
        if commit_retries < 0 or keep_snapshots < 1:
            raise UsageError("need commit_retries >= 0 and keep_snapshots >= 1")
        self._ident = identifier
        self._catalog_props: dict[str, str] = {}
        if isinstance(catalog, Catalog):
            self._catalog: Catalog = catalog
        else:
            props = dict(catalog)
            self._catalog_props = props
            self._catalog = load_catalog(props.pop("name", "cg"), **props)
        table_schema = optional_schema(schema) if schema is not None else None
        self._write: Append | Merge = write if write is not None else Append()
        lineage = CommitLineage(self._write.name, commit_metadata, user_metadata=False)
        self._reader = IcebergReader(self._catalog, identifier, table_schema, IcebergStates()
                                     if isinstance(self._write, Append) else None)
        self._writer = IcebergWriter(self._catalog, identifier, self._reader, self._write,
                                     lineage, schema=table_schema,
                                     commit_retries=commit_retries,
                                     metadata_versions=metadata_versions)
        self._maintainer = IcebergMaintainer(
            self._reader, self._writer, lineage,
            maintenance if maintenance is not None else Maintenance(), keep_snapshots)

    # ---------------------------------------------------------------- properties

    @property
    def identifier(self) -> str:
        """The table's ``namespace.table``."""
        return self._ident

    @property
    def catalog(self) -> Catalog:
        """The table's pyiceberg catalog."""
        return self._catalog

    @property
    def write(self) -> Append | Merge:
        """The write mode (:class:`Append` or :class:`Merge`)."""
        return self._write

    @property
    def maintenance(self) -> Maintenance:
        """The maintenance policy."""
        return self._maintainer.policy

    @property
    def uri(self) -> str:
        """The table's location (``file://...``, ``s3://...``) once it exists, else
        ``iceberg:<identifier>``."""
        tbl = self._reader.load()
        return tbl.location() if tbl is not None else f"iceberg:{self._ident}"

    @property
    def versions_written(self) -> list[int]:
        """As :attr:`snapshots_written` (the name the Dagster asset's metadata reads)."""
        return self.snapshots_written

    @property
    def snapshots_written(self) -> list[int]:
        """Snapshot ids this sink object committed (the last snapshot of each commit)."""
        return self._writer.snapshots_written

    @property
    def last_rows_written(self) -> int | None:
        """The rows the last :meth:`replace_partition` wrote (None before any)."""
        return self._writer.last_rows_written

    @property
    def commit_retries_used(self) -> int:
        """Commits this sink object tried again after losing a race to another partition."""
        return self._writer.commit_retries_used

    def __repr__(self) -> str:
        return (f"IcebergSink({self._ident!r}, catalog={mask_options(self._catalog_props)!r}, "
                f"write={self._write!r})")

    # ---------------------------------------------------------------- reads (IcebergReader)

    def load(self) -> Table | None:
        """``IcebergReader.load``: the latest state, None without a table."""
        return self._reader.load()

    def exists(self) -> bool:
        """``IcebergReader.exists``."""
        return self._reader.exists()

    def read(self, columns: list[str] | None = None,
             row_filter: BooleanExpression | str | None = None,
             filter: pc.Expression | None = None) -> pa.Table:
        """``IcebergReader.read``: the latest rows, projected and filtered."""
        return self._reader.read(columns, row_filter, filter)

    def read_partitions(self, partitions: Sequence[int] | None = None) -> pa.Table:
        """``IcebergReader.read_partitions``."""
        return self._reader.read_partitions(partitions)

    def data_files(self, row_filter: BooleanExpression | None = None) -> list[str]:
        """``IcebergReader.data_files``."""
        return self._reader.data_files(row_filter)

    def partition_data_files(self, partitions: Sequence[int] | None = None) -> list[str]:
        """``IcebergReader.partition_data_files``."""
        return self._reader.partition_data_files(partitions)

    def last_rows(self, key: str, keys: Sequence[object], columns: Sequence[str],
                  order_by: str, partition: int | None = None, *,
                  app_id: str | None = None) -> pa.Table:
        """``IcebergReader.last_rows``: each key's last committed row (the state-sink contract)."""
        return self._reader.last_rows(key, keys, columns, order_by, partition, app_id=app_id)

    def stats(self, partition: int | None = None) -> TableStats:
        """``IcebergReader.stats``."""
        return self._reader.stats(partition)

    def history(self) -> list[dict[str, Any]]:
        """``IcebergReader.history``: every snapshot's summary, oldest first."""
        return self._reader.history()

    # ---------------------------------------------------------------- the TableSink contract

    def watermark(self, app_id: str) -> int:
        """``app_id``'s watermark (0 if none or no table) in the latest table state, which the
        next :meth:`commit` whose first fence is ``app_id`` is then based on.

        Raises:
            pyiceberg errors: the catalog cannot be read.
        """
        return self._writer.watermark(app_id)

    def watermarks(self, app_ids: Iterable[str]) -> dict[str, int]:
        """Each app id's watermark from one load (read-only: remembers nothing).

        Raises:
            pyiceberg errors: the catalog cannot be read.
        """
        return self._writer.watermarks(app_ids)

    def commit(self, table: pa.Table | None, fences: Fences, *,
               markers: Mapping[str, int] | None = None,
               lineage: Mapping[str, object] | None = None) -> None:
        """Write ``table`` (append, or merge by key) and move every watermark of ``fences``
        (``{app id: (expected, version)}``) in ONE catalog commit, only if each is still its
        ``expected`` (:meth:`TableSink.commit <cg_pipelines.sinks.base.TableSink.commit>`; see
        the module docstring for the fence). The commit is based on the table state the first
        app id's :meth:`watermark` loaded; the catalog refuses it when the table moved since
        (``AssertRefSnapshotId``), and it is then decided again on the new state. Creates the
        table on first use. A one-input commit is the one-fence case
        (:func:`~cg_pipelines.sinks.base.commit_one`).

        Raises:
            FenceConflictError: a watermark is not its ``expected``; nothing was written.
            UsageError: no fence, a ``version < expected``, no version moves; no table and no
                schema.
            ContractError: merge input without the required columns or with null keys, or
                of other partitions; columns that differ from the table's.
            CommitFailedException: ``commit_retries`` races lost to other partitions.
        """
        self._writer.commit(table, fences, markers, lineage=lineage)

    def ensure_table(self, schema: pa.Schema) -> bool:
        """Create the table empty (columns optional; identity partition on
        :data:`~cg_pipelines.sinks.base.PARTITION_COLUMN` when present;
        ``commit.retry.num-retries=0``) unless it exists; safe under concurrency (a losing
        creator finds the table). Returns True if this call created it.

        Raises:
            pyiceberg errors: the table could not be created and does not exist.
        """
        return self._writer.ensure_table(schema)

    def replace_partition(
        self, data: pa.RecordBatchReader, partition: int, app_id: str, expected: int,
        markers: Mapping[str, int] | None = None, *,
        lineage: Mapping[str, object] | None = None,
        fenced: Mapping[str, int] | None = None,
    ) -> int:
        """Replace consumer-group ``partition``'s rows with ``data`` keeping ``app_id``'s
        watermark at ``expected``, in ONE commit fenced like :meth:`commit` (Merge mode:
        ``data`` is the partition's history, reduced to each key's live last row). ``data``
        is held in memory (pyiceberg 0.12 cannot stream into a partitioned table).
        ``fenced`` (``{app id: watermark}``): further watermarks kept and fenced the same way
        (a co-partitioned rebuild keeps every input's).

        Returns:
            The rows the partition had before.

        Raises:
            FenceConflictError: a kept watermark moved.
            ContractError: a row of ``data`` holds another partition.
            NoSuchTableError: no table.
        """
        return self._writer.replace_partition(data, partition, app_id, expected, markers,
                                              lineage=lineage, fenced=fenced)

    def maintain(self, partition: int, app_id: str) -> dict[str, int | float | str]:
        """Compact ``partition``'s small files when due (:mod:`cg_pipelines.sinks.
        iceberg_compact`, one fenced transaction), then expire old snapshots in batches
        (:mod:`cg_pipelines.sinks.iceberg_expire`: down to ``keep_snapshots`` once above half
        as many more; metadata only, never one a ref points at; any partition's call expires
        the whole table's). Called under the partition's lease after its last commit; changes
        no row and no watermark. Returns figures for the run's metadata
        (``iceberg_compaction``, ``iceberg_files_compacted``, ``iceberg_files_live``,
        ``iceberg_snapshots``, ``iceberg_snapshots_expired``, ``iceberg_expire_seconds``); a
        failure is reported as ``error`` (type and message), not raised."""
        return self._maintainer.maintain(partition, app_id)
