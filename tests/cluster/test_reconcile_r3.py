"""Reconcile that never cries wolf, on a 3-node cluster (R3 origin, work queue, bucket): the
coverage the engine records with each commit (not the table's rows) proves every origin
message accounted for.

- Clean groups report no gap: append mode with dead letters, merge mode (rows replaced by key),
  and a transform that filters rows out.
- Work-queue messages deleted at the head, middle and tail of partitions (the tail including
  the origin's very last message) are reported exactly; rebuilding the named partitions makes
  the table equal an independent pandas reference, and the next check (same cursor) is clean.
- A stalled source (the work queue's source removed, then restored) is reported as a stall, not
  a gap, and the report clears once sourcing resumes.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from nats.aio.client import Client
from nats.js import JetStreamContext

from cg_pipelines.core.config import work_queue_stream_name
from cg_pipelines.core.coverage import ReconcileCursor
from cg_pipelines.core.reconcile import ReconcileReport
from cg_pipelines.core.subjects import partition_for
from cg_pipelines.engine.coverage_log import DeltaLogCoverage
from cg_pipelines.engine.options import EngineOptions
from cg_pipelines.engine.processing import ArrowProcessor
from cg_pipelines.engine.processor import BatchContext
from cg_pipelines.engine.rebuild import rebuild_partition
from cg_pipelines.engine.runner import run_partition
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.reconcile import reconcile_group
from cg_pipelines.sinks.delta import DeltaSink
from cg_pipelines.sinks.storage import table_filesystem
from tests.cluster import checks
from tests.support import devices, keyed

P = 3
FAST = EngineOptions(batch_max_msgs=50, ack_wait_s=2.0, priority_timeout_s=2.0,
                     hold_wait_s=3.0, timeout_s=3.0, nats_retry_max_s=30.0)


def _coverage(sink: DeltaSink, stream: str) -> DeltaLogCoverage:
    fs = table_filesystem(sink.uri, {})
    assert fs is not None
    return DeltaLogCoverage(fs, stream, "g")


async def _check(js: JetStreamContext, api: JetStreamAPI, stream: str, sink: DeltaSink,
                 cursor: ReconcileCursor | None = None, **kw: object) -> ReconcileReport:
    """Checks until the cursor reached the origin's end (a few ticks of 200 messages)."""
    cursor = cursor if cursor is not None else ReconcileCursor()
    for _ in range(100):
        rep = await reconcile_group(js, api, stream, "g", coverage=_coverage(sink, stream),
                                    cursor=cursor, max_messages=200, max_versions=7,
                                    **kw)  # type: ignore[arg-type]
        if not rep.partial or rep.stall is not None:
            return rep
    raise AssertionError(f"the check never finished: {rep.text()}")


async def _drain(nc: Client, stream: str, processor: ArrowProcessor, sink: DeltaSink) -> None:
    for p in range(P):
        r = await run_partition(nc, stream, "g", p, processor, sink, FAST)
        assert r.status in ("drained", "empty"), r


def _odd_only(table: pa.Table, ctx: BatchContext) -> pa.Table:
    """The keyed transform, keeping only rows with an odd ``n`` (filters about half out)."""
    out = keyed.transform(table, ctx)
    return out.filter(pc.equal(pc.bit_wise_and(out["n"], 1), 1))


async def test_clean_groups_report_no_gap(cnc: Client, cjs: JetStreamContext,
                                          tmp_path: Path, report: list[str]) -> None:
    api = JetStreamAPI(cnc, timeout=5)
    # append mode with dead letters
    s = "RecAppend"
    await checks.create_r3_group(cjs, s, P)
    evs = keyed.events(n_keys=20, n_events=600)
    await keyed.publish(cjs, s, evs)
    for body in (b"{not json", b'{"key": "kbad", "n": "x"}'):
        await cjs.publish(f"{s}.kbad", body)
    await cjs.publish(f"{s}.not.partitioned", b"x")  # no filter matches: never expected
    await checks.wait_sourced(api, s, len(evs) + 2)
    sink = DeltaSink(str(tmp_path / "append"), schema=keyed.OUT_SCHEMA)
    await _drain(cnc, s, keyed.processor(), sink)
    assert keyed.mismatches(sink.read(), evs) is None
    rep = await _check(cjs, api, s, sink)
    assert rep.ok and rep.stall is None, rep.text()
    assert rep.caught_up and not rep.gaps
    # merge mode: a table of each key's current row (its _seq proves nothing)
    s = "RecMerge"
    await checks.create_r3_group(cjs, s, P)
    devs = devices.events(600, 15, seed=3)
    await devices.publish(cjs, s, devs)
    await checks.wait_sourced(api, s, len(devs))
    msink = DeltaSink(str(tmp_path / "merge"), write=devices.MERGE)
    await _drain(cnc, s, devices.processor(), msink)
    assert devices.mismatches(msink.read(), devs) is None
    assert msink.read().num_rows < 100  # far fewer rows than messages
    rep = await _check(cjs, api, s, msink)
    assert rep.ok and rep.stall is None and not rep.gaps, rep.text()
    # a transform that filters rows out
    s = "RecFilter"
    await checks.create_r3_group(cjs, s, P)
    await keyed.publish(cjs, s, evs)
    await checks.wait_sourced(api, s, len(evs))
    fsink = DeltaSink(str(tmp_path / "filter"), schema=keyed.OUT_SCHEMA)
    await _drain(cnc, s, ArrowProcessor(keyed.DECODER, _odd_only, state=keyed.STATE), fsink)
    assert 0 < fsink.read().num_rows < len(evs) * 0.7
    rep = await _check(cjs, api, s, fsink)
    assert rep.ok and rep.stall is None and not rep.gaps, rep.text()
    report.append("reconcile r3: clean append+dlq / merge / filtering groups: no gap, no "
                  "stall")


async def test_head_middle_tail_gaps_reported_exactly_and_repaired(
        cnc: Client, cjs: JetStreamContext, tmp_path: Path, report: list[str]) -> None:
    api = JetStreamAPI(cnc, timeout=5)
    s = "RecGaps"
    wq = work_queue_stream_name(s, "g")
    await checks.create_r3_group(cjs, s, P)
    evs = keyed.events(n_keys=24, n_events=900)
    await keyed.publish(cjs, s, evs)
    await checks.wait_sourced(api, s, len(evs))
    # origin sequence i+1 is evs[i]; the work queue received them in the same order
    part_of = np.array([partition_for([k], P) for k, _ in evs])
    deleted: list[int] = []
    last_part = int(part_of[-1])
    for p in sorted({0, last_part}):
        mine = (np.flatnonzero(part_of == p) + 1).tolist()
        mid = len(mine) // 2
        deleted += mine[:3] + mine[mid:mid + 4] + mine[-3:]  # head, middle, tail
    assert len(evs) in deleted  # the origin's very last message is in a tail gap
    for seq in sorted(deleted):
        assert await api.delete_msg(wq, seq)
    sink = DeltaSink(str(tmp_path / "t"), schema=keyed.OUT_SCHEMA)
    await _drain(cnc, s, keyed.processor(), sink)
    assert keyed.mismatches(sink.read(), evs) is not None
    await asyncio.sleep(1.2)  # past the grace of the tail's last messages

    cursor = ReconcileCursor()
    rep = await _check(cjs, api, s, sink, cursor, grace_s=1.0)
    assert not rep.ok and rep.stall is None, rep.text()
    assert cursor.gap_seqs.tolist() == sorted(deleted), rep.text()
    assert rep.missing == len(deleted)
    assert rep.partitions == sorted({0, last_part})
    assert rep.gaps[0].first_seq == min(deleted) and rep.gaps[-1].last_seq == max(deleted)
    line = rep.text()
    assert f"{len(deleted)} origin message(s) never reached {wq}" in line
    # the cursor, stored and loaded, keeps the open gaps
    cov = _coverage(sink, s)
    cov.save_cursor(cursor)
    stored = cov.load_cursor()
    assert stored is not None and stored.gap_seqs.tolist() == sorted(deleted)

    for p in rep.partitions:
        r = await rebuild_partition(cnc, s, "g", p, keyed.processor(), sink, FAST)
        assert r.status == "rebuilt", r
        assert r.origin_last_seq == len(evs), r  # replayed through the origin's last message
    assert keyed.mismatches(sink.read(), evs) is None  # equals the pandas reference
    after = await _check(cjs, api, s, sink, stored, grace_s=1.0)
    assert after.ok and after.stall is None and not after.gaps, after.text()
    # the rebuild's version carries the lineage a drain's does, and its coverage
    log = (tmp_path / "t" / "_delta_log")
    last = json.loads([ln for ln in sorted(log.glob("0*.json"))[-1].read_text().splitlines()
                       if '"commitInfo"' in ln][0])["commitInfo"]
    assert {"cg.first_seq", "cg.last_seq", "cg.coverage_through"} <= set(last), last
    report.append(f"reconcile r3: {len(deleted)} deleted (head/middle/tail of partitions "
                  f"{rep.partitions}) reported exactly, rebuilt, clean after")


async def test_stalled_source_is_a_stall_not_a_gap(
        cnc: Client, cjs: JetStreamContext, tmp_path: Path, report: list[str]) -> None:
    api = JetStreamAPI(cnc, timeout=5)
    s = "RecStall"
    wq = work_queue_stream_name(s, "g")
    await checks.create_r3_group(cjs, s, P)
    evs = keyed.events(n_keys=12, n_events=300)
    first, second = evs[:200], evs[200:]
    await keyed.publish(cjs, s, first)
    await checks.wait_sourced(api, s, len(first))
    sink = DeltaSink(str(tmp_path / "t"), schema=keyed.OUT_SCHEMA)
    # one partition drained, the others still queued (the source resumes after the last one)
    r = await run_partition(cnc, s, "g", 0, keyed.processor(), sink, FAST)
    assert r.status == "drained", r
    cursor = ReconcileCursor()
    rep = await _check(cjs, api, s, sink, cursor, grace_s=0.5)
    assert rep.ok and rep.stall is None, rep.text()

    # the stall: the work queue loses its source while the origin goes on
    config = (await api.stream_info(wq))["config"]
    sources = config["sources"]
    await api.update_stream({**config, "sources": []})
    await keyed.publish(cjs, s, second)
    await asyncio.sleep(1.0)  # well past the grace: still not a gap
    rep = await _check(cjs, api, s, sink, cursor, grace_s=0.5)
    assert rep.ok and not rep.gaps, rep.text()
    assert rep.stall is not None and rep.stall.state == "no source", rep.text()
    assert rep.stall.not_yet_sourced == len(second) and rep.stall.first_seq == len(first) + 1
    assert "never reached" not in rep.text() and "sourcing stopped since" in rep.text()

    # sourcing resumes: the stall clears by itself, nothing was a gap
    await api.update_stream({**config, "sources": sources})
    await checks.wait_sourced(api, s, len(evs))
    rep = await _check(cjs, api, s, sink, cursor, grace_s=0.5)
    assert rep.ok and rep.stall is None and not rep.gaps, rep.text()
    await _drain(cnc, s, keyed.processor(), sink)
    assert keyed.mismatches(sink.read(), evs) is None  # sourced once each
    rep = await _check(cjs, api, s, sink, cursor, grace_s=0.5)
    assert rep.ok and rep.stall is None and not rep.gaps, rep.text()
    info = await api.stream_info(wq)
    report.append(f"reconcile r3: stall reported as stall, cleared after resume (sources "
                  f"{[(x.get('lag'), x.get('active')) for x in info.get('sources') or []]})")
