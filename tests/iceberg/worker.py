"""Runs one partition into an Iceberg table in its own process, for kill -9 (SIGKILL) and
zombie (SIGSTOP) tests; the Iceberg twin of ``tests/support/engine_worker.py``.

Usage: python tests/iceberg/worker.py URL STREAM GROUP PARTITION SINK_JSON
       BATCH ACK_WAIT_S SIGNAL_STEP SIGNAL_AT SIGNAL   (SIGNAL: KILL or STOP; step "-" = none)
SINK_JSON: ``{"catalog": {...}, "identifier": "ns.t", "mode": "append" | "merge"}``.
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
from cg_pipelines.sinks.iceberg import IcebergSink
from tests.support import devices, keyed
from tests.support.worker_signals import signal_at, worker_options


async def main() -> None:
    url, stream, group, part, spec, batch, ack_wait, step, at, sig = sys.argv[1:11]
    cfg = json.loads(spec)
    merge = cfg["mode"] == "merge"
    sink = IcebergSink(cfg["identifier"], catalog=cfg["catalog"],
                       write=devices.MERGE if merge else None)
    hook = signal_at(step, at, sig)
    nc = await nats.connect(url)
    opts = worker_options(batch, ack_wait)
    proc = devices.processor() if merge else keyed.processor()
    res = await run_partition(nc, stream, group, int(part), proc, sink, opts, hook=hook)
    await nc.close()
    print(json.dumps(res.as_dict()), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
