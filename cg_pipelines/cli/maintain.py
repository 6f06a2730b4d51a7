"""``cg maintain STREAM GROUP TABLE [-p P]...``: a partition's Delta table upkeep on demand or
from a scheduler (cron, a Dagster schedule running the command), under the partition's lease
like a run (:func:`cg_pipelines.engine.maintain.maintain_partition`): state snapshots,
compaction, VACUUM and log cleanup (:mod:`cg_pipelines.sinks.maintenance`).

TABLE is the Delta table's URI (local path or ``s3://bucket/path``); S3 settings come from the
environment (delta-rs reads ``AWS_*``) or ``--storage-option KEY=VALUE`` (values never printed).
Exit codes as every ``cg`` command: 0 ok (also when a partition is held by a run: skipped);
2 invalid input; 1 server or connection failure, or a maintenance error.
"""

from __future__ import annotations

from typing import Any

import click

from cg_pipelines.cli.context import Ctx, fail
from cg_pipelines.core.errors import UsageError
from cg_pipelines.engine.maintain import maintain_partition
from cg_pipelines.engine.options import EngineOptions
from cg_pipelines.jetstream import admin
from cg_pipelines.sinks.delta import DeltaSink
from cg_pipelines.sinks.maintenance import Maintenance

__all__ = ["maintain"]


@click.command("maintain")
@click.argument("stream")
@click.argument("group")
@click.argument("table")
@click.option("--partition", "-p", "partitions", type=int, multiple=True,
              help="Only these partitions (repeat); default all.")
@click.option("--compact-min-files", type=int, default=16, show_default=True,
              help="Compact a partition with at least this many small files.")
@click.option("--target-size-mb", type=int, default=128, show_default=True,
              help="MiB compaction aims for.")
@click.option("--vacuum-retention-hours", type=int, default=168, show_default=True,
              help="VACUUM keeps unreferenced files this long; -1: no VACUUM.")
@click.option("--ack-wait-s", type=float, default=30.0, show_default=True,
              help="The runs' EngineOptions.ack_wait_s (the lease consumer's settings).")
@click.option("--priority-timeout-s", type=float, default=30.0, show_default=True,
              help="The runs' EngineOptions.priority_timeout_s.")
@click.option("--storage-option", "storage", multiple=True, metavar="KEY=VALUE",
              help="delta-rs storage option (repeat), e.g. AWS_ENDPOINT_URL=http://...")
@click.pass_obj
def maintain(c: Ctx, stream: str, group: str, table: str, partitions: tuple[int, ...],
             compact_min_files: int, target_size_mb: int, vacuum_retention_hours: int,
             ack_wait_s: float, priority_timeout_s: float, storage: tuple[str, ...]) -> None:
    """Compact, snapshot and vacuum TABLE for GROUP's partitions, each under its lease."""
    bad = [s for s in storage if "=" not in s]
    if bad:
        fail(f"--storage-option must be KEY=VALUE, got {bad[0].split('=')[0]!r}", 2)
    try:
        policy = Maintenance(compact_min_files=compact_min_files,
                             target_size=target_size_mb * 1024 * 1024,
                             vacuum_retention_hours=None if vacuum_retention_hours < 0
                             else vacuum_retention_hours, vacuum_interval_s=0)
    except ValueError as e:
        fail(str(e), 2)
    options = dict(s.split("=", 1) for s in storage)
    sink = DeltaSink(table, storage_options=options or None, maintenance=policy)

    async def go(js: Any) -> list[dict[str, Any]]:
        v = await admin.get_elastic(js, stream, group, timeout=c.timeout)
        n = v.config.max_members
        out_of_range = [p for p in partitions if not 0 <= p < n]
        if out_of_range:
            raise UsageError(f"partition {out_of_range[0]} out of range: {stream}.{group} has "
                             f"partitions 0..{n - 1}")
        nc = await c.opts.connect()
        try:
            rows = []
            for p in partitions or range(n):
                r = await maintain_partition(nc, stream, group, p, sink,
                                             EngineOptions(timeout_s=c.timeout,
                                                           ack_wait_s=ack_wait_s,
                                                           priority_timeout_s=priority_timeout_s))
                rows.append({"partition": p, "status": r.status, **r.maintenance})
            return rows
        finally:
            await nc.close()

    rows = c.run(go)
    lines = [f"partition {r['partition']}: {r['status']} " + ", ".join(
        f"{k}={v}" for k, v in r.items() if k not in ("partition", "status")) for r in rows]
    c.out(rows, "\n".join(lines))
    if any("error" in r for r in rows):
        fail("maintenance failed for partition(s) " + ", ".join(
            str(r["partition"]) for r in rows if "error" in r), 1)
