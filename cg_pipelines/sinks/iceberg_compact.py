"""Compaction of one consumer-group partition of an Iceberg table, under the partition's lease
(:meth:`IcebergSink.maintain <cg_pipelines.sinks.iceberg.IcebergSink.maintain>`, issue 40).

pyiceberg 0.12 has no data-file rewrite (no ``rewrite_data_files``), so a partition with at
least :attr:`Maintenance.compact_min_files <cg_pipelines.sinks.maintenance.Maintenance.
compact_min_files>` data files smaller than :attr:`Maintenance.target_size
<cg_pipelines.sinks.maintenance.Maintenance.target_size>` (the same thresholds as Delta's) is
rewritten whole: its rows are read at one table state and written back by ``overwrite(rows,
overwrite_filter=EqualTo("_partition", p))`` in ONE transaction built on that state. No row and
no watermark changes; the snapshots carry ``cg.operation = "compact"``. The fence is the
sink's: the catalog refuses the commit when any commit landed since that state
(``AssertRefSnapshotId``, pyiceberg's retry off); then, with the partition's watermark
unchanged (another partition's commit), the compaction is read and tried again (at most
:data:`~cg_pipelines.sinks.maintenance.COMPACT_ATTEMPTS` attempts in all), with it moved (a
newer holder committed) it is given up (``"fenced"``): the newer holder compacts after its own
run. The partition's rows are held in memory while rewritten (as in ``replace_partition``).

An append-mode sink's state snapshots (:mod:`cg_pipelines.sinks.iceberg_state`) are caught up
to the state the compaction is built on and carried over to the files it wrote, so the next
state read does not read the partition whole.
"""

from __future__ import annotations

from collections.abc import Callable

from pyiceberg.exceptions import CommitFailedException
from pyiceberg.table import Table

from cg_pipelines.core.statesnap import needs_compaction
from cg_pipelines.sinks.base import PARTITION_COLUMN
from cg_pipelines.sinks.iceberg_expr import equal_to
from cg_pipelines.sinks.iceberg_state import IcebergStates, partition_tasks
from cg_pipelines.sinks.iceberg_view import commit_view
from cg_pipelines.sinks.maintenance import COMPACT_ATTEMPTS, Maintenance

__all__ = ["compact_partition", "partition_files"]


def partition_files(tbl: Table, partition: int) -> list[int]:
    """The sizes (bytes) of the partition's live data files in ``tbl``'s current snapshot."""
    return [t.file.file_size_in_bytes for t in partition_tasks(tbl, partition)]


def compact_partition(load: Callable[[], Table], partition: int, pol: Maintenance,
                      watermark: Callable[[Table], int],
                      summary: Callable[[int], dict[str, str]],
                      out: dict[str, int | float | str],
                      states: IcebergStates | None = None) -> bool:
    """Compact ``partition`` when due (see the module docstring); ``load`` gives the table's
    latest state, ``watermark`` the partition's watermark in a state, ``summary`` the
    snapshot summary for a watermark, ``states`` the sink's state snapshots (append mode).
    Figures go into ``out``: ``iceberg_compaction`` ("no", "done", "fenced", "failed"),
    ``iceberg_files_compacted``, ``iceberg_files_live``, ``snapshots_written``.
    Returns whether a compaction was committed.

    Raises:
        OSError / pyarrow / pyiceberg errors: reads, writes, the catalog (the caller reports
            them; nothing is committed by a failed attempt).
    """
    where = equal_to(PARTITION_COLUMN, int(partition))
    out["iceberg_compaction"] = "no"
    tbl = load()
    sizes = partition_files(tbl, partition)
    out["iceberg_files_live"] = len(sizes)
    if not pol.compact or not needs_compaction(sizes, pol.compact_min_files, pol.target_size):
        return False
    wm = watermark(tbl)
    for _attempt in range(COMPACT_ATTEMPTS):
        removed = [t.file.file_path for t in partition_tasks(tbl, partition)]
        if states is not None:
            states.before_rewrite(tbl, partition)
        rows = tbl.scan(row_filter=where).to_arrow()
        view = commit_view(tbl)
        try:
            with view.transaction() as txn:
                txn.overwrite(rows, overwrite_filter=where, snapshot_properties=summary(wm))
        except CommitFailedException:
            tbl = load()
            if watermark(tbl) != wm:
                out["iceberg_compaction"] = "fenced"
                return False
            continue
        added = [t.file.file_path for t in partition_tasks(view, partition)]  # view: the commit's
        out["iceberg_compaction"] = "done"
        out["iceberg_files_compacted"] = len(removed)
        out["iceberg_files_live"] = len(added)
        if states is not None:
            out["snapshots_written"] = states.after_rewrite(view, partition, removed, added)
        return True
    out["iceberg_compaction"] = "failed"
    return False
