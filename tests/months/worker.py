"""Runs one partition of the keyed pipeline with eager table maintenance in its own process,
for kill -9 and zombie tests of maintenance (tests/months).

Usage: python tests/months/worker.py URL STREAM GROUP PARTITION TABLE_URI BATCH ACK_WAIT_S
       SIGNAL_STEP SIGNAL_AT SIGNAL [STORAGE_OPTIONS_JSON]
       (SIGNAL: KILL or STOP; step "-" = none; step
       "compacted": SIGKILL inside maintenance, after the compaction commit and before the
       state snapshots are carried over and written)
Prints the run result as one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import nats
from deltalake import DeltaTable

from cg_pipelines.engine.runner import run_partition
from cg_pipelines.sinks.delta import DeltaSink, Maintenance
from tests.support import keyed
from tests.support.worker_signals import signal_at, worker_options

EAGER = Maintenance(compact_min_files=3, vacuum_retention_hours=0, vacuum_interval_s=0)


def killed_after_compaction(sink: DeltaSink) -> DeltaSink:
    """``sink`` whose maintainer dies (SIGKILL) where it would carry the state snapshots over
    a compaction it just committed."""
    def die(dt: DeltaTable, partition: int) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    sink._maintainer._carry_states = die  # type: ignore[method-assign]
    return sink


async def main() -> None:
    url, stream, group, part, uri, batch, ack_wait, step, at, sig = sys.argv[1:11]
    storage = json.loads(sys.argv[11]) if len(sys.argv) > 11 else None
    hook = signal_at(step, at, sig)
    nc = await nats.connect(url)
    opts = worker_options(batch, ack_wait)
    sink = DeltaSink(uri, storage_options=storage, maintenance=EAGER)
    if step == "compacted":
        sink = killed_after_compaction(sink)
    res = await run_partition(nc, stream, group, int(part), keyed.processor(), sink, opts,
                              hook=hook)
    await nc.close()
    print(json.dumps(res.as_dict()), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
