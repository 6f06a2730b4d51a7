"""Reading an Iceberg table for :class:`~cg_pipelines.sinks.iceberg.IcebergSink` (the part it
owns, :class:`IcebergReader`: rows, each key's last row — the state-sink contract —,
statistics, snapshot summaries, data files), and the catalog helpers: pyiceberg's SQL catalog
on SQLite or Postgres, S3 FileIO properties from delta-rs style storage options."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
from collections.abc import Mapping, Sequence
from typing import Any, Final

import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.catalog import Catalog, load_catalog
from pyiceberg.exceptions import NoSuchTableError
from pyiceberg.expressions import AlwaysTrue, And, BooleanExpression
from pyiceberg.table import Table

from cg_pipelines.core.state import last_per_key
from cg_pipelines.core.storage_keys import check_storage_options
from cg_pipelines.sinks.base import PARTITION_COLUMN, TableStats
from cg_pipelines.sinks.iceberg_expr import equal_to, is_in
from cg_pipelines.sinks.iceberg_state import IcebergStates
from cg_pipelines.sinks.storage import option_name

WATERMARK_PREFIX: Final = "cg.watermark."
"""Table property prefix of the watermarks: ``cg.watermark.<app_id>``."""

__all__ = ["WATERMARK_PREFIX", "IcebergReader", "iceberg_s3_properties", "key_tuples", "moved",
           "optional_schema", "scan", "sql_catalog", "sqlite_catalog", "watermark_of"]

_S3_KEYS: Final = {
    "endpoint": "s3.endpoint", "endpoint_url": "s3.endpoint",
    "access_key_id": "s3.access-key-id", "secret_access_key": "s3.secret-access-key",
    "session_token": "s3.session-token", "region": "s3.region", "default_region": "s3.region",
}


def iceberg_s3_properties(storage_options: Mapping[str, str]) -> dict[str, str]:
    """pyiceberg FileIO properties (``s3.endpoint``, ``s3.access-key-id``,
    ``s3.secret-access-key``, ``s3.session-token``, ``s3.region``) from delta-rs style storage
    options (:func:`cg_pipelines.sinks.storage.s3_options`; ``AWS_`` prefix optional). S3
    options pyiceberg has no use for (``allow_http`` ...) are dropped; keys already in pyiceberg
    form (``s3.*``) are kept.

    Raises:
        ConfigError: a key no S3 store reads (:func:`~cg_pipelines.core.storage_keys.
            check_storage_options`): a misspelt endpoint would otherwise be dropped here and
            the table written to AWS itself.
    """
    check_storage_options("s3://", {k: v for k, v in storage_options.items()
                                    if not k.startswith("s3.")})
    out: dict[str, str] = {}
    for k, v in storage_options.items():
        if k.startswith("s3."):
            out[k] = v
        elif option_name(k) in _S3_KEYS:
            out[_S3_KEYS[option_name(k)]] = v
    return out


def iceberg_catalog(name: str, properties: Mapping[str, str]) -> Catalog:
    """pyiceberg's ``load_catalog(name, **properties)``: a catalog of any type (``sql``,
    ``rest``, ...) from its properties (secrets included: do not log them).

    Raises:
        pyiceberg errors: an unknown type, a catalog that cannot be reached.
    """
    return load_catalog(name, **properties)


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
    """The embedded default: a SQL catalog in ``<directory>/catalog.db`` (SQLite, no server,
    in WAL mode: see :func:`sqlite_wal`), data under ``warehouse`` (default
    ``<directory>/warehouse``)."""
    os.makedirs(directory, exist_ok=True)
    wh = warehouse or "file://" + os.path.abspath(os.path.join(directory, "warehouse"))
    db = os.path.abspath(os.path.join(directory, "catalog.db"))
    sqlite_wal(db)
    return sql_catalog(f"sqlite:///{db}", wh, storage_options=storage_options)


def sqlite_wal(path: str) -> None:
    """Put the SQLite database at ``path`` (created if missing) in write-ahead-log mode (a
    setting stored in the file): readers then never wait for a writer, so a process paused in
    the middle of a catalog commit blocks only other commits (until it resumes), not
    ``load_table``. One machine only: SQLite's locks do not work over network filesystems;
    use a Postgres catalog for writers on several machines."""
    with contextlib.closing(sqlite3.connect(path, timeout=30)) as con:
        con.execute("PRAGMA journal_mode=WAL")


def optional_schema(schema: pa.Schema) -> pa.Schema:
    """``schema`` with every field nullable and nanosecond timestamps as microseconds."""
    fields = []
    for f in schema:
        t = f.type
        if pa.types.is_timestamp(t) and t.unit == "ns":
            t = pa.timestamp("us", tz=t.tz)
        fields.append(pa.field(f.name, t, nullable=True))
    return pa.schema(fields)


class IcebergReader:
    """The read part of an :class:`~cg_pipelines.sinks.iceberg.IcebergSink` (the sink owns
    one and hands its reads to it)."""

    def __init__(self, catalog: Catalog, identifier: str, schema: pa.Schema | None,
                 states: IcebergStates | None = None) -> None:
        """
        Args:
            catalog: the table's catalog. identifier: ``namespace.table``.
            schema: the schema given to the sink, if any (the shape of an absent table's
                reads).
            states: the per-partition state snapshots :meth:`last_rows` reads through (an
                append-mode sink's; :mod:`cg_pipelines.sinks.iceberg_state`), or None.
        """
        self._catalog = catalog
        self._ident = identifier
        self._schema = schema
        self.states = states

    def load(self) -> Table | None:
        """The table's latest state, or None when it does not exist."""
        try:
            return self._catalog.load_table(self._ident)
        except NoSuchTableError:
            return None

    def require(self) -> Table:
        """The table's latest state.

        Raises:
            NoSuchTableError: no table.
        """
        tbl = self.load()
        if tbl is None:
            raise NoSuchTableError(f"{self._ident}: no Iceberg table")
        return tbl

    def exists(self) -> bool:
        """Whether the table exists in the catalog.

        Raises:
            pyiceberg errors other than ``NoSuchTableError`` (e.g. the catalog is unreachable).
        """
        return self.load() is not None

    # ---------------------------------------------------------------- reads

    def read(self, columns: list[str] | None = None,
             row_filter: BooleanExpression | str | None = None,
             filter: pc.Expression | None = None) -> pa.Table:  # DeltaSink's name
        """The latest snapshot's rows, projected to ``columns``, filtered by ``row_filter``
        (a pyiceberg expression or string, e.g. ``"_partition == 3"``: prunes files) and/or
        ``filter`` (a pyarrow expression, as :meth:`DeltaSink.read
        <cg_pipelines.sinks.delta.DeltaSink.read>` takes; applied after the scan). No rows
        (the given ``schema``, or no columns) when there is no table.

        Raises:
            pyiceberg / pyarrow errors: unknown columns (``ValueError``, ``ArrowInvalid``),
                read failures.
        """
        tbl = self.load()
        if tbl is None:
            empty = self._schema.empty_table() if self._schema is not None else pa.table({})
            return empty.select(columns) if columns is not None and self._schema else empty
        where = row_filter if row_filter is not None else AlwaysTrue()
        if filter is None:
            return scan(tbl, where, columns)
        rows = scan(tbl, where, None).filter(filter)
        return rows.select(columns) if columns is not None else rows

    def read_partitions(self, partitions: Sequence[int] | None = None) -> pa.Table:
        """:meth:`read` of the rows of ``partitions`` (``None``: all), pruning files by the
        partition column (the :class:`~cg_pipelines.sinks.base.TableSink` read).

        Raises:
            pyiceberg / pyarrow errors: read failures.
        """
        return self.read(row_filter=None if partitions is None
                         else is_in(PARTITION_COLUMN, list(partitions)))

    def data_files(self, row_filter: BooleanExpression | None = None) -> list[str]:
        """Paths of the current snapshot's data files (those ``row_filter`` may match).
        pyiceberg writes copy-on-write only (no delete files), so they are the table."""
        tbl = self.load()
        if tbl is None:
            return []
        scan = tbl.scan(row_filter=row_filter if row_filter is not None else AlwaysTrue())
        return [t.file.file_path for t in scan.plan_files()]

    def partition_data_files(self, partitions: Sequence[int] | None = None) -> list[str]:
        """:meth:`data_files` of the rows of ``partitions`` (``None``: all), pruned by the
        partition column."""
        return self.data_files(None if partitions is None
                               else is_in(PARTITION_COLUMN, list(partitions)))

    def last_rows(self, key: str, keys: Sequence[object], columns: Sequence[str],
                  order_by: str, partition: int | None = None, *,
                  app_id: str | None = None) -> pa.Table:
        """Each of ``keys``' last committed row (greatest ``order_by``), with ``columns``
        (the state-sink contract; see :meth:`DeltaSink.last_rows
        <cg_pipelines.sinks.delta.DeltaSink.last_rows>`). Sorted by key. ``app_id`` (the
        run's identity) is accepted and not needed: the read is of the latest table state.
        With ``partition`` and state snapshots (append mode), the read costs the files
        committed since the partition's snapshot, not its history
        (:mod:`cg_pipelines.sinks.iceberg_state`).

        Raises:
            pyiceberg / pyarrow errors: read failures, unknown columns.
        """
        cols = list(dict.fromkeys([key, order_by, *columns]))
        tbl = self.load()
        if tbl is None:
            return pa.table({c: pa.nulls(0) for c in cols})
        if not keys:
            return scan(tbl, AlwaysTrue(), cols).slice(0, 0)
        if partition is not None and self.states is not None:
            got = self.states.last_rows(tbl, key, keys, cols, order_by, partition)
            if got is not None:
                return got
        flt: BooleanExpression = is_in(key, list(keys))
        if partition is not None and PARTITION_COLUMN in tbl.schema().column_names:
            flt = And(equal_to(PARTITION_COLUMN, int(partition)), flt)
        return last_per_key(scan(tbl, flt, cols), key, order_by)

    def stats(self, partition: int | None = None) -> TableStats:
        """``version`` (the table's last sequence number), total ``rows`` (from the current
        snapshot's summary), ``partition_rows`` (when asked; planned from manifests),
        ``schema``.

        Raises:
            NoSuchTableError: no table.
        """
        tbl = self.require()
        snap = tbl.current_snapshot()
        rows = 0
        if snap is not None and snap.summary is not None:
            rows = int(snap.summary.additional_properties.get("total-records", 0))
        part = None
        if partition is not None and PARTITION_COLUMN in tbl.schema().column_names:
            part = int(tbl.scan(row_filter=equal_to(PARTITION_COLUMN, int(partition))).count())
        return TableStats(int(getattr(tbl.metadata, "last_sequence_number", 0) or 0), rows, part,
                          tbl.schema().as_arrow())

    def history(self) -> list[dict[str, Any]]:
        """Every snapshot's summary (oldest first), with ``snapshot_id`` and ``timestamp_ms``."""
        tbl = self.require()
        out = []
        for s in sorted(tbl.snapshots(), key=lambda s: s.sequence_number or 0):
            d: dict[str, Any] = dict(s.summary.additional_properties) if s.summary else {}
            if s.summary is not None:
                d["operation"] = s.summary.operation.value
            d.update(snapshot_id=s.snapshot_id, timestamp_ms=s.timestamp_ms)
            out.append(d)
        return out


def scan(tbl: Table, row_filter: BooleanExpression | str,
         columns: Sequence[str] | None) -> pa.Table:
    """``tbl``'s current rows matching ``row_filter``, projected to ``columns`` (all when
    None)."""
    return tbl.scan(row_filter=row_filter,
                    selected_fields=tuple(columns) if columns is not None else ("*",)).to_arrow()


def watermark_of(tbl: Table, app_id: str) -> int:
    """``app_id``'s watermark in ``tbl`` (its table property; 0 when none)."""
    return int(tbl.properties.get(WATERMARK_PREFIX + app_id, 0))


def moved(tbl: Table, watermarks: Mapping[str, tuple[int, int]]
          ) -> tuple[str, int, int] | None:
    """``(app id, expected, found)`` of the first app id whose watermark in ``tbl`` is not its
    expected one (``watermarks``: ``{app id: (expected, version)}``), or None."""
    for app_id, (expected, _) in watermarks.items():
        found = watermark_of(tbl, app_id)
        if found != expected:
            return app_id, expected, found
    return None


def key_tuples(table: pa.Table, keys: Sequence[str]) -> pa.Array:
    """One string per row identifying its composite key."""
    cols = [table[k].to_pylist() for k in keys]
    return pa.array([json.dumps(list(v), default=str) for v in zip(*cols, strict=True)])
