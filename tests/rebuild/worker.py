"""Rebuilds one partition of the aircraft legs in its own process, for the kill -9 test.

Usage: python tests/rebuild/worker.py URL STREAM PARTITION TABLE_URI KILL_AT_PROCESSED
(``KILL_AT_PROCESSED``: SIGKILL itself after that many processed batches; 0 = never).
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

from cg_pipelines.engine import EngineOptions, rebuild_partition
from cg_pipelines.sinks.delta import DeltaSink
from flights.legs import legs_arrow_processor


async def main() -> None:
    url, stream, part, uri, kill_at = sys.argv[1:6]
    seen = {"n": 0}

    def hook(name: str, info: dict) -> None:
        if name == "processed":
            seen["n"] += 1
            if seen["n"] == int(kill_at):
                os.kill(os.getpid(), signal.SIGKILL)

    nc = await nats.connect(url)
    res = await rebuild_partition(nc, stream, "legs", int(part), legs_arrow_processor(),
                                  DeltaSink(uri), EngineOptions(
                                      batch_max_msgs=300, read_chunk=500, ack_wait_s=1.5,
                                      priority_timeout_s=1.5, hold_wait_s=3.0), hook=hook)
    await nc.close()
    print(json.dumps(res.as_dict()), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
