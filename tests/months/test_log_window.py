"""The Delta log window bounded by its readers, not by days (issue 40,
``cg_pipelines.sinks.logwindow``): a table aged past its floor while its reconcile check keeps
reading holds at most the stated number of log entries; a lagging cursor holds the log (up to
the cap), no cursor holds it up to the cap, a cursor the cap overtook fails clearly; and the
reconcile check stays exact across the cleanups (real runs, real check, local and moto S3)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.core.coverage import ReconcileCursor, encode_seqs
from cg_pipelines.engine.coverage_log import CoverageLogError, DeltaLogCoverage
from cg_pipelines.engine.options import EngineOptions
from cg_pipelines.engine.runner import run_partition
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.reconcile import reconcile_group
from cg_pipelines.sinks.delta import DeltaSink, Maintenance
from cg_pipelines.sinks.logwindow import LogListing, keep_from
from cg_pipelines.sinks.storage import table_filesystem
from tests.support import keyed

SCHEMA = pa.schema([("k", pa.string()), ("v", pa.int64()), ("_partition", pa.int32())])
CAP, EVERY, CHECKPOINT = 40, 10, 10
BOUND = CAP + EVERY + CHECKPOINT
"""Commit files ``_delta_log`` may hold: the cap, the versions between two cleanups, and the
versions back to the newest checkpoint at or before the oldest one kept."""
FLOOR_S = 0.5
POLICY = Maintenance(vacuum_retention_hours=None, log_floor_s=FLOOR_S, log_max_versions=CAP,
                     log_cleanup_versions=EVERY)


def commit_files(fs: pafs.FileSystem) -> list[int]:
    names = [i.base_name for i in fs.get_file_info(pafs.FileSelector("_delta_log"))]
    return sorted(int(n[:20]) for n in names if n.endswith(".json") and n[:20].isdigit())


def commit(sink: DeltaSink, seq: int) -> None:
    sink.commit(pa.table([[f"k{seq}"], [seq], [0]], schema=SCHEMA), {"S/g/0": (seq - 1, seq)},
                lineage={"stream": "S", "group": "g", "partition": 0, "last_seq": seq,
                         "coverage": encode_seqs([seq])})


def check(log: DeltaLogCoverage, seen: list[int]) -> ReconcileCursor:
    """What a reconcile check does with the log: read from the stored cursor to the head,
    store the cursor."""
    cursor = log.load_cursor() or ReconcileCursor()
    while True:
        commits, last, done = log.read(cursor.version, 25)
        seen.extend(int(s) for c in commits if c.seqs is not None for s in c.seqs)
        cursor.version = last
        if done:
            break
    assert log.save_cursor(cursor)
    return cursor


def test_keep_from_rules() -> None:
    now = 10_000.0
    # versions 0..99, one a second, the newest now
    listing = LogListing({v: now - (99 - v) for v in range(100)}, [0, 50, 90], [])
    rule = {"floor_s": 10.0, "max_versions": 30, "time_travel_s": None, "now": now}
    assert keep_from(listing, [95], **rule) == 89  # the floor: the last 10 s
    assert keep_from(listing, [80], **rule) == 81  # a lagging cursor holds the log
    assert keep_from(listing, [10], **rule) == 70  # ... up to the cap
    assert keep_from(listing, [], **rule) == 70  # no cursor: held up to the cap
    assert keep_from(listing, [], **{**rule, "max_versions": None}) == 89
    assert keep_from(listing, [95], **{**rule, "time_travel_s": 60.0}) == 39  # uncapped
    assert keep_from(listing, [95], **{**rule, "floor_s": 60.0}) == 70  # the cap wins


def test_aged_past_its_floor_the_log_stays_bounded_while_reconcile_reads(
        where: tuple[str, dict[str, str]]) -> None:
    uri, options = where
    sink = DeltaSink(uri, storage_options=options or None, schema=SCHEMA, maintenance=POLICY)
    sink.ensure_table(SCHEMA)
    fs = table_filesystem(uri, options)
    assert fs is not None
    log = DeltaLogCoverage(fs, "S", "g")
    seen: list[int] = []
    n, most = 0, 0
    t0 = time.monotonic()
    while n < 6 * BOUND or time.monotonic() - t0 < 3 * FLOOR_S:
        n += 1
        commit(sink, n)
        out = sink.maintain(0, "S/g/0")
        assert "error" not in out, out
        if n % 15 == 0:
            check(log, seen)
        most = max(most, len(commit_files(fs)))
    check(log, seen)
    assert seen == list(range(1, n + 1))  # every commit's coverage, read once, in order
    assert most <= BOUND, (most, BOUND)
    assert min(commit_files(fs)) > 0  # cleaned: the table is past its floor
    assert DeltaSink(uri, storage_options=options or None).watermark("S/g/0") == n

    # a lagging cursor holds the log: nothing it has not read is deleted
    lag_from = log.load_cursor().version  # type: ignore[union-attr]
    time.sleep(FLOOR_S + 0.1)  # the commits so far get older than the floor
    for _ in range(CAP // 2):
        n += 1
        commit(sink, n)
        sink.maintain(0, "S/g/0")
    assert min(commit_files(fs)) <= lag_from + 1
    check(log, seen)
    assert seen == list(range(1, n + 1))

    # a cursor the cap overtook fails clearly (restart it), the log stays bounded
    for _ in range(2 * BOUND):
        n += 1
        commit(sink, n)
        sink.maintain(0, "S/g/0")
        assert len(commit_files(fs)) <= BOUND
    with pytest.raises(CoverageLogError, match="restart"):
        check(log, seen)

    # no cursor: the log is held up to the cap, not down to the floor
    log.delete_cursor()
    time.sleep(FLOOR_S + 0.1)  # the commits so far get older than the floor
    for _ in range(2 * EVERY):
        n += 1
        commit(sink, n)
        sink.maintain(0, "S/g/0")
    held = commit_files(fs)
    assert CAP <= len(held) <= BOUND, held


FAST = EngineOptions(batch_max_msgs=20, ack_wait_s=1.5, priority_timeout_s=1.5,
                     hold_wait_s=3.0)


@pytest.mark.parametrize("store", ["local", "s3"])
async def test_reconcile_exact_across_the_cleanup(
        store: str, nc: Client, js: JetStreamContext, unique_name: str,
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if store == "s3":
        moto = request.getfixturevalue("moto_s3")
        uri, options = f"s3://{moto.bucket}/{unique_name}", dict(moto.options)
    else:
        uri, options = str(tmp_path / "t"), {}
    s, parts = unique_name, 2
    await js.add_stream(StreamConfig(name=s, subjects=[f"{s}.>"], allow_direct=True))
    await admin.create_elastic(js, s, "g", ElasticConfig(
        parts, (PartitioningFilter(f"{s}.*", (1,)),), members=("m1",)))
    api = JetStreamAPI.from_js(js)
    policy = Maintenance(vacuum_retention_hours=None, log_floor_s=0.0, log_max_versions=12,
                         log_cleanup_versions=4, compact_min_files=4)
    sink = DeltaSink(uri, storage_options=options or None, maintenance=policy)
    fs = table_filesystem(uri, options)
    assert fs is not None
    log = DeltaLogCoverage(fs, s, "g")
    cursor = ReconcileCursor()
    evs: list[tuple[str, int]] = []
    try:
        for rnd in range(6):
            more = keyed.events(n_keys=8, n_events=60)
            await keyed.publish(js, s, more)
            evs += more
            for _ in range(200):
                if (await api.stream_info(f"{s}-g"))["state"]["messages"] >= len(more):
                    break
                await asyncio.sleep(0.05)
            for p in range(parts):  # batches of 20: ~3 commits, then maintain, per run
                r = await run_partition(nc, s, "g", p, keyed.processor(), sink, FAST)
                assert r.status == "drained", r
            if rnd % 2:  # the check every other round: the log it reads is being cleaned
                rep = await reconcile_group(js, api, s, "g", coverage=log, cursor=cursor)
                assert rep.ok and not rep.gaps, rep.text()
                assert log.save_cursor(cursor)
        assert min(commit_files(fs)) > 0  # the log was cleaned meanwhile
        rep = await reconcile_group(js, api, s, "g", coverage=log, cursor=cursor)
        assert rep.ok and not rep.gaps and rep.stall is None, rep.text()
        assert cursor.origin_through == len(evs)
        assert keyed.mismatches(sink.read(), evs) is None
    finally:
        await api.close()
