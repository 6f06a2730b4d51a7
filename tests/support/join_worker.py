"""Runs one co-partitioned partition (tests/support/joined.py, two inputs) in its own process,
for crash (SIGKILL) and zombie (SIGSTOP) tests.

Usage: python tests/support/join_worker.py URL STREAM TABLE_URI BATCH ACK_WAIT_S
       SIGNAL_STEP SIGNAL_AT SIGNAL INPUT   (SIGNAL: KILL or STOP; step "-" = none; INPUT: the
       input whose per-input step counts, "-" for the joint steps)
Prints the run result as one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import nats

from cg_pipelines.engine.join import run_copartitioned
from cg_pipelines.sinks.delta import DeltaSink
from tests.support import joined
from tests.support.worker_signals import signal_at, worker_options


async def main() -> None:
    url, stream, uri, batch, ack_wait, step, at, sig, input_name = sys.argv[1:10]
    signal = signal_at(step, at, sig)

    def hook(name: str, info: dict) -> None:
        if input_name == "-" or info.get("input") == input_name:
            signal(name, info)

    nc = await nats.connect(url)
    res = await run_copartitioned(nc, joined.inputs(stream), 0, joined.processor(),
                                  DeltaSink(uri, write=joined.WRITE),
                                  worker_options(batch, ack_wait), hook=hook)
    await nc.close()
    print(json.dumps({"status": res.status, "commits": res.commits, "detail": res.detail}),
          flush=True)


if __name__ == "__main__":
    asyncio.run(main())
