"""``python -m tests.support.migrate_until URL STREAM GROUP PARTITIONS KILL_AT``: run
:func:`cg_pipelines.jetstream.migration.migrate` and kill this process with SIGKILL when the
migration's hook reports ``KILL_AT`` (e.g. ``source_removed:acted``): a crash at that point.
Exits 0 when the migration finished without reaching it."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import nats

from cg_pipelines.core.migration import Migration
from cg_pipelines.jetstream.migration import MigrationOptions, migrate


async def main(url: str, stream: str, group: str, partitions: int, kill_at: str) -> None:
    def hook(name: str, rec: Migration) -> None:
        print(name, flush=True)
        if name == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    nc = await nats.connect(url)
    try:
        opts = MigrationOptions(drain_timeout_s=120, first_message_timeout_s=120)
        await migrate(nc.jetstream(), stream, group, partitions, opts, hook=hook)
    finally:
        await nc.close()


if __name__ == "__main__":
    url, stream, group, partitions, kill_at = sys.argv[1:6]
    asyncio.run(main(url, stream, group, int(partitions), kill_at))
