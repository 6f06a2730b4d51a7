"""Partition runs that compact, write state snapshots and vacuum after their commits (eager
settings), through the real engine on a real nats-server: a kill -9 after a commit, a kill -9
between the compaction commit and the snapshot write, a zombie resumed after the new holder
compacted, and two concurrent runs of the same partition change nothing. The table equals the
keyed pipeline's pandas reference (its ``count`` column is right only if every state read was
exact), the watermark is the work queue's last sequence, live files stay bounded. On local
disk and moto S3."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from nats.js.api import StreamConfig

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.core.state import last_per_key
from cg_pipelines.engine import EngineOptions, rebuild_partition, run_partition
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.sinks.delta import DeltaSink
from tests.months.worker import EAGER
from tests.support import keyed

FAST = dict(ack_wait_s=1.5, priority_timeout_s=1.5, hold_wait_s=6.0)
HERE = Path(__file__).resolve().parent
BATCH = 20


def _worker(url: str, stream: str, where, step: str, at: int,
            sig: str = "KILL") -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(HERE / "worker.py"), url, stream, "g", "0", where[0], str(BATCH),
         str(FAST["ack_wait_s"]), step, str(at), sig, json.dumps(where[1])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


async def _publish(js, api: JetStreamAPI, stream: str, evs, total: int) -> None:
    await keyed.publish(js, stream, evs)
    for _ in range(200):
        if int((await api.stream_info(f"{stream}-g"))["state"]["last_seq"]) >= total:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the work queue did not receive the events")


def _sink(where, **kw) -> DeltaSink:
    return DeltaSink(where[0], storage_options=where[1], **kw)


async def _run(nc, stream: str, where):
    return await run_partition(nc, stream, "g", 0, keyed.processor(),
                               _sink(where, maintenance=EAGER),
                               EngineOptions(batch_max_msgs=BATCH, **FAST))


def _check(where, evs, watermark: int, app_id: str) -> None:
    sink = _sink(where)
    table = sink.read()
    assert keyed.mismatches(table, evs) is None
    assert sink.watermark(app_id) == watermark
    # the state read (snapshot + catch-up) equals the last rows of the whole table
    keys = sorted({k for k, _ in evs})
    cols = keyed.STATE.read_columns
    want = last_per_key(table.select(cols), "key", "seq")
    assert sink.last_rows("key", keys, cols, "seq", 0).equals(want)
    assert len(sink.file_uris()) < EAGER.compact_min_files + 2


async def test_kill_zombie_and_concurrent_runs_around_maintenance(
        nats_server, nc, js, unique_name, where) -> None:
    stream, uri = unique_name, where
    app_id = f"{stream}/g/0"
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    await admin.create_elastic(js, stream, "g", ElasticConfig(
        1, (PartitioningFilter(f"{stream}.*", (1,)),), members=("m1",)))
    api = JetStreamAPI.from_js(js)
    evs = keyed.events(9, 480)
    waves = [evs[i:i + 120] for i in range(0, 480, 120)]
    done: list = []

    # 1. kill -9 right after the 4th commit: no settle, no maintenance, no snapshot
    await _publish(js, api, stream, waves[0], 120)
    done += waves[0]
    proc = _worker(nats_server.url, stream, uri, "committed", at=4)
    _, err = await asyncio.to_thread(proc.communicate, timeout=60)
    assert proc.returncode == -signal.SIGKILL, err
    assert _sink(uri).watermark(app_id) == 80
    r = await _run(nc, stream, uri)
    assert r.status == "drained" and r.maintenance.get("compact") == "done", r
    _check(uri, done, 120, app_id)

    # 2. kill -9 inside maintenance: compaction committed, snapshots not carried over
    await _publish(js, api, stream, waves[1], 240)
    done += waves[1]
    proc = _worker(nats_server.url, stream, uri, "compacted", at=0)
    _, err = await asyncio.to_thread(proc.communicate, timeout=60)
    assert proc.returncode == -signal.SIGKILL, err
    _check(uri, done, 240, app_id)

    # 3. a zombie paused mid-batch; the new holder drains and compacts; the zombie is fenced
    await _publish(js, api, stream, waves[2], 360)
    done += waves[2]
    zombie = _worker(nats_server.url, stream, uri, "processed", at=2, sig="STOP")
    state = ""
    for _ in range(600):
        state = Path(f"/proc/{zombie.pid}/stat").read_text().split()[2]
        if state == "T":
            break
        await asyncio.sleep(0.05)
    assert state == "T", "worker never paused"
    try:
        r = await _run(nc, stream, uri)
        assert r.status == "drained" and r.maintenance.get("compact") == "done", r
    finally:
        os.kill(zombie.pid, signal.SIGCONT)
    out, err = await asyncio.to_thread(zombie.communicate, timeout=60)
    zr = json.loads(out.strip().splitlines()[-1])
    # Resumed, the zombie either commits its stale batch (refused: fenced) or, when its batch
    # before was already settled, finds the partition drained by the new holder and commits
    # nothing (then it maintains, which changes no row): which one is timing.
    assert (zr["status"], zr["fence_conflicts"]) in (("fenced", 1), ("drained", 0)), (zr, err)
    _check(uri, done, 360, app_id)

    # 4. two runs of the partition at once (one holds it, the other finds it held or empty)
    await _publish(js, api, stream, waves[3], 480)
    done += waves[3]
    a, b = await asyncio.gather(_run(nc, stream, uri), _run(nc, stream, uri))
    assert {a.status, b.status} <= {"drained", "held", "empty"}, (a, b)
    assert a.processed + b.processed == 120
    _check(uri, done, 480, app_id)
    assert int((await api.stream_info(f"{stream}-g"))["state"]["messages"]) == 0

    # 5. rebuild from the origin (after all that compaction and vacuum), maintain, drain more:
    # the same table and state as a fresh drain (the keyed reference)
    sink = _sink(uri, maintenance=EAGER)
    r = await rebuild_partition(nc, stream, "g", 0, keyed.processor(), sink,
                                EngineOptions(batch_max_msgs=50, read_chunk=100, **FAST))
    assert r.status == "rebuilt", r
    assert "error" not in sink.maintain(0, app_id)
    _check(uri, done, 480, app_id)
    more = keyed.events(9, 540)[480:]
    await _publish(js, api, stream, more, 540)
    r = await _run(nc, stream, uri)
    assert r.status == "drained", r
    _check(uri, done + more, 540, app_id)
