"""The Iceberg side of the per-partition state snapshots (:mod:`cg_pipelines.sinks.partstate`):
an append-mode :class:`~cg_pipelines.sinks.iceberg.IcebergSink`'s ``last_rows`` of one
partition costs O(data files committed since the last snapshot), not O(the partition's history)
(issue 40: the aged table's state read scanned the partition's compacted file whole, which
grows with every row the partition ever got).

:class:`IcebergView` is one table state as :class:`~cg_pipelines.sinks.partstate.StateView`:
the table UUID, its last sequence number, a partition's live data files (planned from the
manifests, pruned by the identity partition on
:data:`~cg_pipelines.sinks.base.PARTITION_COLUMN`) and a read of some of them (pyiceberg's
``ArrowScan``: columns matched by field id, as a table scan reads them). pyiceberg names every
data file with a UUID and never reuses a path, the property the snapshot's exactness rests on
(:mod:`cg_pipelines.core.statesnap`).

:class:`IcebergStates` keeps the states of one table. Stored snapshots live at
``<table location>/_cg_state/<spec>/p<partition>.parquet``
(:class:`~cg_pipelines.sinks.statesnapshot.SnapshotStore`), written through the table's own
pyarrow filesystem (pyiceberg's ``PyArrowFileIO``, the catalog's credentials). Iceberg metadata
never names them: pyiceberg's snapshot expiry leaves them, and an orphan-file removal (Spark's
``remove_orphan_files``) may delete them; they are a cache, the next state read rebuilds a
missing one from the table. No snapshots (state reads scan the partition, as before) for a
table not identity-partitioned on :data:`~cg_pipelines.sinks.base.PARTITION_COLUMN` alone or
whose FileIO is not pyarrow's.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.fs as pafs
from pyiceberg.expressions import AlwaysTrue
from pyiceberg.io.pyarrow import ArrowScan, PyArrowFileIO
from pyiceberg.table import FileScanTask, Table
from pyiceberg.transforms import IdentityTransform

from cg_pipelines.core.errors import InvariantError
from cg_pipelines.sinks.base import PARTITION_COLUMN
from cg_pipelines.sinks.iceberg_expr import equal_to
from cg_pipelines.sinks.partstate import PartitionStates

__all__ = ["IcebergStates", "IcebergView", "partition_tasks"]


def partition_tasks(tbl: Table, partition: int) -> list[FileScanTask]:
    """The scan tasks of ``partition``'s live data files in ``tbl``'s current snapshot (one
    per file: pyiceberg writes no delete files)."""
    return list(tbl.scan(row_filter=equal_to(PARTITION_COLUMN, int(partition))).plan_files())


def identity_partitioned(tbl: Table) -> bool:
    """Whether ``tbl``'s current partition spec is identity on :data:`PARTITION_COLUMN` alone
    (its files then hold one partition's rows each; :meth:`IcebergView.files` also checks
    that a partition's files were all written under it: the sink creates a table and then
    adds the spec)."""
    if PARTITION_COLUMN not in tbl.schema().column_names:
        return False
    fields = tbl.spec().fields
    source = tbl.schema().find_field(PARTITION_COLUMN).field_id
    return len(fields) == 1 and fields[0].source_id == source and isinstance(
        fields[0].transform, IdentityTransform)


@dataclass
class IcebergView:
    """One state of an Iceberg table as the state snapshots see it (a
    :class:`~cg_pipelines.sinks.partstate.StateView`). Plans each partition's files once."""

    table: Table
    partitioned: bool
    _tasks: dict[str, FileScanTask] = field(default_factory=dict)

    @classmethod
    def of(cls, tbl: Table) -> IcebergView:
        """The view of ``tbl``'s current snapshot."""
        return cls(tbl, identity_partitioned(tbl))

    @property
    def table_id(self) -> str:
        """The table's UUID."""
        return str(self.table.metadata.table_uuid)

    @property
    def version(self) -> int:
        """The table's last sequence number."""
        return int(getattr(self.table.metadata, "last_sequence_number", 0) or 0)  # v1: none

    def files(self, partition: int) -> list[tuple[str, int]] | None:
        """``(path, size in bytes)`` of ``partition``'s live data files (None: not identity
        partitioned on :data:`PARTITION_COLUMN`, or a file written under another spec)."""
        if not self.partitioned:
            return None
        tasks = partition_tasks(self.table, partition)
        spec = self.table.spec().spec_id
        if any(t.file.spec_id != spec for t in tasks):
            return None  # a file of an earlier spec may hold other partitions' rows
        self._tasks.update((t.file.file_path, t) for t in tasks)
        return [(t.file.file_path, t.file.file_size_in_bytes) for t in tasks]

    def read(self, files: Collection[str], columns: list[str]) -> pa.Table:
        """``columns`` of the rows of ``files`` (paths :meth:`files` gave).

        Raises:
            InvariantError: a path :meth:`files` did not give.
        """
        missing = [f for f in files if f not in self._tasks]
        if missing:
            raise InvariantError(f"state read: {len(missing)} files are not live in the view")
        projected = self.table.schema().select(*columns)
        rows = ArrowScan(self.table.metadata, self.table.io, projected, AlwaysTrue()).to_table(
            [self._tasks[f] for f in files])
        return rows.select(columns)


def state_filesystem(tbl: Table) -> pafs.FileSystem | None:
    """A pyarrow filesystem rooted at ``tbl``'s location, from its pyarrow FileIO (None with
    another FileIO)."""
    io = tbl.io
    if not isinstance(io, PyArrowFileIO):
        return None
    scheme, netloc, path = PyArrowFileIO.parse_location(tbl.location())
    return pafs.SubTreeFileSystem(path, io.fs_by_scheme(scheme, netloc))


class IcebergStates:
    """The state snapshots of one append-mode Iceberg table (see the module docstring).
    Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._states: tuple[str, PartitionStates] | None = None

    def states(self, tbl: Table) -> PartitionStates | None:
        """The states of ``tbl`` (kept per table location), or None when snapshots do not
        apply to it."""
        location = tbl.location()
        with self._lock:
            if self._states is not None and self._states[0] == location:
                return self._states[1]
        fs = state_filesystem(tbl)
        if fs is None or not identity_partitioned(tbl):
            return None
        states = PartitionStates(fs)
        with self._lock:
            self._states = (location, states)
        return states

    def last_rows(self, tbl: Table, key: str, keys: Sequence[object], columns: list[str],
                  order_by: str, partition: int) -> pa.Table | None:
        """The last row of each of ``keys`` in ``tbl``'s current snapshot (``columns``,
        sorted by key), or None when snapshots do not apply (the caller scans)."""
        states = self.states(tbl)
        if states is None:
            return None
        rows = states.last_rows(IcebergView.of(tbl), key, keys, columns, order_by, partition)
        return None if rows is None else rows.sort_by(key)

    def before_rewrite(self, tbl: Table, partition: int) -> None:
        """Catch ``partition``'s states (those stored by any process too) up to ``tbl``,
        the state a compaction of the partition is built on, so they cover every file it
        removes."""
        states = self.states(tbl)
        if states is not None:
            view = IcebergView.of(tbl)
            states.load_stored(view, partition)
            states.refresh(view, partition)

    def after_rewrite(self, tbl: Table, partition: int, removed: Collection[str],
                      added: Collection[str]) -> int:
        """A compaction committed as ``tbl``'s current snapshot replaced ``removed`` by
        ``added`` (every row kept): carry ``partition``'s states over and store them.
        Returns the snapshots written.

        Raises:
            OSError / pyarrow errors: a snapshot could not be written.
        """
        states = self.states(tbl)
        if states is None:
            return 0
        states.after_rewrite(partition, removed, added, IcebergView.of(tbl).version)
        return states.persist(partition)
