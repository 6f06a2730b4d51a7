"""Runs a range of partitions in its own process, for crash (SIGKILL) tests of
:func:`~cg_pipelines.engine.runner.run_partitions`.

Usage: python tests/support/range_worker.py URL STREAM GROUP PARTITIONS TABLE_URI
       BATCH ACK_WAIT_S SIGNAL_STEP SIGNAL_AT SIGNAL   (PARTITIONS: comma-separated; SIGNAL:
       KILL or STOP; step "-" = none)
Prints the run result as one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import nats

from cg_pipelines.engine.runner import run_partitions
from cg_pipelines.sinks.delta import DeltaSink
from tests.support import keyed
from tests.support.worker_signals import signal_at, worker_options


async def main() -> None:
    url, stream, group, parts, uri, batch, ack_wait, step, at, sig = sys.argv[1:11]
    hook = signal_at(step, at, sig)
    nc = await nats.connect(url)
    opts = worker_options(batch, ack_wait)
    res = await run_partitions(nc, stream, group, [int(p) for p in parts.split(",")],
                               keyed.processor(), DeltaSink(uri), opts, hook=hook)
    await nc.close()
    print(json.dumps(res.as_dict()), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
