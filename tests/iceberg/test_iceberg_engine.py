"""The exactly-once scenarios against Iceberg tables: kill -9 at each engine step, a paused
zombie resumed after another run drained the partition, two runs started at once, rebuild,
merge with deletes and re-inserts. Each result is compared with an independent pandas (or
plain Python) reference: ``tests.support.keyed`` / ``tests.support.devices``.

Matrix (to stay in the CI budget, each scenario runs on one backend, and every backend —
SQLite or Postgres catalog x local disk or moto S3 — carries several scenarios):

============================  ==============  ==============  ==============  ==============
scenario                      sqlite-local    sqlite-s3       postgres-local  postgres-s3
============================  ==============  ==============  ==============  ==============
kill -9 at leased/read        x                                               x
kill -9 at processed/commit.                  x               x
kill -9 at purged/acked       x                               x
zombie (SIGSTOP, append)                      x
zombie (SIGSTOP, merge)                                       x
two runs at once                                                              x
rebuild                       x                                               x
merge, deletes, re-inserts    x (+kill -9)                    x
Spark processor (merge)       x
============================  ==============  ==============  ==============  ==============

The fence itself (stale writer of the same partition fenced, of another partition retried)
runs on all four backends in ``test_iceberg_sink.py``; the Spark processor in
``test_iceberg_spark.py``; the Dagster asset and IO manager in ``test_iceberg_dagster.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cg_pipelines.engine import rebuild_partition
from cg_pipelines.engine.options import EngineOptions
from cg_pipelines.engine.runner import run_partition
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.sinks.base import origin_marker
from tests.iceberg.conftest import Backend
from tests.support import devices, keyed

FAST = dict(ack_wait_s=1.5, priority_timeout_s=1.5, hold_wait_s=6.0)
WORKER = Path(__file__).resolve().parent / "worker.py"


async def _setup(js, stream: str, publish, evs, n: int = 1) -> JetStreamAPI:
    return await keyed.elastic_group(js, stream, evs, n, publish)


async def _left(api: JetStreamAPI, stream: str) -> int:
    return int((await api.stream_info(f"{stream}-g"))["state"]["messages"])


def _worker(url: str, stream: str, b: Backend, mode: str, step: str, at: int, sig: str = "KILL",
            batch: int = 40) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(WORKER.parents[2])}
    return subprocess.Popen(
        [sys.executable, str(WORKER), url, stream, "g", "0", b.spec(mode), str(batch),
         str(FAST["ack_wait_s"]), step, str(at), sig],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


async def _paused(proc: subprocess.Popen) -> None:
    for _ in range(1200):
        if Path(f"/proc/{proc.pid}/stat").read_text().split()[2] == "T":
            return
        await asyncio.sleep(0.05)
    raise AssertionError("worker never paused")


@pytest.mark.parametrize(("step", "backend"), [
    ("leased", "sqlite-local"), ("read", "postgres-s3"), ("processed", "sqlite-s3"),
    ("committed", "postgres-local"), ("purged", "sqlite-local"), ("acked", "postgres-local"),
], indirect=["backend"])
async def test_kill_9_at_each_step(nats_server, nc, js, unique_name, step, backend) -> None:
    """SIGKILL the worker at the step of its second batch; a rerun completes with the
    reference result, every message committed once, and an empty work queue."""
    stream = unique_name
    evs = keyed.events(11, 300)
    api = await _setup(js, stream, keyed.publish, evs)
    proc = _worker(nats_server.url, stream, backend, "append", step, at=2)
    out, err = await asyncio.to_thread(proc.communicate, timeout=120)
    assert proc.returncode == -signal.SIGKILL, err
    sink = backend.sink()
    wm = sink.watermark(f"{stream}/g/0")
    assert wm in (0, 40, 80), wm
    if step in ("committed", "purged", "acked"):
        assert wm == 80
    r = await run_partition(nc, stream, "g", 0, keyed.processor(), sink,
                            EngineOptions(batch_max_msgs=40, **FAST))
    assert r.status == "drained", r
    assert keyed.mismatches(sink.read(), evs) is None
    assert sink.watermark(f"{stream}/g/0") == len(evs)
    assert await _left(api, stream) == 0


@pytest.mark.parametrize(("mode", "backend"), [("append", "sqlite-s3"),
                                               ("merge", "postgres-local")],
                         indirect=["backend"])
async def test_paused_zombie_is_fenced(nats_server, nc, js, unique_name, mode, backend) -> None:
    """A holder paused (SIGSTOP) after processing its first batch; another run takes over and
    drains the partition; the resumed zombie's commit is refused (run ends ``fenced``) and
    the table equals the reference."""
    stream = unique_name
    merge = mode == "merge"
    evs = devices.events(400, 25, seed=5) if merge else keyed.events(13, 400)
    api = await _setup(js, stream, devices.publish if merge else keyed.publish, evs)
    # Paused after processing its FIRST batch: at a later batch the previous batch's commit
    # may be in flight (commits run off the critical path), and a process paused inside a
    # catalog commit holds the catalog's lock (SQLite file lock, Postgres row lock) until it
    # resumes — the live run would wait on it (see docs/iceberg.md).
    zombie = _worker(nats_server.url, stream, backend, mode, "processed", at=1, sig="STOP")
    try:
        await _paused(zombie)
        sink = backend.sink(devices.MERGE if merge else None)
        r = await run_partition(nc, stream, "g", 0,
                                devices.processor() if merge else keyed.processor(), sink,
                                EngineOptions(batch_max_msgs=40, **FAST))
        assert r.status == "drained" and r.fence_conflicts == 0, r
    finally:
        os.kill(zombie.pid, signal.SIGCONT)
    out, err = await asyncio.to_thread(zombie.communicate, timeout=120)
    zr = json.loads(out.strip().splitlines()[-1])
    assert zr["status"] == "fenced" and zr["fence_conflicts"] == 1, (zr, err)
    table = sink.read()
    assert (devices.mismatches(table, evs) if merge else keyed.mismatches(table, evs)) is None
    assert sink.watermark(f"{stream}/g/0") == len(evs)
    assert await _left(api, stream) == 0


@pytest.mark.parametrize("backend", ["postgres-s3"], indirect=True)
async def test_two_runs_started_at_once(nc, js, unique_name, backend) -> None:
    """Two runs of the same partition started together (separate sinks, as two processes
    would have): together they commit every message exactly once."""
    stream = unique_name
    evs = keyed.events(9, 300)
    api = await _setup(js, stream, keyed.publish, evs)
    a, b = backend.sink(), backend.sink()
    opts = EngineOptions(batch_max_msgs=30, **FAST)
    ra, rb = await asyncio.gather(
        run_partition(nc, stream, "g", 0, keyed.processor(), a, opts),
        run_partition(nc, stream, "g", 0, keyed.processor(), b, opts))
    assert {ra.status, rb.status} <= {"drained", "held", "fenced", "empty"}, (ra, rb)
    assert "drained" in (ra.status, rb.status), (ra, rb)
    if await _left(api, stream):  # a run that was held leaves nothing; drain any remainder
        r = await run_partition(nc, stream, "g", 0, keyed.processor(), a, opts)
        assert r.status == "drained", r
    assert keyed.mismatches(a.read(), evs) is None
    assert await _left(api, stream) == 0


@pytest.mark.parametrize("backend", ["sqlite-local", "postgres-s3"], indirect=True)
async def test_rebuild_replaces_the_partition(nc, js, unique_name, backend) -> None:
    """Drain 2 partitions; corrupt partition 0's rows behind the engine's back; a rebuild of
    partition 0 restores the reference from the origin stream, keeps its watermark and the
    origin marker, and leaves partition 1 untouched."""
    stream = unique_name
    evs = keyed.events(12, 240)
    await _setup(js, stream, keyed.publish, evs, n=2)
    sink = backend.sink()
    opts = EngineOptions(batch_max_msgs=50, **FAST)
    for p in (0, 1):
        assert (await run_partition(nc, stream, "g", p, keyed.processor(), sink, opts)
                ).status == "drained"
    assert keyed.mismatches(sink.read(), evs) is None
    app0 = f"{stream}/g/0"
    wm0, origin0 = sink.watermark(app0), sink.watermark(origin_marker(app0))
    other = sink.read(row_filter="_partition == 1").sort_by("seq")
    tbl = sink.load()
    assert tbl is not None
    with tbl.transaction() as txn:  # lose half of partition 0's rows (a bad deploy, say)
        txn.delete("_partition == 0 and count > 3")
    assert keyed.mismatches(sink.read(), evs) is not None
    r = await rebuild_partition(nc, stream, "g", 0, keyed.processor(), sink, opts)
    assert r.status == "rebuilt", r
    assert keyed.mismatches(sink.read(), evs) is None
    assert sink.watermark(app0) == wm0 and sink.watermark(origin_marker(app0)) == origin0
    assert sink.read(row_filter="_partition == 1").sort_by("seq").equals(other)
    assert sink.history()[-1]["cg.operation"] == "replace_partition"


@pytest.mark.parametrize("backend", ["sqlite-local", "postgres-local"], indirect=True)
async def test_merge_deletes_and_reinserts(nats_server, nc, js, unique_name, backend) -> None:
    """Merge mode with many deletes and re-inserts of the same devices, in small batches with
    a kill -9 after a commit (before its purge); the rerun skips the committed batch and
    the table equals the reference (each device's current row, deleted ones gone)."""
    stream = unique_name
    evs = devices.events(300, 15, seed=11, p_del=0.3)
    api = await _setup(js, stream, devices.publish, evs)
    proc = _worker(nats_server.url, stream, backend, "merge", "committed", at=3, batch=25)
    _, err = await asyncio.to_thread(proc.communicate, timeout=120)
    assert proc.returncode == -signal.SIGKILL, err
    sink = backend.sink(devices.MERGE)
    assert sink.watermark(f"{stream}/g/0") == 75
    r = await run_partition(nc, stream, "g", 0, devices.processor(), sink,
                            EngineOptions(batch_max_msgs=25, **FAST))
    assert r.status == "drained" and r.duplicates_skipped == 1, r
    assert devices.mismatches(sink.read(), evs) is None
    assert await _left(api, stream) == 0
    ops = [h["operation"] for h in sink.history()]
    assert "delete" in ops or "overwrite" in ops, ops


@pytest.mark.parametrize("backend", ["sqlite-local"], indirect=True)
async def test_range_run_appends_every_partition(nc, js, unique_name, backend) -> None:
    """A run over 3 partitions of one group on an Iceberg table (append): joint commits of
    several partitions, each partition's own watermark, the reference table, an empty work
    queue; Merge mode over several partitions is refused before any I/O."""
    from cg_pipelines.core.write import Merge
    from cg_pipelines.engine.options import EngineConfigError
    from cg_pipelines.engine.runner import run_partitions
    from cg_pipelines.sinks.base import app_id_for

    stream = unique_name
    evs = keyed.events(14, 420)
    api = await _setup(js, stream, keyed.publish, evs, n=3)
    sink = backend.sink()
    r = await run_partitions(nc, stream, "g", range(3), keyed.processor(), sink,
                             EngineOptions(batch_max_msgs=60, **FAST))
    assert r.status == "drained" and r.processed == len(evs) and r.fence_conflicts == 0, r
    for p in range(3):
        app_id = app_id_for(stream, "g", p)
        side = r.inputs[app_id]
        assert side.status == "drained" and sink.watermark(app_id) == side.last_seq, app_id
    assert keyed.mismatches(sink.read(), evs) is None
    assert await _left(api, stream) == 0
    with pytest.raises(EngineConfigError, match="Merge mode refuses"):
        await run_partitions(nc, stream, "g", range(3), keyed.processor(),
                             backend.sink(Merge("key", order_by="seq")))
