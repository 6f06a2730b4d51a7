"""Benchmark: does a partition run cost the same on an aged table as on a fresh one?

Compressed-time ageing, append + ``KeyedState`` and merge + ``KeyedState``:

1. One origin stream; per mode two elastic groups (4 partitions each) read it: ``aged`` and
   ``control``, each drained into its own local Delta table by
   :func:`cg_pipelines.engine.run_partition` (ArrowProcessor, ``KeyedState(key="k",
   columns=("total",))``, transform ``total = coalesce(last_total, 0) + v``).
2. **Ageing** (compressed time): the aged table gets ``--versions`` Delta versions of the same
   shape as the timed cycles (per partition, one commit of ``--messages / 4`` rows over that
   partition's keys), written straight through ``DeltaSink.commit`` under app ids of their own
   (``aging/<p>``) and followed, as the engine does after a run, by ``DeltaSink.maintain(p)``
   (compaction, state snapshots, VACUUM and log cleanup). No NATS round trips, so 10,000
   versions take minutes, not days; the timed part below is the real engine.

   **Time is compressed, retention with it** (the default): the ``--versions`` stand for
   ``--days`` (30) of the table's life at a steady commit rate, and the library's time-based
   defaults are scaled by the same factor (bench seconds per simulated second, from the
   ageing's own pace from version 500 to 1,000, before anything expires): the log window's
   one-hour floor (``Maintenance.log_floor_s``; its cap, ``log_max_versions``, is a count,
   not scaled) and the hourly VACUUM (``vacuum_interval_s``). The data-file retention is 0 hours:
   delta-rs' VACUUM takes whole hours, and anything under one rounds down (stricter: files on
   disk are then the live ones plus those removed since the last VACUUM). The table is past
   its first week, in the steady state a table at ~333 commits a day keeps for ever, which is
   what "day 30" means. ``--library-retention`` keeps the library's settings unscaled
   instead: the log window is then the ``log_max_versions`` cap (no reconcile cursor: the
   log is held up to the cap; the floor's hour never passes while the bench runs), while every
   data file of the 7-day vacuum retention and every tombstone of the hour's tombstone
   retention stays (a table committing 10,000 times in minutes). ``--retention-hours`` /
   ``--log-retention-s`` (time travel, ``log_retention_hours``) / ``--vacuum-interval`` set
   the three by hand.
3. **Timed cycles**, ``--cycles`` of them (default 3), interleaved: publish ``--messages``
   messages over ``--keys`` keys to the origin, then drain the 4 partitions of the aged group
   and of the control group (order alternating per cycle). A cycle's time is the sum of the 4
   runs' wall seconds (each run includes its upkeep: state snapshots, compaction when due);
   the state read is the time spent in ``DeltaSink.last_rows``. Medians are printed. The
   periodic VACUUM + log cleanup is left out of the timed runs and timed once per table
   afterwards (``upkeep s``, aged/control): in compressed time an hourly upkeep would fall
   every few runs, where a real table pays it once every few dozen (or thousand) runs.
   Before the cycles the aged table's partitions are compacted (``compact s``, all four), so
   both tables start at the same compaction phase: the ageing leaves every partition a few
   small files short of ``compact_min_files``, and the first timed runs would otherwise all
   compact, where a table of any age compacts once every ``compact_min_files`` runs.

The control table is fresh (created just before the timed cycles, one warm-up cycle).

Prints a table (mode, versions, live files (all partitions, and the most of one partition),
files on disk, log entries, log size, checkpoints, state-read seconds, seconds to load the
aged table's snapshot and read a watermark as the backlog sensor
does each tick, cycle seconds aged/control, ratio, one VACUUM + log cleanup aged/control) and
one line::

    aging: append x<ratio> at <n> versions, merge x<ratio> at <n> versions, files <live>/<on disk>,
    <n> live/partition

(``files``: live data files / data files on disk of the aged append table, all partitions.)

``--store s3``: both tables in a bucket of moto's S3 server (started in this process,
:class:`~cg_pipelines.testing.s3.MotoS3Server`) instead of local directories.
``--age-local`` (with ``--store s3``, Delta): the ageing is written to a local directory
(at local disk's pace: minutes for 10,000 versions, where moto takes about 0.25 s a commit)
and its files (data, ``_delta_log``, ``_cg_state``) are then copied into the bucket whole;
the same commits and upkeep make the same files, so the timed cycles, the compaction and the
upkeep all run on S3 against the table the ageing would have left there.
``--format iceberg``: Iceberg tables (:class:`~cg_pipelines.sinks.iceberg.IcebergSink`, an
embedded SQLite catalog, data on local disk or moto S3) aged the same way, with the library's
upkeep (compaction of a partition's 16 small files under its lease, snapshot expiry to the
newest ``keep_snapshots``, 20 by default, once more than half as many more are held); the
time-based retention flags do not apply (``--library-retention`` changes nothing for it).
Then ``log n`` is the snapshots kept, ``ckpts`` the metadata files the catalog keeps,
``log KiB`` the current metadata file, ``upkeep s`` one snapshot expiry.

Run: ``.venv/bin/python bench/aging.py [--versions 10000] [--days 30] [--messages 200]
[--keys 2000] [--cycles 3] [--modes append,merge] [--library-retention]
[--retention-hours H --log-retention-s S --vacuum-interval S] [--store local|s3]
[--age-local]``;
``--smoke``: 40 versions, 1 cycle (seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import nats
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
from deltalake import DeltaTable
from nats.js.api import StreamConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.core.decode import JsonDecoder, JsonField
from cg_pipelines.core.partitioning import SubjectPartitioner
from cg_pipelines.core.state import KeyedState
from cg_pipelines.core.write import Append, Merge
from cg_pipelines.engine import ArrowProcessor, EngineOptions, run_partition
from cg_pipelines.engine.processor import BatchContext
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.publish import publish_many
from cg_pipelines.local.nats_server import NatsServer
from cg_pipelines.sinks.base import PARTITION_COLUMN, app_id_for
from cg_pipelines.sinks.delta import DeltaSink
from cg_pipelines.sinks.iceberg import IcebergSink
from cg_pipelines.sinks.iceberg_compact import partition_files
from cg_pipelines.sinks.iceberg_expire import expiry_slack
from cg_pipelines.sinks.maintenance import Maintenance
from cg_pipelines.sinks.storage import table_filesystem

PARTS = 4
DECODER = JsonDecoder([JsonField("k", "string", nullable=False),
                       JsonField("v", "int", nullable=False)])
STATE = KeyedState(key="k", columns=("total",),
                   schema=pa.schema([("k", pa.string()), ("total", pa.int64())]))
SCHEMA = pa.schema([("k", pa.string()), ("v", pa.int64()), ("total", pa.int64()),
                    ("_seq", pa.int64()), ("_partition", pa.int32())])


def transform(table: pa.Table, ctx: BatchContext) -> pa.Table:
    """``total = coalesce(last_total, 0) + v`` (the running total's shape)."""
    total = pc.add(pc.coalesce(table["last_total"], pa.scalar(0, pa.int64())),
                   table["v"].cast(pa.int64()))
    return pa.table({"k": table["k"], "v": table["v"].cast(pa.int64()), "total": total,
                     "_seq": table["_seq"]})


S = TypeVar("S", bound=DeltaSink)
STORE: dict[str, str] = {}
"""Storage options of the tables (``--store s3``: moto's); empty: local directories."""
ICEBERG: dict[str, str] = {}
"""``--format iceberg``: the catalog's properties; empty: Delta tables."""


def open_sink(path: str, cls: type[S], **kw: Any) -> Any:
    """A ``cls`` sink of the table at ``path`` (Delta: a path, Iceberg: an identifier) with
    the bench's storage options (Iceberg: :class:`TimedIcebergSink` for :class:`TimedSink`,
    else :class:`IcebergSink`)."""
    if ICEBERG:
        kls = TimedIcebergSink if cls is TimedSink else IcebergSink
        return kls(path, catalog=dict(ICEBERG), **kw)
    return cls(path, storage_options=store_of(path), **kw)


def store_of(path: str) -> dict[str, str] | None:
    """The storage options of the Delta table at ``path``: :data:`STORE`'s for a bucket's,
    none for a local directory's (``--age-local``)."""
    return dict(STORE) if STORE and path.startswith("s3://") else None


class TimedSink(DeltaSink):
    """A DeltaSink that adds up the seconds spent reading state."""

    state_s = 0.0

    def last_rows(self, key: str, keys: Sequence[object], columns: Sequence[str],
                  order_by: str, partition: int | None = None, *,
                  app_id: str | None = None) -> pa.Table:
        t = time.perf_counter()
        try:
            return super().last_rows(key, keys, columns, order_by, partition, app_id=app_id)
        finally:
            self.state_s += time.perf_counter() - t


class TimedIcebergSink(IcebergSink):
    """An IcebergSink that adds up the seconds spent reading state."""

    state_s = 0.0

    def last_rows(self, *args: Any, **kw: Any) -> pa.Table:
        t = time.perf_counter()
        try:
            return super().last_rows(*args, **kw)
        finally:
            self.state_s += time.perf_counter() - t


def iceberg_figures(ident: str, sink: IcebergSink) -> dict[str, int | float]:
    """Versions (the last sequence number), live data files, snapshots, metadata files."""
    tbl = sink.load()
    assert tbl is not None
    counts = [len(partition_files(tbl, p)) for p in range(PARTS)]
    loads = []
    for _ in range(3):  # what the backlog sensor does each tick: load, read watermarks
        t = time.perf_counter()
        open_sink(ident, IcebergSink).watermarks(["aging/0"])
        loads.append(time.perf_counter() - t)
    on_disk = -1
    loc = tbl.location()
    if loc.startswith("file://"):
        on_disk = sum(1 for _r, _d, files in os.walk(loc[len("file://"):]) for f in files
                      if f.endswith(".parquet"))
    meta = tbl.metadata_location
    size = 0
    if meta.startswith("file://"):
        size = os.path.getsize(meta[len("file://"):])
    return {"versions": sink.stats().version, "live": sum(counts), "live_part": max(counts),
            "log_entries": len(tbl.snapshots()), "on_disk": on_disk, "log_bytes": size,
            "checkpoints": len(tbl.metadata.metadata_log) + 1,
            "load_s": statistics.median(loads)}


def table_figures(path: str, sink: DeltaSink) -> dict[str, int]:
    """Versions, live data files, data files on disk, log bytes, checkpoints."""
    fs = table_filesystem(path, STORE)
    assert fs is not None
    on_disk = sum(1 for i in fs.get_file_info(pafs.FileSelector("", recursive=True))
                  if i.path.endswith(".parquet") and not i.path.startswith(("_delta_log",
                                                                           "_cg_state")))
    entries = fs.get_file_info(pafs.FileSelector("_delta_log"))
    loads = []
    for _ in range(3):  # what the backlog sensor does each tick: load, read watermarks
        t = time.perf_counter()
        open_sink(path, DeltaSink).watermarks(["aging/0"])
        loads.append(time.perf_counter() - t)
    parts = [u.split(f"{PARTITION_COLUMN}=")[1].split("/")[0] for u in sink.file_uris()]
    return {"versions": sink.stats().version, "live": len(parts),
            "live_part": max((parts.count(p) for p in set(parts)), default=0),
            "log_entries": len(entries),
            "on_disk": on_disk, "log_bytes": sum(e.size or 0 for e in entries),
            "checkpoints": sum(1 for e in entries if ".checkpoint." in e.base_name),
            "load_s": statistics.median(loads)}


DAY_S = 86_400.0
KEEP_SNAPSHOTS = inspect.signature(IcebergSink).parameters["keep_snapshots"].default
LIBRARY = Maintenance()


def compressed(args: argparse.Namespace) -> bool:
    """Whether the retention is the library's in compressed time (the default)."""
    return not args.library_retention and args.retention_hours is None \
        and args.log_retention_s is None and args.vacuum_interval is None


def maintenance(args: argparse.Namespace, seconds_per_version: float) -> Maintenance:
    """The aged and control tables' upkeep: the library's retention in compressed time (see
    the module docstring), the library's own (``--library-retention``), or set by hand."""
    if args.library_retention:
        return LIBRARY if args.tombstone_hours is None else replace(
            LIBRARY, tombstone_retention_hours=args.tombstone_hours)
    if not compressed(args):
        return Maintenance(
            vacuum_retention_hours=168 if args.retention_hours is None else args.retention_hours,
            vacuum_interval_s=3600.0 if args.vacuum_interval is None else args.vacuum_interval,
            log_retention_hours=None if args.log_retention_s is None
            else args.log_retention_s / 3600)
    scale = seconds_per_version * args.versions / (args.days * DAY_S)
    return Maintenance(vacuum_retention_hours=0,
                       vacuum_interval_s=LIBRARY.vacuum_interval_s * scale,
                       log_floor_s=LIBRARY.log_floor_s * scale)


def retention_line(pol: Maintenance, args: argparse.Namespace) -> str:
    """What the upkeep keeps, in bench seconds and (compressed) in simulated time."""
    if ICEBERG:
        return (f"iceberg upkeep: compaction at {pol.compact_min_files} small files "
                f"(< {pol.target_size >> 20} MiB), the newest {KEEP_SNAPSHOTS} snapshots kept "
                f"(expired once over {KEEP_SNAPSHOTS + expiry_slack(KEEP_SNAPSHOTS)})")
    travel = ("none" if pol.log_retention_hours is None
              else f"{pol.log_retention_hours * 3600:,.1f} s")
    line = (f"log window: floor {pol.log_floor_s:,.1f} s, cap {pol.log_max_versions} versions, "
            f"cleaned every {pol.log_cleanup_versions} versions, time travel {travel}; "
            f"VACUUM every {pol.vacuum_interval_s:,.1f} s, data-file retention "
            f"{pol.vacuum_retention_hours} h")
    if not compressed(args):
        return line
    return (f"{line} (compressed time: {args.versions:,} versions = {args.days:g} days, so "
            f"an hour's floor and hourly upkeep)")


def age(sink: DeltaSink, keys_of: dict[int, list[str]], versions: int, per_part: int,
        seed: int, quiet: bool = False) -> None:
    """Commit one batch per partition, maintain it, until the table has ``versions``
    (going on from the partitions' watermarks)."""
    rnd = random.Random(seed)
    seq = {p: sink.watermark(f"aging/{p}") for p in range(PARTS)}
    totals: dict[str, int] = {}
    t0, last_print = time.monotonic(), 0.0
    while True:
        for p in range(PARTS):
            ks = [rnd.choice(keys_of[p]) for _ in range(per_part)]
            vs = [rnd.randrange(100) for _ in ks]
            tot = []
            for k, v in zip(ks, vs, strict=True):
                totals[k] = totals.get(k, 0) + v
                tot.append(totals[k])
            first = seq[p] + 1
            seq[p] += per_part
            batch = pa.table([ks, vs, tot, list(range(first, seq[p] + 1)), [p] * per_part],
                             schema=SCHEMA)
            app = f"aging/{p}"
            sink.commit(batch, {app: (first - 1, seq[p])})
            sink.maintain(p, app)
        version = sink.stats().version
        if not quiet and time.monotonic() - last_print > 30:
            last_print = time.monotonic()
            print(f"  ageing {sink.write.name}: {version:,} versions "
                  f"({time.monotonic() - t0:,.0f} s)", flush=True)
        if version >= versions:
            return


def compact_all(path: str, write: Append | Merge, pol: Maintenance) -> float:
    """Compact every partition's small files (2 or more) as the ageing's holder of each
    partition would; returns the seconds it took."""
    sink = open_sink(path, DeltaSink, write=write, schema=SCHEMA,
                     maintenance=replace(pol, compact_min_files=2))
    t = time.perf_counter()
    for p in range(PARTS):
        figures = sink.maintain(p, f"aging/{p}")
        assert "error" not in figures, figures
    return time.perf_counter() - t


def upkeep_seconds(path: str, write: Append | Merge, pol: Maintenance, app_id: str) -> float:
    """Seconds of one VACUUM + log cleanup of the table (what ``maintain`` adds once per
    ``vacuum_interval_s``), with ``pol``'s retention."""
    sink = open_sink(path, DeltaSink, write=write, schema=SCHEMA, maintenance=replace(
        pol, vacuum_interval_s=0.0, compact=False, snapshots=False))
    t = time.perf_counter()
    figures = sink.maintain(0, app_id)
    assert "error" not in figures, figures
    return time.perf_counter() - t


async def publish(nc: nats.NATS, stream: str, n: int, keys: int, rnd: random.Random) -> None:
    ks = [f"k{rnd.randrange(keys)}" for _ in range(n)]
    await publish_many(nc, [f"{stream}.{k}" for k in ks],
                       [json.dumps({"k": k, "v": rnd.randrange(100)}).encode() for k in ks],
                       stream=stream)


async def wait_for(api: JetStreamAPI, wq: str, messages: int) -> None:
    deadline = time.monotonic() + 30
    while int((await api.stream_info(wq))["state"]["messages"]) < messages:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{wq} never held {messages} messages")
        await asyncio.sleep(0.05)


async def drain(nc: nats.NATS, stream: str, group: str, sink: Any,
                steps: dict[str, float]) -> tuple[float, float]:
    """Drain the group's 4 partitions; (seconds, state-read seconds); adds the runs' step
    timings into ``steps``."""
    sink.state_s = 0.0
    t = time.perf_counter()
    for p in range(PARTS):
        res = await run_partition(nc, stream, group, p, ArrowProcessor(
            DECODER, transform, state=STATE), sink, EngineOptions(batch_max_msgs=10_000))
        assert res.status in ("drained", "empty"), res
        for k, v in res.timings.items():
            steps[k] = steps.get(k, 0.0) + v
    return time.perf_counter() - t, sink.state_s


async def run_mode(nc: nats.NATS, tmp: str, mode: str, args: argparse.Namespace,
                   rnd: random.Random, local: str) -> dict[str, float | int | str]:
    stream = f"AGE{mode.upper()}"
    js = nc.jetstream(timeout=30)
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    config = ElasticConfig(PARTS, (PartitioningFilter(f"{stream}.*", (1,)),), members=("m1",))
    for group in ("aged", "control"):
        await admin.create_elastic(js, stream, group, config)
    part = SubjectPartitioner(config)
    keys_of: dict[int, list[str]] = {p: [] for p in range(PARTS)}
    for i in range(args.keys):
        p = part(f"{stream}.k{i}")
        assert p is not None
        keys_of[p].append(f"k{i}")
    write = Merge(key="k") if mode == "merge" else Append()
    paths = {g: f"cg.{mode}_{g}" if ICEBERG else f"{tmp}/{mode}-{g}"
             for g in ("aged", "control")}
    per_part = args.messages // PARTS
    aged_at = paths["aged"]
    if args.age_local and STORE and not ICEBERG:
        paths["aged"] = f"{local}/{mode}-aged"  # aged here, copied to aged_at below
    t = time.monotonic()
    # in threads: the event loop keeps answering the server's pings meanwhile
    if compressed(args) and not ICEBERG:
        # The ageing's own pace, versions 500 to 1,000 with nothing expiring (the log then
        # holds about what the compressed window will), sets the time scale; then the table
        # gets the scaled retention and ages on.
        calib = min(1_000, args.versions // 2)
        first = open_sink(paths["aged"], TimedSink, write=write, schema=SCHEMA,
                          maintenance=LIBRARY)
        await asyncio.to_thread(age, first, keys_of, calib // 2, per_part, rnd.randrange(1 << 30))
        v0, t0 = first.stats().version, time.perf_counter()
        await asyncio.to_thread(age, first, keys_of, calib, per_part, rnd.randrange(1 << 30))
        pol = maintenance(args, (time.perf_counter() - t0) / max(1, first.stats().version - v0))
        aged_table = DeltaTable(paths["aged"], storage_options=store_of(paths["aged"]))
        aged_table.alter.set_table_properties(pol.table_properties())
    else:
        pol = LIBRARY if ICEBERG else maintenance(args, 0.0)
    print(f"  {mode}: {retention_line(pol, args)}", flush=True)
    sinks = {g: open_sink(paths[g], TimedSink, write=write, schema=SCHEMA, maintenance=pol)
             for g in ("aged", "control")}
    await asyncio.to_thread(age, sinks["aged"], keys_of, args.versions, per_part,
                            rnd.randrange(1 << 30))
    print(f"  aged {mode} to {sinks['aged'].stats().version:,} versions in "
          f"{time.monotonic() - t:,.0f} s", flush=True)
    if paths["aged"] != aged_at:
        t = time.monotonic()
        dest = table_filesystem(aged_at, STORE)
        assert dest is not None, aged_at
        pafs.copy_files(paths["aged"], "", destination_filesystem=dest, use_threads=True)
        print(f"  copied the aged {mode} table to {aged_at} in {time.monotonic() - t:,.0f} s",
              flush=True)
        paths["aged"] = aged_at
    # The timed runs do no VACUUM / log cleanup (timed once each below): in compressed time
    # the hourly upkeep would fall every few runs instead of every few dozen or thousand.
    timed_pol = replace(pol, vacuum_interval_s=float("inf"))
    # Same compaction phase as the fresh control: the ageing leaves every partition a few
    # small files short of compaction, so the first timed runs would all compact (once every
    # compact_min_files runs in steady state, on day 1 as on day 30); compact them now.
    compact_s = await asyncio.to_thread(compact_all, paths["aged"], write, timed_pol)
    sinks = {g: open_sink(paths[g], TimedSink, write=write, schema=SCHEMA,
                          maintenance=timed_pol) for g in ("aged", "control")}
    api = JetStreamAPI(nc)
    published = 0
    times: dict[str, list[float]] = {"aged": [], "control": []}
    steps: dict[str, dict[str, float]] = {"aged": {}, "control": {}}
    state_s: list[float] = []
    try:
        for cycle in range(args.cycles + 1):  # cycle 0 warms both up (not timed)
            await publish(nc, stream, args.messages, args.keys, rnd)
            published += args.messages
            for g in ("aged", "control"):
                await wait_for(api, f"{stream}-{g}", args.messages)
            order = ["aged", "control"] if cycle % 2 == 0 else ["control", "aged"]
            for g in order:
                seconds, state = await drain(nc, stream, g, sinks[g],
                                             steps[g] if cycle else {})
                if cycle:
                    times[g].append(seconds)
                    if g == "aged":
                        state_s.append(state)
    finally:
        await api.close()
    aged, control = (statistics.median(times[g]) for g in ("aged", "control"))
    for g in ("aged", "control"):  # where a cycle's time goes (per cycle, all partitions)
        print(f"  {mode} {g} steps/cycle: " + ", ".join(
            f"{k} {v / args.cycles:.3f}" for k, v in sorted(steps[g].items())), flush=True)
    upkeep = {g: upkeep_seconds(paths[g], write, pol, app_id_for(stream, g, 0))
              for g in ("aged", "control")}
    figs = (iceberg_figures if ICEBERG else table_figures)(paths["aged"], sinks["aged"])
    return {**figs, "state_s": statistics.median(state_s), "aged_s": aged,
            "control_s": control, "ratio": aged / control, "policy": retention_line(pol, args),
            "upkeep_aged_s": upkeep["aged"], "upkeep_control_s": upkeep["control"],
            "compact_s": compact_s}


async def main(args: argparse.Namespace) -> None:
    rnd = random.Random(7)
    results: dict[str, dict[str, float | int | str]] = {}
    with tempfile.TemporaryDirectory() as tmp, NatsServer(Path(tmp) / "nats", port=0) as srv, \
            contextlib.ExitStack() as stack:
        root = tmp
        if args.store == "s3":
            from cg_pipelines.testing.s3 import MotoS3Server

            s3 = stack.enter_context(MotoS3Server())
            root = s3.create_bucket("cg-aging")
            STORE.update(s3.storage_options())
        if args.format == "iceberg":
            from cg_pipelines.sinks.iceberg import iceberg_s3_properties
            from cg_pipelines.sinks.iceberg_read import sqlite_wal

            sqlite_wal(f"{tmp}/catalog.db")
            ICEBERG.update({"type": "sql", "uri": f"sqlite:///{tmp}/catalog.db",
                            "init_catalog_tables": "true",
                            "warehouse": f"{root}/wh" if STORE else f"file://{tmp}/wh",
                            **iceberg_s3_properties(STORE)})
        nc = await nats.connect(srv.url)
        try:
            for mode in args.modes.split(","):
                results[mode] = await run_mode(nc, root, mode, args, rnd, tmp)
        finally:
            await nc.close()
    print(f"store: {args.store}" + (", aged on local disk and copied" if args.age_local else "")
          + f", format: {args.format}")
    print(f"{args.messages} messages over {args.keys:,} keys a cycle, {PARTS} partitions, "
          f"medians of {args.cycles} interleaved cycles; compaction at "
          f"{LIBRARY.compact_min_files} small files")
    for mode, r in results.items():
        print(f"  {mode}: {r['policy']}")
    print(f"{'mode':<7}{'versions':>9}{'live':>6}{'/part':>6}{'on disk':>9}{'log n':>7}"
          f"{'log KiB':>9}{'ckpts':>7}"
          f"{'state s':>9}{'load s':>8}{'aged s':>8}{'ctrl s':>8}{'ratio':>7}"
          f"{'upkeep s':>16}{'compact s':>10}")
    for mode, r in results.items():
        print(f"{mode:<7}{r['versions']:>9,}{r['live']:>6}{r['live_part']:>6}{r['on_disk']:>9,}"
              f"{r['log_entries']:>7,}{r['log_bytes'] / 1024:>9,.0f}{r['checkpoints']:>7}"
              f"{r['state_s']:>9.3f}"
              f"{r['load_s']:>8.3f}"
              f"{r['aged_s']:>8.3f}{r['control_s']:>8.3f}{r['ratio']:>7.2f}"
              f"{r['upkeep_aged_s']:>9.3f}/{r['upkeep_control_s']:.3f}"
              f"{r['compact_s']:>10.3f}")
    parts = [f"{m} x{r['ratio']:.2f} at {r['versions']:,} versions" for m, r in results.items()]
    files = results.get("append") or next(iter(results.values()))
    print(f"aging: {', '.join(parts)}, files {files['live']}/{files['on_disk']}, "
          f"{max(r['live_part'] for r in results.values())} live/partition")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--versions", type=int, default=10_000)
    ap.add_argument("--messages", type=int, default=200)
    ap.add_argument("--keys", type=int, default=2_000)
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--modes", default="append,merge")
    ap.add_argument("--days", type=float, default=30.0,
                    help="simulated days the versions stand for (compressed time)")
    ap.add_argument("--library-retention", action="store_true",
                    help="the library's retention unscaled: nothing expires during the run")
    ap.add_argument("--retention-hours", type=int, default=None)
    ap.add_argument("--tombstone-hours", type=float, default=None,
                    help="with --library-retention: Maintenance.tombstone_retention_hours")
    ap.add_argument("--vacuum-interval", type=float, default=None)
    ap.add_argument("--log-retention-s", type=float, default=None)
    ap.add_argument("--format", choices=["delta", "iceberg"], default="delta")
    ap.add_argument("--store", choices=["local", "s3"], default="local",
                    help="s3: the tables in moto's S3 server (in this process)")
    ap.add_argument("--age-local", action="store_true",
                    help="with --store s3: age on local disk, then copy the table to S3")
    ap.add_argument("--smoke", action="store_true", help="40 versions, 1 cycle")
    a = ap.parse_args()
    if a.smoke:
        a.versions, a.cycles = 40, 1
    asyncio.run(main(a))
