"""Runs one partition in its own process, for crash (SIGKILL) and zombie (SIGSTOP) tests.

Usage: python tests/support/engine_worker.py URL STREAM GROUP PARTITION TABLE_URI
       BATCH ACK_WAIT_S SIGNAL_STEP SIGNAL_AT SIGNAL [SETTLE_INTERVAL_S]
       (SIGNAL: KILL or STOP; step "-" = none; SETTLE_INTERVAL_S: 0 if absent)
Prints the run result as one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import nats

from cg_pipelines.engine.runner import run_partition
from cg_pipelines.sinks.delta import DeltaSink
from tests.support import keyed
from tests.support.worker_signals import signal_at, worker_options


async def main() -> None:
    url, stream, group, part, uri, batch, ack_wait, step, at, sig = sys.argv[1:11]
    hook = signal_at(step, at, sig)
    nc = await nats.connect(url)
    opts = worker_options(batch, ack_wait, sys.argv[11] if len(sys.argv) > 11 else None)
    res = await run_partition(nc, stream, group, int(part), keyed.processor(), DeltaSink(uri),
                              opts, hook=hook)
    await nc.close()
    print(json.dumps(res.as_dict()), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
