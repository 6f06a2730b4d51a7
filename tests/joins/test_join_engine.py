"""Co-partitioned runs (issue 39) on a real nats-server and real Delta / Iceberg tables: one run
drains partition p of several groups and commits the join output and every input's watermark
once. Every result is compared with an independent pandas join (tests/support/joined.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from cg_pipelines.core.errors import UsageError
from cg_pipelines.engine.join import JoinInput, run_copartitioned
from cg_pipelines.engine.options import EngineOptions
from cg_pipelines.sinks.base import FenceConflictError, app_id_for
from cg_pipelines.sinks.delta import DeltaSink
from cg_pipelines.sinks.iceberg import IcebergSink
from cg_pipelines.sinks.iceberg_read import sqlite_wal
from tests.support import joined

FAST = dict(ack_wait_s=1.5, priority_timeout_s=1.5, hold_wait_s=6.0)
ROOT = Path(__file__).resolve().parents[2]
THREE = (joined.IMP, joined.CLK, joined.CONV)


def _delta(tmp_path: Path) -> DeltaSink:
    return DeltaSink(str(tmp_path / "t"), write=joined.WRITE)


def _iceberg(tmp_path: Path) -> IcebergSink:
    """A local Iceberg table (pyiceberg's SQL catalog on SQLite, data on disk)."""
    (tmp_path / "wh").mkdir(exist_ok=True)
    sqlite_wal(str(tmp_path / "catalog.db"))
    return IcebergSink("cg.joined", catalog={
        "type": "sql", "init_catalog_tables": "true",
        "uri": f"sqlite:///{tmp_path / 'catalog.db'}", "warehouse": f"file://{tmp_path / 'wh'}"},
        write=joined.WRITE)


async def _drain(nc, stream: str, n: int, sink, names=(joined.IMP, joined.CLK),
                 batch: int = 37):
    return [await run_copartitioned(nc, joined.inputs(stream, names), p,
                                    joined.processor(names), sink,
                                    EngineOptions(batch_max_msgs=batch, **FAST))
            for p in range(n)]


@pytest.mark.parametrize("fmt", ["delta", "iceberg"])
async def test_two_inputs_join_exactly_once(nc, js, unique_name, tmp_path, fmt) -> None:
    evs = joined.events(300)
    api = await joined.setup(js, unique_name, evs, n_partitions=3)
    sink = _delta(tmp_path) if fmt == "delta" else _iceberg(tmp_path)
    results = await _drain(nc, unique_name, 3, sink)
    assert [r.status for r in results] == ["drained"] * 3, [r.detail for r in results]
    assert sum(r.processed for r in results) == sum(len(v) for v in evs.values())
    assert all(r.commits > 1 for r in results)  # batches of 37 split every partition
    assert joined.mismatches(sink.read(), evs) is None
    assert await joined.left(api, unique_name) == 0
    # every input's watermark moved with the joint commits
    for r in results:
        for name, res in r.inputs.items():
            wm = sink.watermark(app_id_for(f"{unique_name}_{name}", "g", r.partition))
            assert wm == res.watermark > 0
    # a second run finds nothing
    again = await _drain(nc, unique_name, 3, sink)
    assert [r.status for r in again] == ["empty"] * 3


async def test_three_inputs_and_new_messages_later(nc, js, unique_name, tmp_path) -> None:
    evs = joined.events(200, THREE)
    api = await joined.setup(js, unique_name, evs, n_partitions=2)
    sink = _delta(tmp_path)
    await _drain(nc, unique_name, 2, sink, THREE)
    assert joined.mismatches(sink.read(), evs) is None
    # more clicks and conversions only (no impression input messages): state carries the join
    more = {joined.IMP: [], joined.CLK: [{"auction": "a5"}] * 3,
            joined.CONV: [{"auction": "a5", "value": 4}, {"auction": "a900", "value": 2}]}
    for name, msgs in more.items():
        s = f"{unique_name}_{name}"
        for m in msgs:
            await js.publish(f"{s}.{m['auction']}", json.dumps(m).encode())
    for name, msgs in more.items():  # queued in each input's (drained) work queue
        await joined.wait_sourced(api, f"{unique_name}_{name}-g", len(msgs))
    results = await _drain(nc, unique_name, 2, sink, THREE)
    assert sum(r.processed for r in results) == 5
    total = {n: evs[n] + more[n] for n in THREE}
    assert joined.mismatches(sink.read(), total) is None
    assert await joined.left(api, unique_name, THREE) == 0


async def test_stale_joint_commit_is_fenced_on_any_input(tmp_path) -> None:
    """The sink's side of the fence, both formats: a commit based on a watermark another holder
    moved, on any one input (even one this commit does not move), writes nothing."""
    rows = pa.table({"auction": ["x"], "ad": ["a"], "clicks": [1], "value": [0],
                     "updates": [1], "_partition": [0]})
    for sink in (_delta(tmp_path), _iceberg(tmp_path)):
        a, b = "s_a/g/0", "s_b/g/0"
        assert sink.watermark(a) == 0 and sink.watermark(b) == 0
        sink.commit(rows, {a: (0, 5), b: (0, 3)})
        assert (sink.watermark(a), sink.watermark(b)) == (5, 3)
        other = DeltaSink(sink.uri, write=joined.WRITE) if isinstance(sink, DeltaSink) else \
            _iceberg(tmp_path)
        other.watermark(a)
        other.commit(None, {a: (5, 5), b: (3, 4)})  # a zombie moved only b
        before = sink.read().num_rows
        with pytest.raises(FenceConflictError) as e:
            sink.commit(rows, {a: (5, 9), b: (3, 3)})  # based on b == 3
        assert e.value.app_id == b and e.value.expected == 3 and e.value.found == 4
        assert sink.read().num_rows == before
        assert (sink.watermark(a), sink.watermark(b)) == (5, 4)
        with pytest.raises(UsageError, match="no watermark moves"):
            sink.commit(rows, {a: (5, 5), b: (4, 4)})


async def test_two_runs_at_once_never_double_count(nc, js, unique_name, tmp_path) -> None:
    evs = joined.events(400)
    api = await joined.setup(js, unique_name, evs, n_partitions=1)
    sink = _delta(tmp_path)
    runs = [run_copartitioned(nc, joined.inputs(unique_name), 0, joined.processor(),
                              DeltaSink(sink.uri, write=joined.WRITE),
                              EngineOptions(batch_max_msgs=29, **FAST)) for _ in range(2)]
    results = await asyncio.gather(*runs)
    statuses = sorted(r.status for r in results)
    # the second one waits for the leases (held), loses the fence, or comes after the first
    assert statuses in (["drained", "held"], ["drained", "fenced"], ["drained", "drained"],
                        ["drained", "empty"]), [(r.status, r.detail) for r in results]
    if await joined.left(api, unique_name):  # a fenced run's lease returns after the ack wait
        await _drain(nc, unique_name, 1, sink)
    assert joined.mismatches(sink.read(), evs) is None
    assert await joined.left(api, unique_name) == 0


async def test_mismatched_inputs_are_refused(nc, tmp_path) -> None:
    sink = _delta(tmp_path)
    with pytest.raises(UsageError, match="not the processor's"):
        await run_copartitioned(nc, [JoinInput("impressions", "s1", "g"),
                                     JoinInput("views", "s2", "g")], 0, joined.processor(),
                                sink)
    with pytest.raises(UsageError, match="its own group"):
        await run_copartitioned(nc, [JoinInput("impressions", "s1", "g"),
                                     JoinInput("clicks", "s1", "g")], 0, joined.processor(),
                                sink)


def _worker(url: str, stream: str, uri: str, step: str, at: int, sig: str = "KILL",
            input_name: str = "-") -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "tests/support/join_worker.py"), url, stream, uri, "23",
         str(FAST["ack_wait_s"]), step, str(at), sig, input_name],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


async def test_halt_stops_at_a_bad_message_of_one_input(nc, js, unique_name, tmp_path
                                                         ) -> None:
    """The ``halt`` policy on a co-partitioned run: a bad click stops the run at it, what
    precedes it (of both inputs) committed, the bad message left first in the clicks work
    queue; once an operator removes it, a rerun drains the rest to the pandas join."""
    evs = joined.events(90)
    api = await joined.setup(js, unique_name, evs, n_partitions=1)
    s = f"{unique_name}_{joined.CLK}"
    await js.publish(f"{s}.a5", b'{"not": "a click"}')
    wq, bad = f"{s}-g", len(evs[joined.CLK]) + 1
    await joined.wait_sourced(api, wq, bad)
    sink = _delta(tmp_path)
    opts = EngineOptions(batch_max_msgs=37, dead_letter_policy="halt", **FAST)
    r = await run_copartitioned(nc, joined.inputs(unique_name), 0, joined.processor(), sink,
                                opts)
    assert r.status == "halted" and r.halted_at == bad, (r.status, r.detail)
    assert r.inputs[joined.CLK].halted_at == bad and r.inputs[joined.IMP].halted_at is None
    assert sink.watermark(app_id_for(s, "g", 0)) == bad - 1
    assert r.dead_lettered == 0
    (first,) = await api.direct_get_batch(wq, 1, ">", 1)
    assert first.seq == bad
    await js.delete_msg(wq, bad)  # the operator removes it (it is still in the origin)
    r = await run_copartitioned(nc, joined.inputs(unique_name), 0, joined.processor(), sink,
                                opts)
    assert r.status in ("drained", "empty"), r.detail  # empty: all else committed before
    assert joined.mismatches(sink.read(), evs) is None
    assert await joined.left(api, unique_name) == 0


@pytest.mark.parametrize("step", ["leased", "read", "processed", "committed", "purged",
                                  "acked"])
async def test_kill_at_each_step(nats_server, nc, js, unique_name, tmp_path, step) -> None:
    """SIGKILL a two-input run at each step of its second batch (per-input steps at the
    clicks input); the rerun ends with the pandas join and empty work queues."""
    evs = joined.events(120)
    api = await joined.setup(js, unique_name, evs, n_partitions=1)
    uri = str(tmp_path / "t")
    per_input = step in ("leased", "read", "purged", "acked")
    at = 2 if step != "leased" else 1
    proc = _worker(nats_server.url, unique_name, uri, step, at,
                   input_name=joined.CLK if per_input else "-")
    out, err = await asyncio.to_thread(proc.communicate, timeout=90)
    assert proc.returncode == -signal.SIGKILL, (out, err)
    sink = _delta(tmp_path)
    r = (await _drain(nc, unique_name, 1, sink, batch=23))[0]
    assert r.status == "drained", r.detail
    assert joined.mismatches(sink.read(), evs) is None
    assert await joined.left(api, unique_name) == 0
    if step in ("committed", "purged"):
        assert sum(x.duplicates_skipped for x in r.inputs.values()) >= 1


@pytest.mark.parametrize("held", [joined.IMP, joined.CLK])
async def test_zombie_on_either_lease_is_fenced(nats_server, nc, js, unique_name, tmp_path,
                                                held) -> None:
    """After a joined drain, new messages on ONE input only: a run leases just that input and
    is paused (SIGSTOP) after processing its first batch (no commit of it in flight yet: the
    run's commits are pipelined behind processing), past the pin timeout; a new run takes over
    and drains; the resumed zombie's joint commit is refused (fenced)."""
    evs = joined.events(60)
    api = await joined.setup(js, unique_name, evs, n_partitions=1)
    sink = _delta(tmp_path)
    await _drain(nc, unique_name, 1, sink)
    more = [{"auction": f"a{i % 90}", "ad": "late"} if held == joined.IMP else
            {"auction": f"a{i % 60}"} for i in range(100)]
    s = f"{unique_name}_{held}"
    acks = [await js.publish_async(f"{s}.{m['auction']}", json.dumps(m).encode())
            for m in more]
    await asyncio.gather(*acks)
    await joined.wait_sourced(api, f"{s}-g", len(more))
    zombie = _worker(nats_server.url, unique_name, sink.uri, "processed", 1, sig="STOP")
    state = ""
    for _ in range(600):
        state = Path(f"/proc/{zombie.pid}/stat").read_text().split()[2]
        if state == "T":
            break
        await asyncio.sleep(0.05)
    assert state == "T", "worker never paused"
    try:
        await asyncio.sleep(2 * FAST["ack_wait_s"])  # the paused worker's ack wait expires
        r = (await _drain(nc, unique_name, 1, sink, batch=23))[0]
        assert r.status == "drained", r.detail
    finally:
        os.kill(zombie.pid, signal.SIGCONT)
    out, err = await asyncio.to_thread(zombie.communicate, timeout=90)
    zr = json.loads(out.strip().splitlines()[-1])
    assert zr["status"] == "fenced", (zr, err)
    total = {n: evs[n] + (more if n == held else []) for n in evs}
    assert joined.mismatches(sink.read(), total) is None
    assert await joined.left(api, unique_name) == 0
