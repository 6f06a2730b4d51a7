"""Apache Iceberg sink over ``pyiceberg`` 0.12: fenced, exactly-once commits beside Delta.

The contract is :class:`~cg_pipelines.sinks.delta.DeltaSink`'s (the engine's
:class:`~cg_pipelines.engine.model.ReplaceSink`): one :meth:`IcebergSink.commit` is ONE catalog
commit that writes the batch's rows and moves the partition's watermark, only if the watermark
is still the one the batch was based on.

Watermarks: the table PROPERTY ``cg.watermark.<app_id>`` (table properties are cumulative in
Iceberg; snapshot summary properties belong to one snapshot), set by the same transaction as
the data. Markers (``{app id: version}``) are properties too. Each commit's snapshot summary
carries the lineage (``cg.stream``, ``cg.group``, ``cg.partition``, ``cg.first_seq``,
``cg.last_seq``, ``cg.app_id``, ``cg.watermark``, ``cg.write_mode``, ``cg.operation``,
``cg.library_version`` and the sink's ``commit_metadata``).

The fence (checked by experiment on pyiceberg 0.12.0, SQL catalog on SQLite and Postgres,
local disk and moto S3; see ``tests/iceberg``):

* pyiceberg's own retry is out of the way: a table this sink creates (or first writes to) has
  ``commit.retry.num-retries = 0``. Otherwise a commit that lost a race is refreshed and
  replayed by pyiceberg on the NEW table state without any validation for appends — a
  zombie's append would land (DESIGN §9).
* Every commit of this sink adds a snapshot to ``main`` (an empty batch commits an empty
  append), and each of pyiceberg's snapshot producers asserts ``main`` is still the snapshot
  the transaction was built on (``AssertRefSnapshotId``), checked by the catalog under its
  compare-and-swap of the metadata location. So the watermark read from that table state
  cannot have moved unseen: if any commit landed in between, the catalog refuses ours
  (``CommitFailedException``).
* On that refusal the sink reloads the table and re-reads the watermark: moved →
  :class:`~cg_pipelines.engine.model.FenceConflictError` (nothing written; the files of the
  failed attempt are deleted by pyiceberg); unchanged → the commit was lost to another
  partition (or to maintenance): it is rebuilt on the fresh table and tried again (up to
  ``commit_retries`` times, with a short jittered back-off) — another partition's commit is
  retried, never fenced.

Write modes (:mod:`cg_pipelines.core.write`): :class:`Append` appends (one snapshot per
batch). :class:`Merge` reduces the batch to each key's last row (deletes when it is a delete
marker) and, in ONE transaction, deletes the partition's rows of those keys (copy-on-write:
pyiceberg rewrites the data files that hold them) and appends the live rows: one commit, with
up to two snapshots (``overwrite``/``delete`` then ``append``), both carrying the summary. A
composite key rewrites the batch's partition whole.

Tables: identity-partitioned on :data:`~cg_pipelines.engine.model.PARTITION_COLUMN` when the
schema has it; columns are created optional (nullable); nanosecond timestamps are stored as
microseconds (Iceberg v2 has no nanoseconds; batches are truncated on write).

Catalogs: any pyiceberg catalog (``catalog=`` a :class:`pyiceberg.catalog.Catalog` or the
properties of :func:`pyiceberg.catalog.load_catalog`): :func:`sqlite_catalog` (embedded, no
server), a Postgres-backed SQL catalog (:func:`sql_catalog`), REST (``{"type": "rest",
"uri": ...}``; the fence only needs ``AssertRefSnapshotId``, which REST servers check).

Maintenance (:meth:`IcebergSink.maintain`): snapshot expiry (pyiceberg's
``table.maintenance.expire_snapshots()``), and the catalog keeps at most
``write.metadata.previous-versions-max`` old metadata files. pyiceberg 0.12 has NO data file
compaction, no orphan file removal, and its snapshot expiry does not delete files: those
need Spark/Java Iceberg (``rewrite_data_files``, ``remove_orphan_files``).
"""

from __future__ import annotations

import random
import threading
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.catalog import Catalog, load_catalog
from pyiceberg.exceptions import (
    CommitFailedException,
    NamespaceAlreadyExistsError,
    NoSuchTableError,
    TableAlreadyExistsError,
)
from pyiceberg.expressions import AlwaysTrue, And, BooleanExpression, EqualTo, In
from pyiceberg.table import Table

from cg_pipelines.core.state import last_per_key
from cg_pipelines.core.write import DELETE_COLUMN, Append, Merge
from cg_pipelines.engine.model import PARTITION_COLUMN, FenceConflictError
from cg_pipelines.sinks.deltaread import TableStats
from cg_pipelines.sinks.deltawrite import conform, current_of
from cg_pipelines.sinks.storage import mask_options, option_name
from cg_pipelines.version import __version__

__all__ = ["WATERMARK_PREFIX", "IcebergSink", "iceberg_s3_properties", "sql_catalog",
           "sqlite_catalog"]

WATERMARK_PREFIX: Final = "cg.watermark."
"""Table property prefix of the watermarks: ``cg.watermark.<app_id>``."""

_NO_RETRY: Final = {"commit.retry.num-retries": "0"}
_S3_KEYS: Final = {
    "endpoint": "s3.endpoint", "endpoint_url": "s3.endpoint",
    "access_key_id": "s3.access-key-id", "secret_access_key": "s3.secret-access-key",
    "session_token": "s3.session-token", "region": "s3.region", "default_region": "s3.region",
}


def iceberg_s3_properties(storage_options: Mapping[str, str]) -> dict[str, str]:
    """pyiceberg FileIO properties (``s3.endpoint``, ``s3.access-key-id``,
    ``s3.secret-access-key``, ``s3.session-token``, ``s3.region``) from delta-rs style storage
    options (:func:`cg_pipelines.sinks.storage.s3_options`; ``AWS_`` prefix optional). Options
    pyiceberg has no use for (``allow_http`` ...) are dropped; keys already in pyiceberg form
    (``s3.*``) are kept."""
    out: dict[str, str] = {}
    for k, v in storage_options.items():
        if k.startswith("s3."):
            out[k] = v
        elif option_name(k) in _S3_KEYS:
            out[_S3_KEYS[option_name(k)]] = v
    return out


def sql_catalog(uri: str, warehouse: str, *, name: str = "cg",
                storage_options: Mapping[str, str] | None = None) -> Catalog:
    """pyiceberg's SQL catalog: ``uri`` a SQLAlchemy URL (``sqlite:///path/catalog.db``,
    ``postgresql+psycopg2://user@host:port/db``), ``warehouse`` the data root (a local
    directory or ``s3://bucket/prefix``); ``storage_options`` as :func:`iceberg_s3_properties`.
    The catalog's tables are created on first use."""
    props = {"type": "sql", "uri": uri, "warehouse": warehouse, "init_catalog_tables": "true"}
    props.update(iceberg_s3_properties(storage_options or {}))
    return load_catalog(name, **props)


def sqlite_catalog(directory: str, warehouse: str | None = None, *,
                   storage_options: Mapping[str, str] | None = None) -> Catalog:
    """The embedded default: a SQL catalog in ``<directory>/catalog.db`` (SQLite, no server),
    data under ``warehouse`` (default ``<directory>/warehouse``)."""
    import os

    os.makedirs(directory, exist_ok=True)
    wh = warehouse or "file://" + os.path.abspath(os.path.join(directory, "warehouse"))
    return sql_catalog(f"sqlite:///{os.path.abspath(os.path.join(directory, 'catalog.db'))}",
                       wh, storage_options=storage_options)


def _key(name: str) -> str:
    return name if name.startswith("cg.") else "cg." + name


def _optional(schema: pa.Schema) -> pa.Schema:
    """``schema`` with every field nullable and nanosecond timestamps as microseconds."""
    fields = []
    for f in schema:
        t = f.type
        if pa.types.is_timestamp(t) and t.unit == "ns":
            t = pa.timestamp("us", tz=t.tz)
        fields.append(pa.field(f.name, t, nullable=True))
    return pa.schema(fields)


class IcebergSink:
    """A :class:`~cg_pipelines.engine.model.ReplaceSink` over one Iceberg table.

    Thread-safe for concurrent use with different app ids; calls for one app id must not
    overlap (the engine runs one holder per partition).

    Errors: :class:`FenceConflictError` when the watermark moved; pyiceberg errors
    (``CommitFailedException`` after ``commit_retries`` lost races, ``NoSuchTableError``,
    ``ValidationException``), ``OSError`` for I/O, ``ValueError`` for bad input.
    """

    def __init__(
        self,
        identifier: str,
        *,
        catalog: Catalog | Mapping[str, str],
        schema: pa.Schema | None = None,
        write: Append | Merge | None = None,
        commit_metadata: Mapping[str, str] | None = None,
        commit_retries: int = 100,
        keep_snapshots: int = 100,
        metadata_versions: int = 100,
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
            keep_snapshots: :meth:`maintain` expires all but the newest this many snapshots.
            metadata_versions: ``write.metadata.previous-versions-max`` of a created table.

        Raises:
            ValueError: no namespace in ``identifier``; ``write`` not Append/Merge/None;
                ``commit_retries < 0`` or ``keep_snapshots < 1``.
        """
        if "." not in identifier:
            raise ValueError(f"identifier must be 'namespace.table', got {identifier!r}")
        if write is not None and not isinstance(write, (Append, Merge)):
            raise ValueError(f"write must be Append() or Merge(key=...), got {write!r}")
        if commit_retries < 0 or keep_snapshots < 1:
            raise ValueError("need commit_retries >= 0 and keep_snapshots >= 1")
        self._ident = identifier
        self._catalog_props: dict[str, str] = {}
        if isinstance(catalog, Catalog):
            self._catalog: Catalog = catalog
        else:
            props = dict(catalog)
            self._catalog_props = props
            self._catalog = load_catalog(props.pop("name", "cg"), **props)
        self._schema = _optional(schema) if schema is not None else None
        self._write: Append | Merge = write if write is not None else Append()
        self._extra_md = {_key(k): str(v) for k, v in (commit_metadata or {}).items()}
        self._retries = commit_retries
        self._keep = keep_snapshots
        self._metadata_versions = metadata_versions
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
        tbl = self.load()
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

    # ---------------------------------------------------------------- the Sink protocol

    def watermark(self, app_id: str) -> int:
        """``app_id``'s watermark (0 if none or no table) in the latest table state, which the
        next :meth:`commit` of ``app_id`` is then based on."""
        tbl = self.load()
        if tbl is None:
            return 0
        with self._lock:
            self._tables[app_id] = tbl
        return _wm(tbl, app_id)

    def watermarks(self, app_ids: Iterable[str]) -> dict[str, int]:
        """Each app id's watermark from one load (read-only: remembers nothing)."""
        tbl = self.load()
        return {a: (_wm(tbl, a) if tbl is not None else 0) for a in app_ids}

    def commit(self, table: pa.Table | None, app_id: str, version: int, expected: int,
               markers: Mapping[str, int] | None = None, *,
               lineage: Mapping[str, object] | None = None) -> None:
        """Write ``table`` (append, or merge by key) and set ``app_id``'s watermark to
        ``version`` in ONE catalog commit, only if it is still ``expected`` (see the module
        docstring for the fence). Creates the table on first use.

        Raises:
            FenceConflictError: the watermark is not ``expected``; nothing was written.
            ValueError: ``not 0 <= expected < version``; no table and no schema; merge
                input without the required columns or with null keys; columns that differ
                from the table's.
            CommitFailedException: ``commit_retries`` races lost to other partitions.
        """
        if not 0 <= expected < version:
            raise ValueError(f"commit of {app_id}: need 0 <= expected < version, "
                             f"got expected={expected} version={version}")
        with self._lock:
            tbl = self._tables.get(app_id)
        if tbl is None or _wm(tbl, app_id) != expected:
            tbl = self.load()
        if tbl is None:
            if expected != 0:
                raise FenceConflictError(app_id, expected, 0)
            schema = table.schema if table is not None and table.num_columns else self._schema
            if schema is None:
                raise ValueError(f"{self._ident}: no table yet and no schema to create it "
                                 "with: pass schema= or call ensure_table() first")
            if isinstance(self._write, Merge) and table is not None and table.num_rows:
                self._write.check(table)
                schema = pa.schema([f for f in schema if f.name != DELETE_COLUMN])
            self.ensure_table(schema)
            tbl = self._require()
        empty = table is None or table.num_rows == 0
        merge = isinstance(self._write, Merge) and not empty
        summary = self._summary(app_id, version, "merge" if merge else (
            "empty" if empty else "append"), lineage)
        props = {WATERMARK_PREFIX + app_id: str(version),
                 **{WATERMARK_PREFIX + k: str(v) for k, v in (markers or {}).items()}}
        target = tbl.schema().as_arrow()
        if empty:
            rows = target.empty_table()
            delete: BooleanExpression | None = None
        elif merge:
            assert table is not None and isinstance(self._write, Merge)
            rows, delete = self._merge_rows(table, target)
        else:
            assert table is not None
            rows, delete = conform(table, target, self._ident), None
        for attempt in range(self._retries + 1):
            tbl = self._no_pyiceberg_retry(tbl)
            found = _wm(tbl, app_id)
            if found != expected:
                with self._lock:
                    self._tables[app_id] = tbl
                raise FenceConflictError(app_id, expected, found)
            try:
                with tbl.transaction() as txn:
                    txn.set_properties(props)
                    if delete is not None:
                        with warnings.catch_warnings():  # "Delete operation did not match"
                            warnings.simplefilter("ignore", UserWarning)
                            txn.overwrite(rows, overwrite_filter=delete,
                                          snapshot_properties=summary)
                    else:
                        txn.append(rows, snapshot_properties=summary)
                break
            except CommitFailedException:
                if attempt == self._retries:
                    raise
                self.commit_retries_used += 1
                time.sleep(random.uniform(0.005, 0.02 * min(attempt + 1, 10)))
                tbl = self._require()
        tbl = self._after_commit(tbl, app_id)

    def _merge_rows(self, table: pa.Table, target: pa.Schema
                    ) -> tuple[pa.Table, BooleanExpression]:
        """Merge mode: the rows to append and the delete filter of one batch."""
        assert isinstance(self._write, Merge)
        cur = self._write.current(table)
        live = cur.filter(pc.invert(cur[DELETE_COLUMN])).drop_columns([DELETE_COLUMN])
        rows = conform(live, target, self._ident)
        part: BooleanExpression = AlwaysTrue()
        if PARTITION_COLUMN in target.names and PARTITION_COLUMN in cur.column_names:
            parts = pc.unique(cur[PARTITION_COLUMN]).to_pylist()
            if len(parts) != 1:
                raise ValueError(f"{self._ident}: a merge batch holds partitions {parts}")
            part = EqualTo(PARTITION_COLUMN, int(parts[0]))
        keys = self._write.keys
        if len(keys) == 1:
            values = cur[keys[0]].to_pylist()
            return rows, And(part, In(keys[0], values)) if values else part
        # Composite key: rewrite the partition whole (current rows of other keys kept).
        old = self._scan(self._require(), part, None)
        if old.num_rows:
            mine = pc.is_in(_key_tuples(old, keys), value_set=_key_tuples(cur, keys))
            kept = conform(old.filter(pc.invert(mine)), target, self._ident)
            rows = pa.concat_tables([kept, rows])
        return rows, part

    def _after_commit(self, tbl: Table, app_id: str) -> Table:
        fresh = self._require()
        snap = fresh.current_snapshot()
        with self._lock:
            self._tables[app_id] = fresh
            if snap is not None:
                self._snapshots.append(snap.snapshot_id)
        return fresh

    def _summary(self, app_id: str, watermark: int, operation: str,
                 lineage: Mapping[str, object] | None) -> dict[str, str]:
        md = {_key(k): str(v) for k, v in (lineage or {}).items() if v is not None}
        md.update({"cg.app_id": app_id, "cg.watermark": str(watermark),
                   "cg.write_mode": self._write.name, "cg.operation": operation,
                   "cg.library_version": __version__})
        md.update(self._extra_md)
        return md

    # ---------------------------------------------------------------- table management

    def load(self) -> Table | None:
        """The table's latest state, or None when it does not exist."""
        try:
            return self._catalog.load_table(self._ident)
        except NoSuchTableError:
            return None

    def _require(self) -> Table:
        tbl = self.load()
        if tbl is None:
            raise NoSuchTableError(f"{self._ident}: no Iceberg table")
        return tbl

    def exists(self) -> bool:
        return self.load() is not None

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
        if self.load() is not None:
            return False
        schema = _optional(schema)
        props = {**_NO_RETRY, "write.metadata.delete-after-commit.enabled": "true",
                 "write.metadata.previous-versions-max": str(self._metadata_versions)}
        try:
            txn = self._catalog.create_table_transaction(self._ident, schema=schema,
                                                         properties=props)
            if PARTITION_COLUMN in schema.names:
                with txn.update_spec() as spec:
                    spec.add_identity(PARTITION_COLUMN)
            txn.commit_transaction()
        except (TableAlreadyExistsError, CommitFailedException):
            if self.load() is None:
                raise
            return False
        return True

    def _no_pyiceberg_retry(self, tbl: Table) -> Table:
        """``tbl``, or its fresh state after setting ``commit.retry.num-retries=0`` on a
        table created elsewhere (one property commit; lost races are retried)."""
        if tbl.properties.get("commit.retry.num-retries") == "0":
            return tbl
        for _ in range(20):
            try:
                with tbl.transaction() as txn:
                    txn.set_properties(_NO_RETRY)
                return self._require()
            except CommitFailedException:
                tbl = self._require()
                if tbl.properties.get("commit.retry.num-retries") == "0":
                    return tbl
        raise CommitFailedException(f"{self._ident}: set commit.retry.num-retries=0 on the "
                                    "table (the fence needs pyiceberg's blind retry off) and "
                                    "commit again")

    def replace_partition(
        self, data: pa.RecordBatchReader, partition: int, app_id: str, expected: int,
        markers: Mapping[str, int] | None = None, *,
        lineage: Mapping[str, object] | None = None,
    ) -> int:
        """Replace consumer-group ``partition``'s rows with ``data`` keeping ``app_id``'s
        watermark at ``expected``, in ONE commit fenced like :meth:`commit` (Merge mode:
        ``data`` is the partition's history, reduced to each key's live last row). ``data``
        is held in memory (pyiceberg 0.12 cannot stream into a partitioned table).

        Returns:
            The rows the partition had before.

        Raises:
            FenceConflictError: the watermark is not ``expected``.
            NoSuchTableError: no table.
        """
        with self._lock:
            tbl = self._tables.get(app_id)
        if tbl is None:
            tbl = self._require()
        target = tbl.schema().as_arrow()
        if isinstance(self._write, Merge):
            rows = current_of(data, self._write, target, self._ident)
        else:
            rows = conform(data.read_all(), target, self._ident)
        self.last_rows_written = None
        where = EqualTo(PARTITION_COLUMN, int(partition))
        if rows.num_rows and PARTITION_COLUMN in rows.column_names and not pc.all(
                pc.equal(rows[PARTITION_COLUMN], partition)).as_py():
            raise ValueError(f"{self._ident}: replacement rows of partition {partition} hold "
                             "other partitions")
        summary = self._summary(app_id, expected, "replace_partition",
                                {"partition": partition, **(lineage or {})})
        props = {WATERMARK_PREFIX + k: str(v) for k, v in (markers or {}).items()}
        for attempt in range(self._retries + 1):
            tbl = self._no_pyiceberg_retry(tbl)
            found = _wm(tbl, app_id)
            if found != expected:
                raise FenceConflictError(app_id, expected, found)
            before = tbl.scan(row_filter=where).count()
            try:
                with tbl.transaction() as txn:
                    # the fence needs a new snapshot even when nothing changes
                    txn.set_properties({WATERMARK_PREFIX + app_id: str(expected), **props})
                    txn.overwrite(rows, overwrite_filter=where, snapshot_properties=summary)
                break
            except CommitFailedException:
                if attempt == self._retries:
                    raise
                time.sleep(random.uniform(0.005, 0.02 * min(attempt + 1, 10)))
                tbl = self._require()
        self._after_commit(tbl, app_id)
        with self._lock:
            self._tables.pop(app_id, None)
        self.last_rows_written = rows.num_rows
        return int(before)

    def maintain(self, partition: int, app_id: str) -> dict[str, int | float | str]:
        """Expire all but the newest ``keep_snapshots`` snapshots (metadata only: pyiceberg
        0.12 deletes no files, has no compaction). Called by the engine under the partition's
        lease after its last commit; the table is shared, so any partition's call expires
        the whole table's old snapshots. Returns figures for the run's metadata
        (``iceberg_snapshots``, ``iceberg_snapshots_expired``, ``iceberg_expire_seconds``)."""
        t0 = time.monotonic()
        tbl = self.load()
        if tbl is None:
            return {"iceberg_snapshots": 0, "iceberg_snapshots_expired": 0}
        snaps = sorted(tbl.snapshots(), key=lambda s: (s.timestamp_ms, s.sequence_number or 0))
        old = [s.snapshot_id for s in snaps[:-self._keep]]
        cur = tbl.current_snapshot()
        old = [i for i in old if cur is None or i != cur.snapshot_id]
        expired = 0
        if old:
            for _ in range(20):
                try:
                    tbl.maintenance.expire_snapshots().by_ids(old).commit()
                    expired = len(old)
                    break
                except CommitFailedException:
                    time.sleep(random.uniform(0.005, 0.05))
                    tbl = self._require()
                    live = {s.snapshot_id for s in tbl.snapshots()}
                    old = [i for i in old if i in live]
        return {"iceberg_snapshots": len(snaps) - expired, "iceberg_snapshots_expired": expired,
                "iceberg_expire_seconds": round(time.monotonic() - t0, 3),
                "iceberg_compaction": "not available in pyiceberg 0.12"}

    # ---------------------------------------------------------------- reads

    def read(self, columns: list[str] | None = None,
             row_filter: BooleanExpression | str | None = None) -> pa.Table:
        """The latest snapshot's rows (``row_filter`` a pyiceberg expression or string), or
        no rows (the given ``schema`` or no columns) when there is no table."""
        tbl = self.load()
        if tbl is None:
            empty = self._schema.empty_table() if self._schema is not None else pa.table({})
            return empty.select(columns) if columns is not None and self._schema else empty
        return self._scan(tbl, row_filter if row_filter is not None else AlwaysTrue(), columns)

    @staticmethod
    def _scan(tbl: Table, row_filter: BooleanExpression | str,
              columns: Sequence[str] | None) -> pa.Table:
        scan = tbl.scan(row_filter=row_filter,
                        selected_fields=tuple(columns) if columns is not None else ("*",))
        return scan.to_arrow()

    def data_files(self, row_filter: BooleanExpression | None = None) -> list[str]:
        """Paths of the current snapshot's data files (those ``row_filter`` may match).
        pyiceberg writes copy-on-write only (no delete files), so they are the table."""
        tbl = self.load()
        if tbl is None:
            return []
        scan = tbl.scan(row_filter=row_filter if row_filter is not None else AlwaysTrue())
        return [t.file.file_path for t in scan.plan_files()]

    def last_rows(self, key: str, keys: Sequence[object], columns: Sequence[str],
                  order_by: str, partition: int | None = None) -> pa.Table:
        """Each of ``keys``' last committed row (greatest ``order_by``), with ``columns``
        (the state-sink contract; see :meth:`DeltaSink.last_rows
        <cg_pipelines.sinks.delta.DeltaSink.last_rows>`). Sorted by key."""
        cols = list(dict.fromkeys([key, order_by, *columns]))
        tbl = self.load()
        if tbl is None:
            return pa.table({c: pa.nulls(0) for c in cols})
        if not keys:
            return self._scan(tbl, AlwaysTrue(), cols).slice(0, 0)
        flt: BooleanExpression = In(key, list(keys))
        if partition is not None and PARTITION_COLUMN in tbl.schema().column_names:
            flt = And(EqualTo(PARTITION_COLUMN, int(partition)), flt)
        return last_per_key(self._scan(tbl, flt, cols), key, order_by)

    def stats(self, partition: int | None = None) -> TableStats:
        """``version`` (the table's last sequence number), total ``rows`` (from the current
        snapshot's summary), ``partition_rows`` (when asked; planned from manifests),
        ``schema``.

        Raises:
            NoSuchTableError: no table.
        """
        tbl = self._require()
        snap = tbl.current_snapshot()
        rows = 0
        if snap is not None and snap.summary is not None:
            rows = int(snap.summary.additional_properties.get("total-records", 0))
        part = None
        if partition is not None and PARTITION_COLUMN in tbl.schema().column_names:
            part = int(tbl.scan(row_filter=EqualTo(PARTITION_COLUMN, int(partition))).count())
        return TableStats(int(tbl.metadata.last_sequence_number), rows, part,
                          tbl.schema().as_arrow())

    def history(self) -> list[dict[str, Any]]:
        """Every snapshot's summary (oldest first), with ``snapshot_id`` and ``timestamp_ms``."""
        tbl = self._require()
        out = []
        for s in sorted(tbl.snapshots(), key=lambda s: s.sequence_number or 0):
            d: dict[str, Any] = dict(s.summary.additional_properties) if s.summary else {}
            if s.summary is not None:
                d["operation"] = s.summary.operation.value
            d.update(snapshot_id=s.snapshot_id, timestamp_ms=s.timestamp_ms)
            out.append(d)
        return out


def _wm(tbl: Table, app_id: str) -> int:
    return int(tbl.properties.get(WATERMARK_PREFIX + app_id, 0))


def _key_tuples(table: pa.Table, keys: Sequence[str]) -> pa.Array:
    """One string per row identifying its composite key."""
    import json

    cols = [table[k].to_pylist() for k in keys]
    return pa.array([json.dumps(list(v), default=str) for v in zip(*cols, strict=True)])
