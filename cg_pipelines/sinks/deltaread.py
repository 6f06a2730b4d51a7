"""Reading a Delta table: :class:`DeltaReader`, the read part of a
:class:`~cg_pipelines.sinks.delta.DeltaSink` (rows, projected and filtered; each key's last
row, the state-sink contract; log statistics; data file URIs), over the sink's
:class:`~cg_pipelines.sinks.deltahandle.DeltaHandle`.

Reads go through pyarrow datasets over a native pyarrow filesystem
(:func:`~cg_pipelines.sinks.storage.table_filesystem`), not delta-rs' default handler.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError

from cg_pipelines.core.errors import ColumnNotFoundError
from cg_pipelines.core.state import last_per_key
from cg_pipelines.core.write import Append, Merge
from cg_pipelines.sinks.base import PARTITION_COLUMN, TableStats
from cg_pipelines.sinks.deltahandle import DeltaHandle
from cg_pipelines.sinks.deltastate import TableView

if TYPE_CHECKING:
    # Annotations only: pyarrow.dataset imports pandas (~0.3 s together), which importing the
    # sink (every load of a Dagster code location) need not pay; delta-rs'
    # DeltaTable.to_pyarrow_dataset imports it when a read needs it.
    import pyarrow.dataset as pads

__all__ = ["DeltaReader", "TableStats", "partition_rows"]


class DeltaReader:
    """The read part of a :class:`~cg_pipelines.sinks.delta.DeltaSink`."""

    def __init__(self, handle: DeltaHandle, write: Append | Merge,
                 schema: pa.Schema | None) -> None:
        """
        Args:
            handle: the sink's table handle (snapshots, filesystem, locks).
            write: the sink's write mode (a Merge table holds one row per key).
            schema: the schema given to the sink, if any (the shape of an absent table's
                reads).
        """
        self._t = handle
        self._write = write
        self._schema = schema

    def exists(self) -> bool:
        """:meth:`DeltaSink.exists <cg_pipelines.sinks.delta.DeltaSink.exists>`."""
        with self._t.guard():
            return self._t.load() is not None

    def read(
        self, columns: list[str] | None = None, filter: pads.Expression | None = None
    ) -> pa.Table:
        """:meth:`DeltaSink.read <cg_pipelines.sinks.delta.DeltaSink.read>`."""
        with self._t.guard():
            with self._t.read_lock:  # serialize refreshes of the shared reader snapshot
                dt = self._t.latest()
                ds = dt.to_pyarrow_dataset(filesystem=self._t.filesystem()) if dt else None
            if ds is None:
                if self._schema is not None:
                    empty = self._schema.empty_table()
                    return empty.select(columns) if columns is not None else empty
                return pa.table({c: pa.nulls(0) for c in columns or []})
            return _to_table(ds, columns, filter)

    def read_partitions(self, partitions: Sequence[int] | None = None) -> pa.Table:
        """:meth:`DeltaSink.read_partitions
        <cg_pipelines.sinks.delta.DeltaSink.read_partitions>`."""
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
        """:meth:`DeltaSink.last_rows <cg_pipelines.sinks.delta.DeltaSink.last_rows>`."""
        cols = list(dict.fromkeys([key, order_by, *columns]))
        if not keys:
            return self.read(columns=cols).slice(0, 0) if self.exists() else pa.table(
                {c: pa.nulls(0) for c in cols})
        view = self._t.run_view(app_id) if partition is not None else None
        if partition is not None and not isinstance(self._write, Merge):
            got = self._snapshot_rows(key, keys, cols, order_by, partition, view)
            if got is not None:
                return got
        flt = pc.field(key).isin(list(keys))
        part = None
        if partition is not None and PARTITION_COLUMN in self._t.column_names():
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
        states = self._t.partition_states()
        if states is None:
            return None
        with self._t.guard():
            if view is None:
                view = self._t.latest_view()
            if view is None:
                return None
            missing = [c for c in (key, order_by) if c not in view.columns]
            if missing:
                raise ColumnNotFoundError(f"columns {missing} not in the table")
            return states.last_rows(view, key, keys, cols, order_by, partition)

    def stats(self, partition: int | None = None) -> TableStats:
        """:meth:`DeltaSink.stats <cg_pipelines.sinks.delta.DeltaSink.stats>`."""
        with self._t.guard():
            dt = self._t.load()
            if dt is None:
                raise TableNotFoundError(f"{self._t.safe_uri()}: no Delta table")
            actions = pa.table(dt.get_add_actions(flatten=True))
            rows = pc.sum(actions["num_records"]).as_py() or 0
            part_rows = None
            col = f"partition.{PARTITION_COLUMN}"
            if partition is not None and col in actions.column_names:
                mine = actions.filter(pc.equal(actions[col].cast(pa.int64()), partition))
                part_rows = pc.sum(mine["num_records"]).as_py() or 0
            return TableStats(dt.version(), int(rows), part_rows, pa.schema(dt.schema().to_arrow()))

    def file_uris(self) -> list[str]:
        """:meth:`DeltaSink.file_uris <cg_pipelines.sinks.delta.DeltaSink.file_uris>`."""
        with self._t.guard():
            dt = self._t.load()
            return list(dt.file_uris()) if dt is not None else []


def partition_rows(dt: DeltaTable, partition: int, fs: pafs.FileSystem | None) -> int:
    """Rows of consumer-group ``partition`` in snapshot ``dt``: from the add actions'
    partition values and record counts when the table is partitioned by
    :data:`PARTITION_COLUMN` (no data file read), else by scanning the table over ``fs``
    (0 when it has no such column)."""
    actions = pa.table(dt.get_add_actions(flatten=True))
    col = f"partition.{PARTITION_COLUMN}"
    if col in actions.column_names:
        mine = actions.filter(pc.equal(actions[col].cast(pa.int64()), partition))
        return int(pc.sum(mine["num_records"]).as_py() or 0)
    if PARTITION_COLUMN not in [f.name for f in dt.schema().fields]:
        return 0
    return int(dt.to_pyarrow_dataset(filesystem=fs).count_rows(
        filter=pc.field(PARTITION_COLUMN) == partition))


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
