"""Upkeep of an Iceberg table: :class:`IcebergMaintainer`, the maintainer part of an
:class:`~cg_pipelines.sinks.iceberg.IcebergSink` (its ``maintain``, the
:class:`~cg_pipelines.sinks.base.MaintainedSink` capability): a partition's small files
compacted (:mod:`cg_pipelines.sinks.iceberg_compact`), then old snapshots expired
(:mod:`cg_pipelines.sinks.iceberg_expire`). No row and no watermark changes.
"""

from __future__ import annotations

import time

from pyiceberg.table import Table

from cg_pipelines.sinks.iceberg_compact import compact_partition
from cg_pipelines.sinks.iceberg_expire import expire_old_snapshots
from cg_pipelines.sinks.iceberg_read import IcebergReader, watermark_of
from cg_pipelines.sinks.iceberg_write import IcebergWriter
from cg_pipelines.sinks.lineage import CommitLineage
from cg_pipelines.sinks.maintenance import Maintenance

__all__ = ["IcebergMaintainer"]


class IcebergMaintainer:
    """The maintainer part of an :class:`~cg_pipelines.sinks.iceberg.IcebergSink`."""

    def __init__(self, reader: IcebergReader, writer: IcebergWriter, lineage: CommitLineage,
                 policy: Maintenance, keep_snapshots: int) -> None:
        """
        Args:
            reader / writer: the sink's parts (loads; pyiceberg's retry turned off, the held
                base dropped after a compaction).
            lineage: the compaction snapshots' summaries. policy: the compaction thresholds
                (``compact``, ``compact_min_files``, ``target_size``) and ``snapshots``.
            keep_snapshots: the snapshots expiry keeps (>= 1).
        """
        self._reader = reader
        self._writer = writer
        self._lineage = lineage
        self.policy = policy
        self._keep = keep_snapshots

    def maintain(self, partition: int, app_id: str) -> dict[str, int | float | str]:
        """:meth:`IcebergSink.maintain <cg_pipelines.sinks.iceberg.IcebergSink.maintain>`:
        figures for the run's metadata; a failure is reported as ``error``, never raised."""
        t0 = time.monotonic()
        figures: dict[str, int | float | str] = {}
        try:
            tbl = self._reader.load()  # one load serves the compaction check and the expiry
            loaded = [tbl] if tbl is not None else []

            def latest() -> Table:  # that state first, then the catalog's latest
                return self._writer.no_pyiceberg_retry(loaded.pop() if loaded
                                                       else self._reader.require())

            if tbl is not None and compact_partition(
                    latest, partition, self.policy, lambda t: watermark_of(t, app_id),
                    lambda wm: self._lineage.commit(app_id, wm, "compact",
                                                    {"partition": partition}),
                    figures, self._reader.states if self.policy.snapshots else None):
                self._writer.forget(app_id)  # the held base is stale: the next commit reloads
                tbl = self._reader.load()
            before, expired = (0, 0) if tbl is None else expire_old_snapshots(
                tbl, self._reader.require, self._keep)
            figures.update(iceberg_snapshots=before - expired,
                           iceberg_snapshots_expired=expired)
        except Exception as e:  # upkeep must not fail the run (reported)
            figures["error"] = f"{type(e).__name__}: {e}"
        figures["iceberg_expire_seconds"] = round(time.monotonic() - t0, 3)
        return figures
