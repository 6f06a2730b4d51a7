"""Runs one elastic member instance in its own process, for HA (SIGKILL) tests.

Usage: python tests/support/member_worker.py URL STREAM GROUP MEMBER OUT_FILE ACK_WAIT_S

Messages are JSON ``{"key": str, "n": int}`` (optionally ``"hold": seconds``). For each one the
handler appends the line ``"<work-queue seq> <key> <n> <time.time()>"`` to OUT_FILE (flushed, so
it survives a SIGKILL), waits ``hold`` seconds if given (a window to kill the process with the
message processed but not acknowledged), then acks it (double ack; a failed ack is ignored: the
message is redelivered). Prints ``ready``
once joined, then runs until killed; if the member ends on its own it prints ``done <error>``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import nats

from cg_pipelines.jetstream.members import GroupMsg, MemberConfig, elastic_consume


async def main() -> None:
    url, stream, group, member, out_path, ack_wait = sys.argv[1:7]
    nc = await nats.connect(url, max_reconnect_attempts=-1)
    js = nc.jetstream(timeout=5)
    out = open(out_path, "a", buffering=1)  # lives as long as the process

    async def handle(msg: GroupMsg) -> None:
        d = json.loads(msg.data)
        out.write(f"{msg.metadata.sequence.stream} {d['key']} {d['n']} {time.time():.6f}\n")
        out.flush()
        if d.get("hold"):
            await asyncio.sleep(float(d["hold"]))  # a slow handler, as the message asks
        try:
            await msg.ack_sync(timeout=2.0)
        except Exception:  # redelivered later; the test counts duplicates
            pass

    member_ = await elastic_consume(js, stream, group, member, handle,
                                    MemberConfig(ack_wait_s=float(ack_wait)))
    print("ready", flush=True)
    err = await member_.done()
    print(f"done {err!r}", flush=True)
    await nc.close()


if __name__ == "__main__":
    asyncio.run(main())
