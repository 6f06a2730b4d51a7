"""Migrating an elastic group to a new partition count (issue 51) on a real nats-server with
traffic flowing and runs draining meanwhile, against a real Delta table and the pandas
reference of ``tests/support/keyed.py`` (per-key ``count`` and ``prev_n`` continue across
batches, so the table equals the reference only if no message is lost, none is doubled, no
key is reordered and each moved key's state followed it to its new partition).

The runs read the group's partition count from its KV config before each round, as a
deployment redeployed with the new count does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from nats.js.api import StreamConfig

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.core.errors import ConfigError, MigrationError, StateError
from cg_pipelines.core.migration import Epoch, Lineage
from cg_pipelines.core.subjects import partition_for
from cg_pipelines.core.write import Merge
from cg_pipelines.engine.join import run_copartitioned
from cg_pipelines.engine.options import EngineConfigError, EngineOptions
from cg_pipelines.engine.rebuild import rebuild_partition
from cg_pipelines.engine.runner import run_partitions
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.members import GroupMsg, MemberConfig, elastic_consume
from cg_pipelines.jetstream.migration import (
    MigrationOptions,
    get_lineage,
    get_migration,
    migrate,
    migrate_set,
)
from cg_pipelines.sinks.delta import DeltaSink
from tests.iceberg.conftest import make_backend
from tests.integration.test_wire_reference import reference_filters
from tests.support import joined, keyed

ROOT = Path(__file__).resolve().parents[2]
FAST = dict(ack_wait_s=1.5, priority_timeout_s=1.5, hold_wait_s=2.0)
QUICK = MigrationOptions(drain_timeout_s=60, first_message_timeout_s=60, poll_s=0.1)


async def _group(js, stream: str, n: int, members: tuple[str, ...] = ("m1",)) -> None:
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"], allow_direct=True))
    await admin.create_elastic(js, stream, "g", ElasticConfig(
        n, (PartitioningFilter(f"{stream}.*", (1,)),), members=members))


async def _sourced(js, stream: str, n: int) -> None:
    await _sourced_wq(js, f"{stream}-g", n)


async def _sourced_wq(js, wq: str, n: int) -> None:
    api = JetStreamAPI.from_js(js)
    for _ in range(200):
        if int((await api.stream_info(wq))["state"]["messages"]) >= n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{wq} did not receive {n} messages")


class Traffic:
    """Publishes ``evs`` in order in the background, ``per_s`` events a second, then, until
    :meth:`stop`, one more event of the same keys every 20 ms (so the new layout always gets
    messages, however long the migration takes); ``sent``: every event published."""

    def __init__(self, js, stream: str, evs: list[tuple[str, int]], per_s: float) -> None:
        self.js, self.stream, self.evs, self.per_s = js, stream, evs, per_s
        self.sent: list[tuple[str, int]] = []
        self.stopping = False
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        step = 20
        for i in range(0, len(self.evs), step):
            await keyed.publish(self.js, self.stream, self.evs[i:i + step])
            self.sent += self.evs[i:i + step]
            await asyncio.sleep(step / self.per_s)
        keys = sorted({k for k, _ in self.evs})
        i = 0
        while not self.stopping:
            ev = (keys[i % len(keys)], 10**9 + i)
            await keyed.publish(self.js, self.stream, [ev])
            self.sent.append(ev)
            i += 1
            await asyncio.sleep(0.02)

    async def stop(self) -> list[tuple[str, int]]:
        """Stop publishing; every event published."""
        self.stopping = True
        await self.task
        return self.sent


class Runs:
    """Drains every partition of the group, round after round, with the count its KV config
    has at the round's start, until stopped."""

    def __init__(self, nc, stream: str, sink: Any) -> None:
        self.nc, self.stream, self.sink = nc, stream, sink
        self.counts: list[int] = []
        self.stopping = False
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        opts = EngineOptions(batch_max_msgs=150, **FAST)
        while not self.stopping:
            n = (await admin.get_elastic(self.nc.jetstream(), self.stream, "g")).config.max_members
            if not self.counts or self.counts[-1] != n:
                self.counts.append(n)
            await run_partitions(self.nc, self.stream, "g", range(n), keyed.processor(),
                                 self.sink, opts)
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        self.stopping = True
        await self.task


async def _drain(nc, stream: str, sink: Any, n: int) -> None:
    api = JetStreamAPI(nc)
    for _ in range(20):
        await run_partitions(nc, stream, "g", range(n), keyed.processor(), sink,
                             EngineOptions(batch_max_msgs=500, **FAST))
        if not int((await api.stream_info(f"{stream}-g"))["state"]["messages"]):
            return
    raise AssertionError(f"{stream}-g not drained")


async def _check_wire(js, stream: str, n: int) -> None:
    """The group is exactly what the reference's CreateElastic makes with ``n`` partitions:
    KV ``max_members`` and the work queue's source (its transform, no ``opt_start_seq``)."""
    cfg = (await admin.get_elastic(js, stream, "g")).config
    assert cfg.max_members == n
    info = await JetStreamAPI.from_js(js).stream_info(f"{stream}-g")
    want = admin.work_queue_stream_config(stream, "g", cfg, replicas=1, storage="file")
    got = info["config"]["sources"]
    assert [{k: s.get(k) for k in ("name", "subject_transforms")} for s in got] == \
        want["sources"], got
    assert all("opt_start_seq" not in s or not s["opt_start_seq"] for s in got), got
    assert await get_migration(js, stream, "g") is None


def _sink(table_format: str, request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    if table_format == "delta":
        return DeltaSink(str(tmp_path / "t"))
    return make_backend("sqlite-local", request, tmp_path).sink()


@pytest.mark.parametrize("table_format", ["delta", "iceberg"])
async def test_a_group_migrates_8_to_64_with_traffic_flowing(
        nc, js, unique_name, tmp_path, request, table_format: str) -> None:
    """8 -> 64 partitions while events are published and runs drain, on a Delta and on an
    Iceberg table: the table equals the reference (keys that moved to partitions 8..63 carry
    their count on), the group is reference-format with 64 partitions, the lineage names both
    epochs, and each row is under its key's partition of its epoch."""
    s = unique_name
    await _group(js, s, 8)
    n = 3000 if table_format == "delta" else 1500  # an Iceberg commit costs more
    evs = keyed.events(n_keys=97, n_events=n)
    sink = _sink(table_format, request, tmp_path)
    await keyed.publish(js, s, evs[:n // 3])
    runs = Runs(nc, s, sink)
    traffic = Traffic(js, s, evs[n // 3:], per_s=2000)
    await asyncio.sleep(0.3)
    steps: list[str] = []
    lineage = await migrate(js, s, "g", 64, QUICK, hook=lambda name, rec: steps.append(name))
    evs = evs[:n // 3] + await traffic.stop()
    for _ in range(600):  # a round of the new layout started (a slow machine's rounds are long)
        if runs.counts[-1] == 64:
            break
        await asyncio.sleep(0.05)
    await runs.stop()
    await _drain(nc, s, sink, 64)

    table = sink.read()
    assert keyed.mismatches(table, evs) is None
    assert runs.counts == [8, 64]
    assert [e.partitions for e in lineage.epochs] == [8, 64]
    assert lineage == await get_lineage(js, s, "g")
    cut = lineage.epochs[1]
    parts = dict(zip(table["seq"].to_pylist(), table["_partition"].to_pylist(), strict=True))
    # rows before the cut are in the 8-partition layout, rows after it in the 64-partition one
    keys = table["key"].to_pylist()
    for seq, key in zip(table["seq"].to_pylist(), keys, strict=True):
        n = 8 if seq < cut.first_origin_seq else 64
        assert parts[seq] == partition_for([key], n), (seq, key)
    moved = {k for k in keys if partition_for([k], 64) >= 8}
    assert moved and any(seq >= cut.first_origin_seq for seq in parts)
    assert [x for x in steps if ":" not in x] == [  # planned twice: the freshest view again
        "planned", "planned", "source_removed", "drained", "config_written", "source_added", "done"]
    await _check_wire(js, s, 64)
    with pytest.raises(ConfigError, match="already has 64"):
        await migrate(js, s, "g", 64, QUICK)


KILL_POINTS = [
    "planned:start", "planned", "source_removed:start", "planned", "source_removed:acted",
    "source_removed", "drained:start", "drained", "config_written:start",
    "config_written:acted", "config_written", "source_added:start", "source_added:acted",
    "source_added", "done:start", "done:acted",
]
"""Where the migration process is killed, one process after another (each rerun resumes and
goes on to the next point; ``planned`` twice: the removal re-records the freshest view)."""


@pytest.mark.parametrize("table_format", ["delta", "iceberg"])
async def test_a_migration_killed_at_every_step_finishes_when_run_again(
        nc, js, nats_url, unique_name, tmp_path, request, table_format: str) -> None:
    """kill -9 of the migrating process at every step (before each action, after each NATS
    change before its record, after each record), each time run again from the start, with
    traffic flowing and runs draining: one run finishes it and the table (Delta, Iceberg)
    equals the reference (8 -> 32)."""
    s = unique_name
    await _group(js, s, 8)
    evs = keyed.events(n_keys=61, n_events=2400 if table_format == "delta" else 1200)
    sink = _sink(table_format, request, tmp_path)
    await keyed.publish(js, s, evs[:600])
    runs = Runs(nc, s, sink)
    traffic = Traffic(js, s, evs[600:], per_s=400)
    killed = []
    try:
        for point in KILL_POINTS:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tests.support.migrate_until", nats_url, s, "g", "32",
                point, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 120)
            assert proc.returncode == -9, (point, proc.returncode, out, err[-2000:])
            killed.append(out.decode().split()[-1])
        assert killed == KILL_POINTS
        lineage = await migrate(js, s, "g", 32, QUICK)
    finally:
        sent = await traffic.stop()
        await runs.stop()
    await _drain(nc, s, sink, 32)
    assert keyed.mismatches(sink.read(), evs[:600] + sent) is None
    assert [e.partitions for e in lineage.epochs] == [8, 32]
    await _check_wire(js, s, 32)


async def test_reference_members_drain_the_old_layout_stop_and_join_the_new(
        js, nc, unique_name) -> None:
    """Reference-format members (the reference's rules: a changed ``max_members`` stops a
    member) drain the 4-partition layout, stop when the config changes, and, started again,
    get the reference's filters for 8 partitions and consume the rest: every message once."""
    s = unique_name
    await _group(js, s, 4, members=("a", "b"))
    seen: list[int] = []

    async def handler(msg: GroupMsg) -> None:
        seen.append(int(json.loads(msg.data)["n"]))
        await msg.ack()

    cfg = MemberConfig(ack_wait_s=1.0)
    hs = [await elastic_consume(js, s, "g", m, handler, cfg) for m in ("a", "b")]
    evs = [(f"k{i % 37}", i) for i in range(600)]
    await keyed.publish(js, s, evs[:300])
    migrating = asyncio.create_task(migrate(js, s, "g", 8, QUICK))
    stopped = await asyncio.wait_for(asyncio.gather(*(h.done() for h in hs)), 60)
    assert all(isinstance(e, ConfigError) for e in stopped), stopped
    hs = [await elastic_consume(js, s, "g", m, handler, cfg) for m in ("a", "b")]
    try:
        await keyed.publish(js, s, evs[300:])
        await asyncio.wait_for(migrating, 60)
        for _ in range(300):
            if len(seen) >= len(evs):
                break
            await asyncio.sleep(0.05)
        assert sorted(seen) == [n for _, n in evs]
        api = JetStreamAPI.from_js(js)
        new = (await admin.get_elastic(js, s, "g")).config
        for m in ("a", "b"):
            ci = await api.consumer_info(f"{s}-g", m)
            assert sorted(ci["config"]["filter_subjects"]) == sorted(reference_filters(new, m))
    finally:
        for h in hs:
            h.stop()
        await asyncio.gather(*(asyncio.wait_for(h.done(), 10) for h in hs))
    await _check_wire(js, s, 8)


async def test_what_a_migrated_group_refuses(nc, js, unique_name, tmp_path) -> None:
    """A second migration while one runs, a merge table and a rebuild on a migrated group are
    refused with their reasons; the drain waits and says so, and a rerun goes on."""
    s = unique_name
    await _group(js, s, 4)
    await keyed.publish(js, s, keyed.events(n_keys=5, n_events=50))
    await _sourced(js, s, 50)
    with pytest.raises(MigrationError, match="still in"):  # no runs drain the work queue
        await migrate(js, s, "g", 8, MigrationOptions(drain_timeout_s=0.5, poll_s=0.1))
    rec = await get_migration(js, s, "g")
    assert rec is not None and rec.step == "source_removed" and rec.cut is not None
    with pytest.raises(StateError, match="finish it first"):
        await migrate(js, s, "g", 16, QUICK)
    sink = DeltaSink(str(tmp_path / "t"))
    await _drain(nc, s, sink, 4)
    with pytest.raises(MigrationError, match="no message yet"):  # nothing published since
        await migrate(js, s, "g", 8, MigrationOptions(first_message_timeout_s=0.5, poll_s=0.1))
    assert (await get_migration(js, s, "g")).step == "source_added"  # type: ignore[union-attr]
    await keyed.publish(js, s, [("k1", 1)])
    lineage = await migrate(js, s, "g", 8, QUICK)
    assert lineage == Lineage((Epoch(4), Epoch(8, 51, 51)))
    merge = DeltaSink(str(tmp_path / "m"), write=Merge(key="key"))
    with pytest.raises(EngineConfigError, match="Merge table cannot follow"):
        await run_partitions(nc, s, "g", [5], keyed.processor(), merge)
    with pytest.raises(EngineConfigError, match="a rebuild of group"):
        await rebuild_partition(nc, s, "g", 5, keyed.processor(), sink)
    await _check_wire(js, s, 8)


async def _migrate_then_publish(js, s: str, to: int, hook, ev: tuple[str, int]) -> None:
    """Migrate to ``to``; publish ``ev`` once the new source is added (the migration ends
    with the new layout's first message)."""
    task = asyncio.create_task(migrate(js, s, "g", to, QUICK, hook=hook))
    for _ in range(400):
        rec = await get_migration(js, s, "g")
        if (rec is not None and rec.step == "source_added") or task.done():
            break
        await asyncio.sleep(0.05)
    await keyed.publish(js, s, [ev])
    await asyncio.wait_for(task, 60)


async def test_the_cut_is_exact_when_the_work_queue_s_last_message_is_gone(
        nc, js, unique_name, tmp_path) -> None:
    """The cut is read from the last message when the work queue still holds it (``header``),
    counted from another message it holds or from the origin's beginning when it does not
    (``counted``): in each case the first origin sequence not yet sourced."""
    s = unique_name
    await _group(js, s, 4)
    evs = keyed.events(n_keys=11, n_events=40)
    await keyed.publish(js, s, evs)
    sink = DeltaSink(str(tmp_path / "t"))
    api = JetStreamAPI.from_js(js)
    await _sourced(js, s, 40)
    last = partition_for([evs[-1][0]], 4)  # drain the last message's partition only
    await run_partitions(nc, s, "g", [last], keyed.processor(), sink,
                         EngineOptions(batch_max_msgs=500, **FAST))
    seen: list[str] = []

    def hook(name: str, rec) -> None:
        if name == "source_removed":
            seen.append(rec.cut.how)
            assert (rec.cut.first_origin_seq, rec.cut.first_wq_seq) == (41, 41)

    runs = Runs(nc, s, sink)
    await _migrate_then_publish(js, s, 8, hook, ("k1", 10_001))
    # drained to empty: the next migration counts from the previous epoch's start
    for _ in range(100):
        if not int((await api.stream_info(f"{s}-g"))["state"]["messages"]):
            break
        await asyncio.sleep(0.1)
    await _migrate_then_publish(js, s, 2, lambda name, rec: seen.append(rec.cut.how)
                                if name == "source_removed" else None, ("k2", 10_002))
    await runs.stop()
    await _drain(nc, s, sink, 2)
    assert seen == ["counted", "counted"]
    lineage = await get_lineage(js, s, "g")
    assert lineage is not None and lineage.epochs[1:] == (Epoch(8, 41, 41), Epoch(2, 42, 42))
    assert keyed.mismatches(sink.read(), [*evs, ("k1", 10_001), ("k2", 10_002)]) is None


def _cg(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cg_pipelines.cli", "--server", url, *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


async def test_cg_elastic_migrate_from_the_shell(js, nats_url, unique_name) -> None:
    """``--dry-run`` prints the plan and writes nothing; bad targets exit 2 with the reason;
    a drain that must wait exits 3 and a rerun resumes (the dry run then marks the steps
    done); the finished migration prints the new count."""
    s = unique_name
    await _group(js, s, 4)
    await keyed.publish(js, s, keyed.events(n_keys=5, n_events=30))
    await _sourced(js, s, 30)
    dry = await asyncio.to_thread(_cg, nats_url, "elastic", "migrate", s, "g",
                                  "--partitions", "16", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "dry run, nothing written" in dry.stdout and "max_members=16" in dry.stdout
    assert "30 messages" in dry.stdout and "75%" in dry.stdout  # 1 - 4/16 of keys move
    assert await get_migration(js, s, "g") is None
    for bad, why in (("4", "already has 4"), ("0", ">= 1")):
        got = await asyncio.to_thread(_cg, nats_url, "elastic", "migrate", s, "g",
                                      "--partitions", bad)
        assert got.returncode == 2 and why in got.stderr, got.stderr
    wait = await asyncio.to_thread(_cg, nats_url, "elastic", "migrate", s, "g",
                                   "--partitions", "16", "--drain-timeout", "0.5")
    assert wait.returncode == 3 and "still in" in wait.stderr, wait.stderr
    other = await asyncio.to_thread(_cg, nats_url, "elastic", "migrate", s, "g",
                                    "--partitions", "8", "--dry-run")
    assert other.returncode == 2 and "finish it first" in other.stderr, other.stderr
    again = await asyncio.to_thread(_cg, nats_url, "--json", "elastic", "migrate", s, "g",
                                    "--partitions", "16", "--dry-run")
    assert json.loads(again.stdout)["done"] == ["planned", "source_removed"]
    await JetStreamAPI.from_js(js).purge(f"{s}-g")  # as if drained: the rest goes on
    done = asyncio.create_task(asyncio.to_thread(
        _cg, nats_url, "elastic", "migrate", s, "g", "--partitions", "16"))
    while (rec := await get_migration(js, s, "g")) is None or rec.step != "source_added":
        await asyncio.sleep(0.05)
    await keyed.publish(js, s, [("k1", 1)])
    got = await asyncio.wait_for(done, 60)
    assert got.returncode == 0 and "migrated to 16 partitions" in got.stdout, got.stderr
    await _check_wire(js, s, 16)


async def test_a_co_partitioned_set_migrates_together(nc, js, unique_name, tmp_path) -> None:
    """Two co-partitioned groups (impressions and clicks, joined per auction into an Append
    table) migrated 4 -> 8 together with traffic on both and join runs draining: every step
    done for both before either goes on (the co-partitioned runs refused while their counts
    differ), the joined state of moved auctions carried on, the table's last row per auction
    equal to the pandas join of everything published."""
    s = unique_name
    evs = joined.events(240)
    first = {n: m[: len(m) // 2] for n, m in evs.items()}
    rest = {n: m[len(m) // 2:] for n, m in evs.items()}
    await joined.setup(js, s, first, n_partitions=4)
    sink = DeltaSink(str(tmp_path / "t"))  # Append: a Merge table cannot follow a migration
    groups = [(i.stream, i.group) for i in joined.inputs(s)]
    stop = asyncio.Event()
    counts: list[int] = []

    async def join_runs() -> None:
        opts = EngineOptions(batch_max_msgs=40, **FAST)
        while not stop.is_set():
            ns = {(await admin.get_elastic(js, st, g)).config.max_members for st, g in groups}
            if len(ns) == 1:
                (n,) = ns
                if not counts or counts[-1] != n:
                    counts.append(n)
                for p in range(n):
                    with contextlib.suppress(ConfigError):  # counts changing meanwhile
                        await run_copartitioned(nc, joined.inputs(s), p, joined.processor(),
                                                sink, opts)
            await asyncio.sleep(0.05)

    publishing = True

    async def publish_rest() -> None:
        for name, msgs in rest.items():
            for m in msgs:
                await js.publish(f"{s}_{name}.{m['auction']}", json.dumps(m).encode())
                await asyncio.sleep(0.002)
        i = 0  # then both inputs until the migration ends: the new layouts get messages
        while publishing:
            for name, m in ((joined.IMP, {"auction": f"t{i}", "ad": "ad-t"}),
                            (joined.CLK, {"auction": f"t{i}"})):
                await js.publish(f"{s}_{name}.{m['auction']}", json.dumps(m).encode())
                evs[name].append(m)
            i += 1
            await asyncio.sleep(0.02)

    runner = asyncio.create_task(join_runs())
    publisher = asyncio.create_task(publish_rest())
    steps: list[str] = []
    lineages = await migrate_set(js, groups, 8, QUICK,
                                 hook=lambda name, rec: steps.append(name))
    publishing = False
    await publisher
    for _ in range(600):
        if counts[-1] == 8:
            break
        await asyncio.sleep(0.05)
    stop.set()
    await runner
    # clicks of auctions that moved, after the migration: their counts must carry on
    moved = sorted({str(m["auction"]) for m in first[joined.CLK]
                    if partition_for([str(m["auction"])], 8) >= 4})
    assert moved
    after = [{"auction": a} for a in moved]
    for m in after:
        await js.publish(f"{s}_{joined.CLK}.{m['auction']}", json.dumps(m).encode())
    evs[joined.CLK] += after
    await _sourced_wq(js, f"{s}_{joined.CLK}-g", len(after))
    for p in range(8):
        await run_copartitioned(nc, joined.inputs(s), p, joined.processor(), sink,
                                EngineOptions(batch_max_msgs=500, **FAST))
    assert counts == [4, 8]
    assert [[e.partitions for e in lin.epochs] for lin in lineages] == [[4, 8], [4, 8]]
    done = [x for x in steps if ":" not in x]
    # lockstep: both groups' sources cut before either drained, both configs before a source
    assert done.index("source_removed") < done.index("drained")
    assert done.count("drained") == 2 and done.count("config_written") == 2
    last_drained = max(i for i, x in enumerate(done) if x == "drained")
    first_config = min(i for i, x in enumerate(done) if x == "config_written")
    assert last_drained < first_config
    table = sink.read().to_pandas().sort_values("updates").groupby("auction").tail(1)
    assert joined.mismatches(pa.Table.from_pandas(table, preserve_index=False), evs) is None
    for st, _ in groups:
        await _check_wire(js, st, 8)


async def test_a_run_reads_the_lineage_after_its_sides_started(nc, js, unique_name, tmp_path,
                                                                monkeypatch) -> None:
    """The lineage is read once every side has read the work queue's last sequence (the run
    reads no further): a run that processes a message of a new epoch then always knows that
    epoch (the migration writes the lineage before the source that sources it). Read before
    the start, a migration finishing in between left a run of a new partition processing the
    new layout's messages without its keys' old state (found by the chaos migration work)."""
    import cg_pipelines.engine.context as context

    s = unique_name
    await _group(js, s, 4)
    await keyed.publish(js, s, keyed.events(n_keys=7, n_events=60))
    await _sourced(js, s, 60)
    order: list[str] = []
    real = context.get_lineage

    async def watched(*args, **kwargs):
        order.append("lineage")
        return await real(*args, **kwargs)

    monkeypatch.setattr(context, "get_lineage", watched)
    r = await run_partitions(nc, s, "g", range(4), keyed.processor(), DeltaSink(
        str(tmp_path / "t")), EngineOptions(**FAST), hook=lambda step, info: order.append(step))
    assert r.processed == 60
    assert order.count("lineage") == 1 and order.count("leased") >= 2
    assert order.index("lineage") > max(i for i, x in enumerate(order) if x == "leased"), order
