"""Runs over a range of partitions of one group (``run_partitions``, issue 51's first slice)
against a real nats-server, real Delta tables and the memory sink.

Each test checks the contract of a one-partition run, per partition: per-key stream order,
each effect committed exactly once, nothing acknowledged before its commit, nothing lost
(table == pandas reference, work queue empty afterwards); and the ownership rule of a range
run: a partition another run holds is not processed by it and holds up no other partition.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable
from nats.js.api import StreamConfig

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter, dlq_stream_name
from cg_pipelines.core.subjects import partition_for
from cg_pipelines.core.write import Merge
from cg_pipelines.engine.coverage_log import DeltaLogCoverage
from cg_pipelines.engine.lease import ensure_lease_consumer, lease_consumer_name
from cg_pipelines.engine.options import EngineOptions
from cg_pipelines.engine.runner import run_partition, run_partitions
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.api_admin import pinned_client_id
from cg_pipelines.jetstream.reconcile import reconcile_group
from cg_pipelines.sinks.base import app_id_for
from cg_pipelines.sinks.delta import DeltaSink
from cg_pipelines.sinks.storage import table_filesystem
from cg_pipelines.testing import MemorySink
from tests.support import keyed

N = 4  # partitions
FAST = dict(ack_wait_s=1.5, priority_timeout_s=1.5, hold_wait_s=6.0)
ROOT = Path(__file__).resolve().parents[2]


async def _setup(js, stream: str, evs: list[tuple[str, int]], n: int = N) -> JetStreamAPI:
    return await keyed.elastic_group(js, stream, evs, n)


def _by_partition(evs: list[tuple[str, int]], n: int = N) -> dict[int, list[tuple[str, int]]]:
    out: dict[int, list[tuple[str, int]]] = defaultdict(list)
    for k, v in evs:
        out[partition_for([k], n)].append((k, v))
    return out


async def _left(api: JetStreamAPI, wq: str, partition: int | None = None) -> int:
    if partition is None:
        return int((await api.stream_info(wq))["state"]["messages"])
    info = await api.stream_info(wq, subjects_filter=f"{partition}.>")
    return sum(int(c) for c in (info["state"].get("subjects") or {}).values())


async def test_range_run_equals_single_runs(nc, js, unique_name, tmp_path) -> None:
    """One run over 4 partitions commits exactly what 4 one-partition runs commit (the same
    rows, each partition's rows with its own ``_partition``, its own watermark), and a rerun
    finds every partition empty."""
    evs = keyed.events(n_keys=29, n_events=1600)
    per = _by_partition(evs)
    ranged, single = f"{unique_name}_r", f"{unique_name}_s"
    api = await _setup(js, ranged, evs)
    await _setup(js, single, evs)
    opts = EngineOptions(batch_max_msgs=120, **FAST)
    sink = DeltaSink(str(tmp_path / "range"))
    steps: list[tuple[str, dict]] = []
    r = await run_partitions(nc, ranged, "g", range(N), keyed.processor(), sink, opts,
                             hook=lambda s, i: steps.append((s, i)))
    assert r.status == "drained" and r.fence_conflicts == 0, r
    assert r.processed == len(evs) and r.commits > 1
    for p in range(N):
        side = r.inputs[app_id_for(ranged, "g", p)]
        assert (side.partition, side.status, side.processed) == (p, "drained", len(per[p]))
        assert sink.watermark(app_id_for(ranged, "g", p)) == side.last_seq
    # per-side steps name their partition; a joint commit moved several partitions at once
    assert {i["partition"] for s, i in steps if s == "read"} == set(range(N))
    assert any(sum(v is not None for v in i["ranges"].values()) > 1
               for s, i in steps if s == "committed")
    table = sink.read()
    assert keyed.mismatches(table, evs) is None
    assert all(partition_for([k], N) == p for k, p in zip(
        table["key"].to_pylist(), table["_partition"].to_pylist(), strict=True))
    assert await _left(api, f"{ranged}-g") == 0

    ref = DeltaSink(str(tmp_path / "single"))
    for p in range(N):
        one = await run_partition(nc, single, "g", p, keyed.processor(), ref, opts)
        assert one.status == "drained" and one.processed == len(per[p])
    cols = ["_partition", "key", "n", "count", "prev_n"]
    assert (keyed.table_frame(table).equals(keyed.table_frame(ref.read()))
            and table.select(cols).sort_by([("key", "ascending"), ("count", "ascending")])
            .equals(ref.read().select(cols).sort_by([("key", "ascending"),
                                                      ("count", "ascending")])))

    again = await run_partitions(nc, ranged, "g", range(N), keyed.processor(), sink, opts)
    assert again.status == "empty" and again.processed == 0
    assert {s.status for s in again.inputs.values()} == {"empty"}


async def test_range_of_one_partition_commits_as_a_partition_run(nc, js, unique_name,
                                                                 tmp_path) -> None:
    """``run_partitions`` over one partition commits what ``run_partition`` commits: the same
    one-side lineage (``cg.partition``, ``cg.coverage``; no ``cg.join``), the same rows."""
    evs = keyed.events(n_keys=9, n_events=300)
    api = await _setup(js, unique_name, evs, n=2)
    sink = DeltaSink(str(tmp_path / "t"))
    opts = EngineOptions(batch_max_msgs=50, **FAST)
    r0 = await run_partitions(nc, unique_name, "g", [0], keyed.processor(), sink, opts)
    r1 = await run_partition(nc, unique_name, "g", 1, keyed.processor(), sink, opts)
    assert (r0.status, r1.status) == ("drained", "drained") and r0.commits > 1
    assert r0.inputs[app_id_for(unique_name, "g", 0)].status == "drained"
    assert keyed.mismatches(sink.read(), evs) is None
    infos = [h for h in DeltaTable(sink.uri).history() if h.get("cg.operation") == "append"]
    assert len(infos) == r0.commits + r1.commits
    for h in infos:
        assert "cg.join" not in h and h["cg.partition"] in ("0", "1") and "cg.coverage" in h
        assert {k for k in h if k.startswith("cg.")} == {
            k for k in infos[-1] if k.startswith("cg.")}
    assert await _left(api, f"{unique_name}-g") == 0


async def test_upkeep_of_every_side_sees_the_run_s_own_commits(nc, js, unique_name,
                                                               tmp_path) -> None:
    """A run's commits carry every side's fence but advance only the first side's snapshot:
    the upkeep of each side (here its count of live files) works on a table version holding
    the run's commits, also on a table that existed before the run."""
    from cg_pipelines.sinks.maintenance import Maintenance

    first, second = keyed.events(n_keys=29, n_events=400), keyed.events(n_keys=29,
                                                                         n_events=400)
    await _setup(js, unique_name, first)
    sink = DeltaSink(str(tmp_path / "t"), maintenance=Maintenance(compact=False))
    opts = EngineOptions(batch_max_msgs=1000, **FAST)
    for n, evs in enumerate((first, second)):
        if n:
            await keyed.publish(js, unique_name, evs)
        r = await run_partitions(nc, unique_name, "g", range(N), keyed.processor(), sink, opts)
        assert r.status == "drained" and r.processed == len(evs), r
        live = pa.table(DeltaTable(sink.uri).get_add_actions(flatten=True))
        assert r.maintenance["sides"] == N
        assert r.maintenance["files_live"] == live.num_rows, (n, r.maintenance, live.num_rows)
    assert live.num_rows >= 2 * N  # the second run added files to every partition


async def test_range_run_in_merge_mode(nc, js, unique_name, tmp_path) -> None:
    """Delta Merge mode: a joint commit merges the rows of several partitions at once (each
    key matched within its partition), and the table holds each key's last row, its count
    continuing across batches from the per-partition state."""
    evs = keyed.events(n_keys=21, n_events=900)
    api = await _setup(js, unique_name, evs)
    sink = DeltaSink(str(tmp_path / "t"), write=Merge("key", order_by="seq"))
    r = await run_partitions(nc, unique_name, "g", range(N), keyed.processor(), sink,
                             EngineOptions(batch_max_msgs=80, **FAST))
    assert r.status == "drained" and r.processed == len(evs) and r.commits > 1, r
    want = keyed.reference(evs).groupby("key").tail(1).set_index("key")
    got = sink.read().to_pandas().set_index("key").sort_index()
    assert len(got) == len(want)
    assert (got["count"] == want["count"].reindex(got.index)).all()
    assert (got["n"] == want["n"].reindex(got.index)).all()
    assert all(partition_for([k], N) == p for k, p in got["_partition"].items())
    assert await _left(api, f"{unique_name}-g") == 0


async def _bad_setup(js, stream: str) -> tuple[JetStreamAPI, list, list[bytes], int, dict]:
    """4 partitions of keyed events with 3 bad payloads on a key of partition ``bad_p``:
    (api, good events, subjects/payloads published, bad_p, {work-queue seq: payload})."""
    evs = keyed.events(n_keys=13, n_events=400)
    bad_p = partition_for([evs[0][0]], N)
    bad_key = evs[0][0]
    msgs = [(f"{stream}.{k}", json.dumps({"key": k, "n": n}).encode()) for k, n in evs]
    bad = {60: b"{not json", 150: b"", 151: b'{"key": "x", "n": "y"}'}
    for i, data in sorted(bad.items()):
        msgs.insert(i, (f"{stream}.{bad_key}", data))
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    await admin.create_elastic(js, stream, "g", ElasticConfig(
        N, (PartitioningFilter(f"{stream}.*", (1,)),), members=("m1",)))
    for subject, data in msgs:
        await js.publish(subject, data)
    api = JetStreamAPI.from_js(js)
    for _ in range(200):
        if (await api.stream_info(f"{stream}-g"))["state"]["messages"] >= len(msgs):
            break
        await asyncio.sleep(0.05)
    return api, evs, msgs, bad_p, {i + 1: d for i, d in bad.items()}


async def test_bad_input_dead_lettered_per_partition(nc, js, unique_name) -> None:
    """``dlq``: the bad messages of one partition go to the group's DLQ, counted on that
    partition's side only; the other partitions and the good messages are unaffected."""
    stream = unique_name
    api, evs, msgs, bad_p, bad = await _bad_setup(js, stream)
    sink = MemorySink()
    r = await run_partitions(nc, stream, "g", range(N), keyed.processor(), sink,
                             EngineOptions(batch_max_msgs=80, **FAST))
    assert r.status == "drained" and r.dead_lettered == len(bad) and r.processed == len(evs)
    assert {s.partition: s.dead_lettered for s in r.inputs.values()} == {
        p: len(bad) if p == bad_p else 0 for p in range(N)}
    assert keyed.mismatches(sink.rows(), evs) is None
    dlq = dlq_stream_name(stream, "g")
    stored = await api.direct_get_batch(dlq, 1, f"{dlq}.>", 100)
    assert [int(m.headers["Cg-Sequence"]) for m in stored] == sorted(bad)
    assert await _left(api, f"{stream}-g") == 0


async def test_halt_stops_the_range_run_at_the_bad_message(nc, js, unique_name) -> None:
    """``halt``: the run stops at the first bad message of its partition (status ``halted``,
    that side ``halted`` at its sequence); nothing after it in that partition is committed, the
    bad message stays first in its partition; in every partition nothing is acknowledged that
    is not committed and the table holds exactly each partition's committed prefix."""
    stream = unique_name
    api, evs, msgs, bad_p, bad = await _bad_setup(js, stream)
    sink = MemorySink()
    opts = EngineOptions(batch_max_msgs=80, dead_letter_policy="halt", **FAST)
    r = await run_partitions(nc, stream, "g", range(N), keyed.processor(), sink, opts)
    first_bad = min(bad)
    side = r.inputs[app_id_for(stream, "g", bad_p)]
    assert r.status == "halted" and r.halted_at == first_bad, r
    assert side.status == "halted" and side.halted_at == first_bad
    assert sink.watermark(app_id_for(stream, "g", bad_p)) < first_bad
    wq = f"{stream}-g"
    committed: list[tuple[str, int]] = []
    for p in range(N):
        wm = sink.watermark(app_id_for(stream, "g", p))
        mine = [(seq, m) for seq, m in enumerate(msgs, 1)
                if partition_for([m[0].split(".", 1)[1]], N) == p]
        done = [m for seq, m in mine if seq <= wm]
        assert await _left(api, wq, p) == len(mine) - len(done), p
        committed += [(json.loads(d)["key"], json.loads(d)["n"]) for _, d in done]
    assert keyed.mismatches(sink.rows(), committed) is None
    first = await api.direct_get_batch(wq, 1, f"{bad_p}.>", 1)
    assert first[0].data == bad[first_bad]


async def test_held_partition_is_skipped_then_finished(nc, js, unique_name) -> None:
    """Partition 2's lease is held elsewhere (pinned, its message delivered, not acked): a
    range run over 0..3 drains 0, 1 and 3, reports 2 ``held`` and leaves it untouched (no row,
    no watermark, every message queued); once the holder lets go, a later range run finishes
    it."""
    stream = unique_name
    evs = keyed.events(n_keys=19, n_events=800)
    per = _by_partition(evs)
    api = await _setup(js, stream, evs)
    wq, held = f"{stream}-g", 2
    slow_lease = dict(ack_wait_s=30.0, priority_timeout_s=30.0)  # the holder keeps it
    opts = EngineOptions(batch_max_msgs=100, hold_wait_s=0.5, **slow_lease)
    await ensure_lease_consumer(api, wq, held, opts)
    got = await api.pull(wq, lease_consumer_name(held), batch=1, expires_s=2.0)
    assert got.messages and got.pin_id
    sink = MemorySink()
    t0 = time.monotonic()
    r = await run_partitions(nc, stream, "g", range(N), keyed.processor(), sink, opts)
    side = r.inputs[app_id_for(stream, "g", held)]
    assert side.status == "held" and side.processed == 0, side
    assert "held by another instance" in side.detail
    assert r.status == "drained" and f"partition {held} held" in r.detail, r
    assert {p: s.status for p, s in enumerate(r.inputs.values())} == {
        0: "drained", 1: "drained", 2: "held", 3: "drained"}
    assert r.processed == len(evs) - len(per[held])
    assert time.monotonic() - t0 < 20  # never waited for the holder beyond hold_wait_s
    others = [e for p in range(N) if p != held for e in per[p]]
    assert keyed.mismatches(sink.rows(), others) is None
    assert sink.watermark(app_id_for(stream, "g", held)) == 0
    assert await _left(api, wq, held) == len(per[held]) == await _left(api, wq)

    # nothing to lease but a partition held elsewhere: the run is held, not empty
    r1 = await run_partitions(nc, stream, "g", [0, held], keyed.processor(), sink, opts)
    assert r1.status == "held" and r1.processed == 0, r1
    assert [s.status for s in r1.inputs.values()] == ["empty", "held"]

    await got.messages[0].nak()  # the holder lets go
    await api.unpin(wq, lease_consumer_name(held))
    r2 = await run_partitions(nc, stream, "g", range(N), keyed.processor(), sink, opts)
    assert r2.status == "drained" and r2.processed == len(per[held]), r2
    assert [s.status for s in r2.inputs.values()] == ["empty", "empty", "drained", "empty"]
    assert keyed.mismatches(sink.rows(), evs) is None
    assert await _left(api, wq) == 0


async def test_concurrent_single_run_keeps_its_partition(nc, js, unique_name) -> None:
    """A slow one-partition run holds partition 1 while a range run over 0..3 starts: the range
    run drains the other three, the single run drains its own; no fence conflict, no key
    processed twice (table == reference), work queue empty."""
    stream = unique_name
    evs = keyed.events(n_keys=17, n_events=700)
    per = _by_partition(evs)
    api = await _setup(js, stream, evs)
    sink = MemorySink()
    slow = keyed.processor()
    orig = slow.transform

    def slow_transform(table, ctx):
        time.sleep(0.1)
        return orig(table, ctx)

    slow.transform = slow_transform
    committed = asyncio.Event()
    single = asyncio.create_task(run_partition(
        nc, stream, "g", 1, slow, sink, EngineOptions(batch_max_msgs=10, **FAST),
        hook=lambda s, i: committed.set() if s == "committed" else None))
    await committed.wait()
    r = await run_partitions(nc, stream, "g", range(N), keyed.processor(), sink,
                             EngineOptions(batch_max_msgs=60, **{**FAST, "hold_wait_s": 0.5}))
    one = await single
    assert r.inputs[app_id_for(stream, "g", 1)].status == "held", r
    assert r.processed == len(evs) - len(per[1]) and r.fence_conflicts == 0
    assert one.status == "drained" and one.processed == len(per[1]) and one.fence_conflicts == 0
    assert keyed.mismatches(sink.rows(), evs) is None
    assert await _left(api, f"{stream}-g") == 0


async def test_held_sides_wait_together(nc, js, unique_name) -> None:
    """Three of four partitions held elsewhere: the run waits ``hold_wait_s`` for them once,
    not once each (the sides start at once), and drains the fourth."""
    stream = unique_name
    evs = keyed.events(n_keys=11, n_events=200)
    per = _by_partition(evs)
    api = await _setup(js, stream, evs)
    wq = f"{stream}-g"
    opts = EngineOptions(batch_max_msgs=100, ack_wait_s=30.0, priority_timeout_s=30.0,
                         hold_wait_s=3.0)
    held = []
    for p in (0, 1, 2):
        await ensure_lease_consumer(api, wq, p, opts)
        got = await api.pull(wq, lease_consumer_name(p), batch=1, expires_s=2.0)
        assert got.messages
        held.append(got.messages[0])
    t0 = time.monotonic()
    r = await run_partitions(nc, stream, "g", range(N), keyed.processor(), MemorySink(), opts)
    elapsed = time.monotonic() - t0
    assert [s.status for s in r.inputs.values()] == ["held", "held", "held", "drained"], r
    assert r.processed == len(per[3]) and r.status == "drained"
    assert elapsed < 3 * opts.hold_wait_s, elapsed  # one after the other: >= 9 s
    for p, m in zip((0, 1, 2), held, strict=True):
        await m.nak()
        await api.unpin(wq, lease_consumer_name(p))


async def test_drained_partition_is_given_up_while_the_run_goes_on(nc, js, unique_name
                                                                   ) -> None:
    """Partition 0 of a range run over 0..1 is drained while partition 1 (slow) goes on: its
    pin is released at once (not after the pin timeout, 30 s here, nor at the run's end), so a
    one-partition run of 0 takes the messages that arrived since, while the range run is still
    running; each is committed once. Partition 0's messages come first in the stream, so it is
    drained first whether its partitions are read side by side or with one split read."""
    stream = unique_name
    evs = sorted(keyed.events(n_keys=11, n_events=300), key=lambda e: partition_for([e[0]], 2))
    api = await _setup(js, stream, evs, n=2)
    wq = f"{stream}-g"
    last0 = max(i for i, (k, _) in enumerate(evs, 1) if partition_for([k], 2) == 0)
    proc = keyed.processor()
    orig = proc.transform

    def slow_one(table, ctx):
        if ctx.partition == 1:
            time.sleep(0.3)
        return orig(table, ctx)

    proc.transform = slow_one
    opts = EngineOptions(batch_max_msgs=20, ack_wait_s=30.0, priority_timeout_s=30.0,
                         hold_wait_s=1.0)
    done0 = asyncio.Event()

    def hook(step: str, info: dict) -> None:
        if step == "acked" and info["partition"] == 0 and info["last_seq"] == last0:
            done0.set()

    sink = MemorySink()
    ranged = asyncio.create_task(run_partitions(nc, stream, "g", [0, 1], proc, sink, opts,
                                                hook=hook))
    await asyncio.wait_for(done0.wait(), 60)
    for _ in range(100):  # the pin goes with the side's last (empty) pull
        if pinned_client_id(await api.consumer_info(wq, lease_consumer_name(0))) is None:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("partition 0 still pinned after it was drained")
    keys0 = [k for k in (f"k{i}" for i in range(11)) if partition_for([k], 2) == 0]
    more = [(keys0[i % len(keys0)], 100_000 + i) for i in range(5)]
    await keyed.publish(js, stream, more)
    for _ in range(200):
        if (await api.stream_info(wq))["state"]["last_seq"] >= len(evs) + len(more):
            break
        await asyncio.sleep(0.05)
    one = await run_partition(nc, stream, "g", 0, keyed.processor(), sink, opts)
    assert one.status == "drained" and one.processed == len(more), one
    assert not ranged.done()  # partition 1 still going
    r = await ranged
    assert [s.status for s in r.inputs.values()] == ["drained", "drained"], r
    assert r.fence_conflicts == 0 and r.processed == len(evs)
    assert keyed.mismatches(sink.rows(), evs + more) is None
    assert await _left(api, wq) == 0


def _worker(url: str, stream: str, parts: str, uri: str, step: str, at: int,
            batch: int = 60, sig: str = "KILL") -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "tests/support/range_worker.py"), url, stream, "g",
         parts, uri, str(batch), str(FAST["ack_wait_s"]), step, str(at), sig],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("at", [1, 2])
async def test_zombie_range_run_is_fenced(nats_server, nc, js, unique_name, tmp_path,
                                          at) -> None:
    """A range run paused (SIGSTOP) past its pin timeout and ack wait once its ``at``-th batch
    is processed; one-partition runs take every partition over and drain them; resumed, the
    zombie never commits after the takeover: paused before its first commit, that commit is
    refused (status ``fenced``: a joint commit fenced on each partition in it); later, it is
    refused or finds its leases gone. The table equals the reference, the work queue is
    empty."""
    stream = unique_name
    evs = keyed.events(n_keys=13, n_events=500)
    api = await _setup(js, stream, evs)
    uri = str(tmp_path / "t")
    zombie = _worker(nats_server.url, stream, ",".join(map(str, range(N))), uri, "processed",
                     at=at, sig="STOP")
    for _ in range(600):
        state = Path(f"/proc/{zombie.pid}/stat").read_text().split()[2]
        if state == "T":
            break
        await asyncio.sleep(0.05)
    assert state == "T", "worker never paused"
    try:
        sink = DeltaSink(uri)
        for p in range(N):
            r = await run_partition(nc, stream, "g", p, keyed.processor(), sink,
                                    EngineOptions(batch_max_msgs=40, **FAST))
            assert r.status in ("drained", "empty") and r.fence_conflicts == 0, r
    finally:
        os.kill(zombie.pid, signal.SIGCONT)
    out, err = await asyncio.to_thread(zombie.communicate, timeout=60)
    zr = json.loads(out.strip().splitlines()[-1])
    assert zr["status"] in (("fenced",) if at == 1 else ("fenced", "drained", "handed_over")), \
        (zr, err)
    if zr["status"] == "fenced":
        assert zr["fence_conflicts"] == 1 and zr["commits"] <= at - 1, (zr, err)
        assert "fenced" in {s["status"] for s in zr["inputs"].values()}, zr
    assert keyed.mismatches(sink.read(), evs) is None
    assert await _left(api, f"{stream}-g") == 0


@pytest.mark.parametrize("step", ["read", "committed", "purged"])
async def test_kill_mid_range_run(nats_server, nc, js, unique_name, tmp_path, step) -> None:
    """SIGKILL a range run's process at its 3rd ``read`` (a side's batch read, its commit not
    made), ``committed`` (a joint commit made, nothing of it purged or acked) or ``purged``
    (one side purged, not acked): for every partition, nothing is gone from the work queue that
    its committed watermark does not cover, and the table holds exactly the committed
    messages; a rerun finishes with the reference table and an empty work queue."""
    stream = unique_name
    evs = keyed.events(n_keys=17, n_events=600)
    per = _by_partition(evs)
    api = await _setup(js, stream, evs)
    wq, uri = f"{stream}-g", str(tmp_path / "t")
    proc = _worker(nats_server.url, stream, ",".join(map(str, range(N))), uri, step, at=3)
    out, err = await asyncio.to_thread(proc.communicate, timeout=90)
    assert proc.returncode == -signal.SIGKILL, (out, err)
    sink = DeltaSink(uri)
    rows = sink.read() if sink.exists() else None
    # the work queue's sequences are the origin's here: message i is evs[i - 1]
    parts = [partition_for([k], N) for k, _ in evs]
    for p in range(N):
        wm = sink.watermark(app_id_for(stream, "g", p))
        committed = sum(1 for i, q in enumerate(parts, 1) if q == p and i <= wm)
        left = await _left(api, wq, p)
        assert left >= len(per[p]) - committed, (p, wm, left)  # nothing settled uncommitted
        got = 0 if rows is None else sum(1 for x in rows["_partition"].to_pylist() if x == p)
        assert got == committed, (p, got, committed)
    r = await run_partitions(nc, stream, "g", range(N), keyed.processor(), sink,
                             EngineOptions(batch_max_msgs=60, **FAST))
    assert r.status == "drained" and r.fence_conflicts == 0, r
    assert keyed.mismatches(sink.read(), evs) is None
    assert await _left(api, wq) == 0


async def test_reconcile_reads_range_commits_per_partition(nc, js, unique_name,
                                                           tmp_path) -> None:
    """A range run's joint commits record each partition's coverage under its own partition:
    the coverage log returns one entry per partition per commit, covering exactly that
    partition's origin sequences, and the reconcile check finds every message covered."""
    stream = unique_name
    evs = keyed.events(n_keys=23, n_events=900)
    api = await _setup(js, stream, evs)
    sink = DeltaSink(str(tmp_path / "t"))
    r = await run_partitions(nc, stream, "g", range(N), keyed.processor(), sink,
                             EngineOptions(batch_max_msgs=200, **FAST))
    assert r.status == "drained" and r.processed == len(evs)
    fs = table_filesystem(sink.uri, {})
    assert fs is not None
    log = DeltaLogCoverage(fs, stream, "g")
    commits, _, done = log.read(-1, 10_000)
    assert done
    covered: dict[int, list[int]] = defaultdict(list)
    versions: dict[int, set[int]] = defaultdict(set)
    for c in commits:
        assert c.seqs is not None
        covered[c.partition].extend(c.seqs.tolist())
        versions[c.version].add(c.partition)
    want: dict[int, list[int]] = defaultdict(list)
    for seq, (k, _) in enumerate(evs, 1):
        want[partition_for([k], N)].append(seq)
    assert {p: sorted(s) for p, s in covered.items()} == dict(want)
    assert max(len(ps) for ps in versions.values()) > 1  # joint commits were read per entry
    rep = await reconcile_group(js, api, stream, "g", coverage=log, from_seq=1, grace_s=0)
    assert rep.ok and rep.expected == len(evs) == rep.in_table, rep.text()
