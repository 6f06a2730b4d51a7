"""Merge write mode end to end: real nats-server, the ordered engine, real Delta tables (local
and moto S3). The devices pipeline (tests/support/devices.py) keeps each device's current row;
every test compares the table with an independent reference: lost keys 0, duplicate keys 0,
stale values 0, whatever the batch boundaries, crashes, zombies and rebuilds."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from deltalake import DeltaTable
from nats.js.api import StreamConfig

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.core.subjects import partition_for
from cg_pipelines.engine import EngineOptions, rebuild_partition, run_partition
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.sinks.delta import DeltaSink
from tests.support import devices

N = 2
FAST = dict(ack_wait_s=1.5, priority_timeout_s=1.5, hold_wait_s=6.0)
ROOT = Path(__file__).resolve().parents[2]


async def _setup(js, stream: str, evs, n: int = N, allow_direct: bool = False) -> JetStreamAPI:
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"],
                                     allow_direct=allow_direct))
    await admin.create_elastic(js, stream, "g", ElasticConfig(
        n, (PartitioningFilter(f"{stream}.*", (1,)),), members=("m1",)))
    api = JetStreamAPI.from_js(js)
    await _publish(js, api, stream, evs, 0)
    return api


async def _publish(js, api: JetStreamAPI, stream: str, evs, before: int) -> None:
    await devices.publish(js, stream, evs)
    for _ in range(400):
        if int((await api.stream_info(f"{stream}-g"))["state"]["last_seq"]) >= before + len(evs):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the work queue did not receive the events")


async def _drain_all(nc, stream: str, sink: DeltaSink, batch: int, n: int = N) -> int:
    commits = 0
    for p in range(n):
        r = await run_partition(nc, stream, "g", p, devices.processor(), sink,
                                EngineOptions(batch_max_msgs=batch, **FAST))
        assert r.status in ("drained", "empty"), r
        commits += r.commits
    return commits


async def _wq_left(api: JetStreamAPI, stream: str) -> int:
    return int((await api.stream_info(f"{stream}-g"))["state"]["messages"])


async def test_merge_drains_equal_the_reference_across_runs(nc, js, unique_name,
                                                            tmp_path) -> None:
    stream = unique_name
    evs = devices.events(1200, 40, seed=1)
    api = await _setup(js, stream, evs)
    sink = DeltaSink(str(tmp_path / "t"), write=devices.MERGE)
    assert await _drain_all(nc, stream, sink, batch=37) > 20  # keys cross many batches
    assert devices.mismatches(sink.read(), evs) is None
    more = devices.events(600, 40, seed=2)  # a second run on top of the current state
    await _publish(js, api, stream, more, len(evs))
    await _drain_all(nc, stream, sink, batch=53)
    assert devices.mismatches(sink.read(), evs + more) is None
    assert sink.read().num_rows == len(devices.reference(evs + more))
    assert await _wq_left(api, stream) == 0


async def test_merge_on_s3(nc, js, unique_name, moto_s3) -> None:
    stream = unique_name
    evs = devices.events(500, 25, seed=3)
    await _setup(js, stream, evs)
    sink = DeltaSink(f"s3://{moto_s3.bucket}/{stream}", storage_options=moto_s3.options,
                     write=devices.MERGE)
    await _drain_all(nc, stream, sink, batch=60)
    assert devices.mismatches(sink.read(), evs) is None
    # lineage, read from the log's commit files (DeltaTable.history() hangs on moto's listing)
    fs = sink._handle.filesystem()
    assert fs is not None and len(sink.versions_written) >= 2
    for v in sink.versions_written:
        with fs.open_input_stream(f"_delta_log/{v:020d}.json") as f:
            lines = f.read().decode().splitlines()
        info = next(json.loads(ln)["commitInfo"] for ln in lines if '"commitInfo"' in ln)
        assert info["operation"] in ("MERGE", "WRITE")
        assert (info["cg.stream"], info["cg.group"], info["cg.write_mode"]) == (
            stream, "g", "merge")


def _worker(url: str, stream: str, uri: str, step: str, at: int, sig: str = "KILL",
            batch: int = 40) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "tests/support/merge_worker.py"), url, stream, "g", "0",
         uri, str(batch), str(FAST["ack_wait_s"]), step, str(at), sig],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("step", ["read", "processed", "committed", "purged"])
async def test_merge_crash_points(nats_server, nc, js, unique_name, tmp_path, step) -> None:
    """SIGKILL a merge-mode run after read, after processing (before commit), after commit
    (before purge), after purge (before ack); a rerun leaves exactly the reference."""
    stream = unique_name
    evs = devices.events(400, 11, seed=4)
    api = await _setup(js, stream, evs, n=1)
    uri = str(tmp_path / "t")
    proc = _worker(nats_server.url, stream, uri, step, at=2)
    out, err = await asyncio.to_thread(proc.communicate, timeout=60)
    assert proc.returncode == -signal.SIGKILL, err
    sink = DeltaSink(uri, write=devices.MERGE)
    wm = sink.watermark(f"{stream}/g/0")
    if step in ("committed", "purged"):
        assert wm == 80
    r = await run_partition(nc, stream, "g", 0, devices.processor(), sink,
                            EngineOptions(batch_max_msgs=40, **FAST))
    assert r.status == "drained", r
    assert devices.mismatches(sink.read(), evs) is None
    assert await _wq_left(api, stream) == 0
    if step == "committed":
        assert r.duplicates_skipped == 1


async def test_merge_zombie_is_fenced(nats_server, nc, js, unique_name, tmp_path) -> None:
    """A merge-mode holder paused past its pin timeout after processing; a second run drains;
    the resumed zombie's MERGE is refused and changes nothing."""
    stream = unique_name
    evs = devices.events(500, 13, seed=5)
    api = await _setup(js, stream, evs, n=1)
    uri = str(tmp_path / "t")
    zombie = _worker(nats_server.url, stream, uri, "processed", at=2, sig="STOP")
    state = ""
    for _ in range(600):
        state = Path(f"/proc/{zombie.pid}/stat").read_text().split()[2]
        if state == "T":
            break
        await asyncio.sleep(0.05)
    assert state == "T", "worker never paused"
    try:
        sink = DeltaSink(uri, write=devices.MERGE)
        r = await run_partition(nc, stream, "g", 0, devices.processor(), sink,
                                EngineOptions(batch_max_msgs=40, **FAST))
        assert r.status == "drained" and r.fence_conflicts == 0
        version = DeltaTable(uri).version()
    finally:
        os.kill(zombie.pid, signal.SIGCONT)
    out, err = await asyncio.to_thread(zombie.communicate, timeout=60)
    zr = json.loads(out.strip().splitlines()[-1])
    assert zr["status"] == "fenced" and zr["fence_conflicts"] == 1, (zr, err)
    assert DeltaTable(uri).version() == version  # the zombie wrote no version
    assert devices.mismatches(sink.read(), evs) is None
    assert await _wq_left(api, stream) == 0


@pytest.mark.parametrize("allow_direct", [False, True], ids=["replay-consumer", "direct-get"])
async def test_merge_rebuild_equals_a_fresh_drain(nc, js, unique_name, tmp_path,
                                                  allow_direct: bool) -> None:
    stream = unique_name
    evs = devices.events(1500, 50, seed=6)
    await _setup(js, stream, evs, allow_direct=allow_direct)
    sink = DeltaSink(str(tmp_path / "t"), write=devices.MERGE)
    await _drain_all(nc, stream, sink, batch=45)
    drained = devices.table_frame(sink.read())
    assert devices.mismatches(sink.read(), evs) is None
    p = 1
    mine = [e for e in evs if partition_for([e[0]], N) == p]
    # corrupt partition p: wrong values, a deleted device back, a live one gone
    dt = DeltaTable(sink.uri)
    dt.update({"readings": "-5"}, predicate=f"_partition = {p}")
    dt.delete(f"_partition = {p} AND device = '{devices.reference(mine)['device'][0]}'")
    assert devices.mismatches(sink.read(), evs) is not None
    r = await rebuild_partition(nc, stream, "g", p, devices.processor(), sink,
                                EngineOptions(batch_max_msgs=70, read_chunk=200, **FAST))
    assert r.status == "rebuilt", r
    assert r.processed == len(mine)
    assert r.rows_written == len(devices.reference(mine))  # rows left in the table
    assert devices.mismatches(sink.read(), evs) is None
    assert devices.table_frame(sink.read()).equals(drained)
    # a fresh drain of the same history into a new table gives the same table
    fresh = DeltaSink(str(tmp_path / "fresh"), write=devices.MERGE)
    await js.add_stream(StreamConfig(name=f"{stream}F", subjects=[f"{stream}F.>"]))
    await admin.create_elastic(js, f"{stream}F", "g", ElasticConfig(
        N, (PartitioningFilter(f"{stream}F.*", (1,)),), members=("m1",)))
    await _publish(js, JetStreamAPI.from_js(js), f"{stream}F", evs, 0)
    await _drain_all(nc, f"{stream}F", fresh, batch=500)
    assert devices.table_frame(fresh.read()).equals(devices.table_frame(sink.read()))
    h = DeltaTable(sink.uri).history(1)[0]
    assert (h["cg.operation"], h["cg.partition"], h["cg.stream"]) == (
        "replace_partition", str(p), stream)
