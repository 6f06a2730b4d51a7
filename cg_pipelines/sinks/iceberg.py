"""Apache Iceberg sink over ``pyiceberg`` 0.12: fenced, exactly-once commits beside Delta.

The contract is :class:`~cg_pipelines.sinks.delta.DeltaSink`'s (the engine's
:class:`~cg_pipelines.sinks.base.ReplaceSink`): one :meth:`IcebergSink.commit` is ONE catalog
commit that writes the batch's rows and moves the partition's watermark, only if the watermark
is still the one the batch was based on.

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
"""

from __future__ import annotations

import random
import threading
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar, Final

import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.catalog import Catalog, load_catalog
from pyiceberg.exceptions import (
    CommitFailedException,
    NamespaceAlreadyExistsError,
    TableAlreadyExistsError,
)
from pyiceberg.expressions import AlwaysTrue, And, BooleanExpression
from pyiceberg.table import Table

from cg_pipelines.core.errors import ContractError, UsageError
from cg_pipelines.core.write import DELETE_COLUMN, Append, Merge
from cg_pipelines.sinks.base import PARTITION_COLUMN, FenceConflictError, check_watermarks
from cg_pipelines.sinks.deltawrite import conform, current_of
from cg_pipelines.sinks.iceberg_compact import compact_partition
from cg_pipelines.sinks.iceberg_expire import expire_old_snapshots
from cg_pipelines.sinks.iceberg_expr import equal_to, is_in
from cg_pipelines.sinks.iceberg_read import (
    WATERMARK_PREFIX,
    IcebergReader,
    iceberg_s3_properties,
    key_tuples,
    moved,
    optional_schema,
    scan,
    sql_catalog,
    sqlite_catalog,
    watermark_of,
)
from cg_pipelines.sinks.iceberg_state import IcebergStates
from cg_pipelines.sinks.iceberg_view import commit_view
from cg_pipelines.sinks.lineage import CommitLineage
from cg_pipelines.sinks.maintenance import Maintenance
from cg_pipelines.sinks.storage import mask_options
from cg_pipelines.sinks.table import TableStats

__all__ = ["MANIFEST_MERGE", "WATERMARK_PREFIX", "IcebergSink", "iceberg_s3_properties",
           "sql_catalog", "sqlite_catalog"]

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


class IcebergSink:
    """A :class:`~cg_pipelines.sinks.base.ReplaceSink` over one Iceberg table.

    Thread-safe for concurrent use with different app ids; calls for one app id must not
    overlap (the engine runs one holder per partition).

    Errors: :class:`FenceConflictError` when the watermark moved; pyiceberg errors
    (``CommitFailedException`` after ``commit_retries`` lost races, ``NoSuchTableError``,
    ``ValidationException``), ``OSError`` for I/O, ``UsageError`` (a ``ValueError``) for bad input.
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
        self._schema = optional_schema(schema) if schema is not None else None
        self._write: Append | Merge = write if write is not None else Append()
        self._lineage = CommitLineage(self._write.name, commit_metadata, user_metadata=False)
        self._reader = IcebergReader(self._catalog, identifier, self._schema, IcebergStates()
                                     if isinstance(self._write, Append) else None)
        self._retries = commit_retries
        self._keep = keep_snapshots
        self._metadata_versions = metadata_versions
        self._maintenance = maintenance if maintenance is not None else Maintenance()
        self._lock = threading.Lock()
        self._tables: dict[str, Table] = {}
        self._snapshots: list[int] = []
        self.last_rows_written: int | None = None
        self.commit_retries_used = 0

    # ---------------------------------------------------------------- properties

    @property
    def identifier(self) -> str:
        return self._ident

    @property
    def catalog(self) -> Catalog:
        return self._catalog

    @property
    def write(self) -> Append | Merge:
        return self._write

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
        with self._lock:
            return list(self._snapshots)

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

    # ---------------------------------------------------------------- the Sink protocol

    def watermark(self, app_id: str) -> int:
        """``app_id``'s watermark (0 if none or no table) in the latest table state, which the
        next :meth:`commit` of ``app_id`` is then based on."""
        tbl = self._reader.load()
        if tbl is None:
            return 0
        with self._lock:
            self._tables[app_id] = tbl
        return watermark_of(tbl, app_id)

    def watermarks(self, app_ids: Iterable[str]) -> dict[str, int]:
        """Each app id's watermark from one load (read-only: remembers nothing)."""
        tbl = self._reader.load()
        return {a: (watermark_of(tbl, a) if tbl is not None else 0) for a in app_ids}

    def commit(self, table: pa.Table | None, app_id: str, version: int, expected: int,
               markers: Mapping[str, int] | None = None, *,
               lineage: Mapping[str, object] | None = None) -> None:
        """Write ``table`` (append, or merge by key) and set ``app_id``'s watermark to
        ``version`` in ONE catalog commit, only if it is still ``expected`` (see the module
        docstring for the fence). Creates the table on first use.

        Raises:
            FenceConflictError: the watermark is not ``expected``; nothing was written.
            UsageError: ``not 0 <= expected < version``; no table and no schema.
            ContractError: merge input without the required columns or with null keys, or
                of other partitions; columns that differ from the table's.
            CommitFailedException: ``commit_retries`` races lost to other partitions.
        """
        self.commit_inputs(table, {app_id: (expected, version)}, markers, lineage=lineage)

    def commit_inputs(self, table: pa.Table | None, watermarks: Mapping[str, tuple[int, int]],
                      markers: Mapping[str, int] | None = None, *,
                      lineage: Mapping[str, object] | None = None) -> None:
        """Write ``table`` and move every watermark of ``watermarks`` (``{app id: (expected,
        version)}``) in ONE catalog commit, only if each is still its ``expected``: the
        co-partitioned run's commit (:class:`~cg_pipelines.sinks.base.JoinSink`; an input
        with nothing in the batch keeps its version and is fenced all the same). The commit
        is based on the table state the first app id's :meth:`watermark` loaded; the catalog
        refuses it when the table moved since (``AssertRefSnapshotId``), and it is then
        decided again on the new state. :meth:`commit` is this with one app id.

        Raises:
            FenceConflictError: one of the watermarks is not its ``expected``; nothing written.
            UsageError: no watermark, a ``version < expected``, or no version moves.
            Otherwise as :meth:`commit`.
        """
        check_watermarks(watermarks)
        app_id = next(iter(watermarks))
        version = watermarks[app_id][1]
        with self._lock:
            tbl = self._tables.get(app_id)
        if tbl is None or moved(tbl, watermarks) is not None:
            tbl = self._reader.load()
        if tbl is None:
            if any(exp for exp, _ in watermarks.values()):
                first = next(a for a, (exp, _) in watermarks.items() if exp)
                raise FenceConflictError(first, watermarks[first][0], 0)
            schema = table.schema if table is not None and table.num_columns else self._schema
            if schema is None:
                raise UsageError(f"{self._ident}: no table yet and no schema to create it "
                                 "with: pass schema= or call ensure_table() first")
            if isinstance(self._write, Merge) and table is not None and table.num_rows:
                self._write.check(table)
                schema = pa.schema([f for f in schema if f.name != DELETE_COLUMN])
            self.ensure_table(schema)
            tbl = self._reader.require()
        empty = table is None or table.num_rows == 0
        merge = isinstance(self._write, Merge) and not empty
        summary = self._lineage.commit(app_id, version, "merge" if merge else (
            "empty" if empty else "append"), lineage)
        props = {**{WATERMARK_PREFIX + a: str(v) for a, (_, v) in watermarks.items()},
                 **{WATERMARK_PREFIX + k: str(v) for k, v in (markers or {}).items()}}
        for attempt in range(self._retries + 1):
            tbl = self._no_pyiceberg_retry(tbl)
            conflict = moved(tbl, watermarks)
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
                assert table is not None and isinstance(self._write, Merge)
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
                time.sleep(random.uniform(0.005, 0.02 * min(attempt + 1, 10)))
                tbl = self._reader.require()
        tbl = self._after_commit(tbl, app_id)

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

    def _after_commit(self, tbl: Table, app_id: str) -> Table:
        """Remember ``tbl`` — pyiceberg updated it in place to the metadata our commit made
        (no reload) — as the base of ``app_id``'s next commit."""
        snap = tbl.current_snapshot()
        with self._lock:
            self._tables[app_id] = tbl
            if snap is not None:
                self._snapshots.append(snap.snapshot_id)
        return tbl

    # ---------------------------------------------------------------- table management

    def ensure_table(self, schema: pa.Schema) -> bool:
        """Create the table empty (columns optional; identity partition on
        :data:`PARTITION_COLUMN` when present; ``commit.retry.num-retries=0``) unless it
        exists; safe under concurrency (a losing creator finds the table). Returns True if
        this call created it."""
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

    def _no_pyiceberg_retry(self, tbl: Table) -> Table:
        """``tbl``, or its fresh state after setting ``commit.retry.num-retries=0`` (and
        :data:`MANIFEST_MERGE`'s properties the table does not set) on a table created
        elsewhere or by an older sink (one property commit; lost races are retried)."""
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
        """Replace consumer-group ``partition``'s rows with ``data`` keeping ``app_id``'s
        watermark at ``expected``, in ONE commit fenced like :meth:`commit` (Merge mode:
        ``data`` is the partition's history, reduced to each key's live last row). ``data``
        is held in memory (pyiceberg 0.12 cannot stream into a partitioned table).
        ``fenced`` (``{app id: watermark}``): further watermarks kept and fenced the same way
        (a co-partitioned rebuild keeps every input's).

        Returns:
            The rows the partition had before.

        Raises:
            FenceConflictError: the watermark is not ``expected``.
            NoSuchTableError: no table.
        """
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
            tbl = self._no_pyiceberg_retry(tbl)
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
                time.sleep(random.uniform(0.005, 0.02 * min(attempt + 1, 10)))
                tbl = self._reader.require()
        self._after_commit(tbl, app_id)
        with self._lock:
            self._tables.pop(app_id, None)
        self.last_rows_written = rows.num_rows
        return int(before)

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
        t0 = time.monotonic()
        figures: dict[str, int | float | str] = {}
        try:
            tbl = self._reader.load()  # one load serves the compaction check and the expiry
            loaded = [tbl] if tbl is not None else []

            def latest() -> Table:  # that state first, then the catalog's latest
                return self._no_pyiceberg_retry(loaded.pop() if loaded
                                                else self._reader.require())

            if tbl is not None and compact_partition(
                    latest, partition, self._maintenance, lambda t: watermark_of(t, app_id),
                    lambda wm: self._lineage.commit(app_id, wm, "compact",
                                                    {"partition": partition}),
                    figures, self._reader.states if self._maintenance.snapshots else None):
                with self._lock:  # the held base is stale: the next commit reloads
                    self._tables.pop(app_id, None)
                tbl = self._reader.load()
            before, expired = (0, 0) if tbl is None else expire_old_snapshots(
                tbl, self._reader.require, self._keep)
            figures.update(iceberg_snapshots=before - expired,
                           iceberg_snapshots_expired=expired)
        except Exception as e:  # upkeep must not fail the run (reported)
            figures["error"] = f"{type(e).__name__}: {e}"
        figures["iceberg_expire_seconds"] = round(time.monotonic() - t0, 3)
        return figures


def _missing_properties(tbl: Table) -> dict[str, str]:
    """The table properties the sink's commits need and ``tbl`` lacks: pyiceberg's retry off
    (the fence), and :data:`MANIFEST_MERGE`'s where the table sets nothing of its own."""
    props = tbl.properties
    missing = {k: v for k, v in _NO_RETRY.items() if props.get(k) != v}
    missing.update({k: v for k, v in MANIFEST_MERGE.items() if k not in props})
    return missing
