"""Snapshot expiry of an Iceberg table the sink writes (:meth:`IcebergSink.maintain
<cg_pipelines.sinks.iceberg.IcebergSink.maintain>`), in batches.

Expiry is a catalog commit of its own (pyiceberg 0.12's ``table.maintenance.expire_snapshots()``
commits as it goes), a new metadata file, and a race with the partitions' commits. Expiring down
to ``keep`` after every run made every run of a table past ``keep`` snapshots pay one more
commit than a younger table's (issue 40: the aged table expired once per run, the fresh one
not at all). So expiry waits until the table holds more than ``keep + slack`` snapshots
(:func:`expiry_slack`: half of ``keep``) and then expires down to ``keep``: one expiry commit
every ``slack`` commits or so, at any age. What it gives up: between two expiries the table
holds up to ``slack`` snapshots more than ``keep`` (time travel only: expiry deletes no file).
A snapshot a branch or tag points at is never expired.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from pyiceberg.exceptions import CommitFailedException
from pyiceberg.table import Table

__all__ = ["expire_old_snapshots", "expiry_slack"]

ATTEMPTS = 20
"""Expiry commits lost to other commits before giving up (retried at the next run)."""


def expiry_slack(keep: int) -> int:
    """Snapshots above ``keep`` a table may hold before :func:`expire_old_snapshots` expires
    (``keep // 2``, at least 1)."""
    return max(1, keep // 2)


def expire_old_snapshots(tbl: Table, load: Callable[[], Table], keep: int) -> tuple[int, int]:
    """When ``tbl`` holds more than ``keep`` + :func:`expiry_slack` snapshots, expire all but
    the newest ``keep`` (by commit time) and those refs point at, in one commit (on a lost
    race: ``load()`` the latest state and try again, :data:`ATTEMPTS` times in all).

    Returns:
        ``(snapshots before, snapshots expired)``.

    Raises:
        CommitFailedException: :data:`ATTEMPTS` races lost.
    """
    before = len(tbl.snapshots())
    for attempt in range(ATTEMPTS):
        refs = {r.snapshot_id for r in tbl.metadata.refs.values()}
        live = sorted(tbl.snapshots(), key=lambda s: (s.timestamp_ms, s.sequence_number or 0))
        if len(live) <= keep + expiry_slack(keep):
            return before, 0
        old = [s.snapshot_id for s in live[:-keep] if s.snapshot_id not in refs]
        if not old:
            return before, 0
        try:
            tbl.maintenance.expire_snapshots().by_ids(old).commit()
            return before, len(old)
        except CommitFailedException:  # lost a race with a commit: try again
            if attempt == ATTEMPTS - 1:
                raise
            time.sleep(random.uniform(0.005, 0.05))
            tbl = load()
    return before, 0
