"""The Delta side of the per-partition state snapshots (:mod:`cg_pipelines.sinks.partstate`):
:class:`TableView`, what state reads and upkeep need of one Delta snapshot (its live files from
the log's add actions, its data read through a pyarrow dataset over the native filesystem).

Used only when the table is partitioned by exactly
:data:`~cg_pipelines.sinks.base.PARTITION_COLUMN` (the sink's default): the partition's files
are then known from the Delta log without reading them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
from deltalake import DeltaTable

if TYPE_CHECKING:
    import pyarrow.dataset as pads  # imports pandas: annotations only

from cg_pipelines.core.errors import InvariantError
from cg_pipelines.sinks.base import PARTITION_COLUMN

__all__ = ["TableView"]


@dataclass(frozen=True)
class TableView:
    """What state reads and upkeep need of one Delta snapshot, taken once (:meth:`of`) so
    they can go on without the ``DeltaTable`` (and its lock) while commits advance it.

    Attributes:
        table_id: the Delta metadata id. version: the snapshot's version.
        columns: the table's column names. partitioned: partitioned by exactly
        :data:`PARTITION_COLUMN`. actions: the live files' add actions (flattened).
        datasets: makes the table's pyarrow dataset over the native filesystem (fragments
        named by their log paths), or None without one (delta-rs' own filesystem handler is
        not used, see :mod:`cg_pipelines.sinks.delta`); called once, by the first read of
        :attr:`dataset` (most state reads need no data file read: no dataset is made).
    """

    table_id: str
    version: int
    columns: list[str]
    partitioned: bool
    actions: pa.Table
    datasets: Callable[[], pads.Dataset | None]

    @classmethod
    def of(cls, dt: DeltaTable, fs: pafs.FileSystem | None,
           datasets: Callable[[], pads.Dataset | None] | None = None) -> TableView:
        """The view of snapshot ``dt``; its dataset is ``dt``'s over ``fs`` unless
        ``datasets`` makes it (e.g. under a lock, from a snapshot a commit may advance: the
        data files the view names are still in it)."""
        meta = dt.metadata()
        return cls(str(meta.id), dt.version(), dt.schema().to_arrow().names,
                   meta.partition_columns == [PARTITION_COLUMN],
                   pa.table(dt.get_add_actions(flatten=True)),
                   datasets or (lambda: dt.to_pyarrow_dataset(filesystem=fs)
                                if fs is not None else None))

    @cached_property
    def dataset(self) -> pads.Dataset | None:
        """The table's dataset (see ``datasets``; made on first use)."""
        return self.datasets()

    def files(self, partition: int) -> list[tuple[str, int]] | None:
        """``(path, size in bytes)`` of the live data files of ``partition``, or None when the
        table is not partitioned by exactly :data:`PARTITION_COLUMN`."""
        if not self.partitioned:
            return None
        col = f"partition.{PARTITION_COLUMN}"
        mine = self.actions.filter(pc.equal(self.actions[col].cast(pa.int64()), int(partition)))
        return list(zip(mine["path"].to_pylist(), mine["size_bytes"].to_pylist(), strict=True))

    def read(self, files: Collection[str], columns: list[str]) -> pa.Table:
        """``columns`` of the rows of ``files`` (live data files of this snapshot, by their
        log paths).

        Raises:
            InvariantError: no dataset, or a file not in it.
        """
        import pyarrow.dataset as pads  # imports pandas: only when a read needs it

        ds = self.dataset
        if ds is None:
            raise InvariantError("state read: a table view without a dataset")
        wanted = set(files)
        frags = [f for f in ds.get_fragments() if f.path in wanted]
        if len(frags) != len(wanted):
            raise InvariantError(f"state read: {len(wanted) - len(frags)} of the partition's "
                                 "live files are not in the table's dataset")
        sub = pads.FileSystemDataset(frags, ds.schema, ds.format, ds.filesystem)
        return sub.to_table(columns=columns)


