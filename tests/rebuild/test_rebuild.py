"""Rebuilding a partition from the origin stream's history (issue 12): atomic, fenced, only the
partition's files touched, live draining exact before, during and after."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable

from cg_pipelines.core.config import StaticConfig
from cg_pipelines.engine import EngineOptions, RebuildError, rebuild_partition
from cg_pipelines.jetstream import admin
from cg_pipelines.sinks.base import origin_marker
from flights.legs import legs_arrow_processor, legs_arrow_transform
from tests.rebuild.conftest import FAST, GROUP, Legs

ROOT = Path(__file__).resolve().parents[2]
OPTS = dict(batch_max_msgs=300, read_chunk=500, **FAST)


async def _rebuild(legs: Legs, p: int, processor=None, **kw):
    return await rebuild_partition(legs.nc, legs.stream, GROUP, p,
                                   processor or legs_arrow_processor(), legs.sink,
                                   EngineOptions(**OPTS), **kw)


async def test_rebuild_repairs_one_partition_and_touches_no_other(
        legs: Legs, flights: pd.DataFrame) -> None:
    await legs.publish(flights.head(3000))
    await legs.drain_all()
    assert legs.mismatches()[0] == 0
    app_id = f"{legs.stream}/{GROUP}/2"
    watermark = legs.sink.watermark(app_id)
    origin = legs.sink.watermark(origin_marker(app_id))
    assert watermark > 0 and origin > 0
    before = legs.files_by_partition()
    # corrupt partition 2: wrong values in some rows, others deleted
    dt = DeltaTable(legs.sink.uri)
    dt.update({"cum_distance": "0"}, predicate="_partition = 2 AND leg_number % 2 = 0")
    dt.delete("_partition = 2 AND leg_number > 20")
    bad, _ = legs.mismatches()
    assert bad > 0
    rows_corrupt = DeltaTable(legs.sink.uri).to_pyarrow_dataset().count_rows(
        filter=pc.field("_partition") == 2)
    others = {p: f for p, f in legs.files_by_partition().items() if p != 2}

    r = await _rebuild(legs, 2)
    assert r.status == "rebuilt", r
    mine = sum(1 for t in legs.published["tailnum"] if legs.partition_of(t) == 2)
    assert (r.processed, r.rows_written, r.rows_replaced) == (mine, mine, rows_corrupt)
    assert r.messages_read == 3000 and (r.origin_first_seq, r.origin_last_seq) == (1, origin)
    assert legs.mismatches() == (0, "ok")
    # only partition 2's files changed; the watermark and origin marker stayed
    after = legs.files_by_partition()
    assert {p: f for p, f in after.items() if p != 2} == others == {
        p: f for p, f in before.items() if p != 2}
    assert after[2] != before[2]
    assert legs.sink.watermark(app_id) == watermark
    assert legs.sink.watermark(origin_marker(app_id)) == origin
    # live draining continues from the watermark: no gap, no duplicate
    await legs.publish(flights.iloc[3000:4000])
    await legs.drain_all()
    assert legs.mismatches() == (0, "ok")
    assert await legs.wq_messages() == 0


async def test_rebuild_while_other_partitions_drain_live(legs: Legs,
                                                         flights: pd.DataFrame) -> None:
    await legs.publish(flights.head(2000))
    await legs.drain_all()
    DeltaTable(legs.sink.uri).delete("_partition = 1")

    async def live() -> None:
        for start in range(2000, 4000, 500):
            await legs.publish(flights.iloc[start:start + 500])
            for p in (0, 2, 3):
                r = await legs.drain(p)
                assert r.status in ("drained", "empty"), r

    slow = legs_arrow_processor()
    inner = slow.transform

    def slow_transform(table, ctx):
        time.sleep(0.2)
        return inner(table, ctx)

    slow.transform = slow_transform
    rebuilt, _ = await asyncio.gather(_rebuild(legs, 1, slow), live())
    assert rebuilt.status == "rebuilt" and rebuilt.commits == 1, rebuilt  # one Delta version
    await legs.drain_all()  # partition 1's new messages, after its rebuild
    assert legs.mismatches() == (0, "ok")
    assert await legs.wq_messages() == 0


async def test_a_drain_during_the_rebuild_is_held_and_drains_after(
        legs: Legs, flights: pd.DataFrame) -> None:
    await legs.publish(flights.head(2000))
    await legs.drain_all()
    processing = asyncio.Event()
    release = asyncio.Event()
    loop = asyncio.get_running_loop()
    slow = legs_arrow_processor()
    inner = slow.transform

    def waiting_transform(table, ctx):
        loop.call_soon_threadsafe(processing.set)
        asyncio.run_coroutine_threadsafe(release.wait(), loop).result(30)
        return inner(table, ctx)

    slow.transform = waiting_transform
    rebuild = asyncio.create_task(_rebuild(legs, 3, slow))
    await processing.wait()
    # new flights of partition 3 arrive while it is being rebuilt; a drain is started
    extra = flights.iloc[2000:3000]
    extra = extra[[legs.partition_of(t) == 3 for t in extra["tailnum"]]]
    await legs.publish(extra)
    held = await legs.drain(3, hold_wait_s=1.0)
    assert held.status == "held" and held.processed == 0, held
    release.set()
    r = await rebuild
    assert r.status == "rebuilt", r
    after = await legs.drain(3)
    assert after.status == "drained" and after.processed == len(extra), after
    assert legs.mismatches() == (0, "ok")


async def test_kill_mid_rebuild_keeps_the_old_rows_and_a_rerun_succeeds(
        legs: Legs, flights: pd.DataFrame, nats_server) -> None:
    await legs.publish(flights.head(3000))
    await legs.drain_all()
    DeltaTable(legs.sink.uri).update({"leg_number": "0"}, predicate="_partition = 0")
    version = DeltaTable(legs.sink.uri).version()
    rows = legs.sink.read().sort_by([("_seq", "ascending")])
    proc = await asyncio.to_thread(
        subprocess.run, [sys.executable, str(ROOT / "tests/rebuild/worker.py"), nats_server.url,
                         legs.stream, "0", legs.sink.uri, "2"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert DeltaTable(legs.sink.uri).version() == version  # nothing committed
    assert legs.sink.read().sort_by([("_seq", "ascending")]).equals(rows)  # old rows intact
    r = await _rebuild(legs, 0)
    assert r.status == "rebuilt", r
    assert legs.mismatches() == (0, "ok")
    await legs.drain_all()  # the lease the killed run held came back
    assert await legs.wq_messages() == 0


async def test_transform_raising_mid_rebuild_keeps_the_old_rows(
        legs: Legs, flights: pd.DataFrame) -> None:
    await legs.publish(flights.head(2000))
    await legs.drain_all()
    version = DeltaTable(legs.sink.uri).version()
    calls = {"n": 0}

    def failing(table, ctx):
        calls["n"] += 1
        if calls["n"] == 2:
            raise ValueError("bug in the new transform")
        return legs_arrow_transform(table, ctx)

    proc = legs_arrow_processor()
    proc.transform = failing
    with pytest.raises(ValueError, match="bug in the new transform"):
        await _rebuild(legs, 1, proc)
    assert DeltaTable(legs.sink.uri).version() == version
    assert legs.mismatches() == (0, "ok")
    # the partition is free again
    await legs.publish(flights.iloc[2000:2500])
    await legs.drain_all()
    assert legs.mismatches() == (0, "ok")


async def test_trimmed_history_is_refused_unless_partial_is_accepted(
        legs: Legs, flights: pd.DataFrame) -> None:
    await legs.publish(flights.head(1500))
    await legs.drain_all()
    await legs.js.purge_stream(legs.stream, seq=200)  # retention took the first 199
    version = DeltaTable(legs.sink.uri).version()
    with pytest.raises(RebuildError, match="first retained sequence is 200"):
        await _rebuild(legs, 0)
    assert DeltaTable(legs.sink.uri).version() == version
    r = await _rebuild(legs, 0, allow_partial=True)
    assert r.status == "rebuilt" and r.origin_first_seq == 200 and r.messages_read == 1301, r


async def test_nothing_committed_is_nothing_to_rebuild(legs: Legs,
                                                       flights: pd.DataFrame) -> None:
    await legs.publish(flights.head(100))
    await legs.drain(0)  # partition 1 never drained: no watermark
    r = await _rebuild(legs, 1)
    assert r.status == "empty" and "nothing committed" in r.detail, r
    assert r.rows_written == 0


async def test_static_group_is_refused_with_the_reason(nc, js, unique_name, tmp_path) -> None:
    from nats.js.api import StreamConfig

    from cg_pipelines.sinks.delta import DeltaSink

    await js.add_stream(StreamConfig(name=unique_name,
                                     subjects=[f"0.{unique_name}.>", f"1.{unique_name}.>"]))
    await admin.create_static(js, unique_name, "st", StaticConfig(2, members=("m1",)))
    with pytest.raises(RebuildError, match="static group"):
        await rebuild_partition(nc, unique_name, "st", 0, legs_arrow_processor(),
                                DeltaSink(str(tmp_path / "t")), EngineOptions(**OPTS))
