"""A partition's range into Spark: read on the driver or on the executors — where is the crossover?

    .venv/bin/python bench/spark_read.py [--sizes 20000,100000,400000] [--noise-every 4]
                                         [--rounds 3] [--master local[2]] [--cluster]
                                         [--partitions 0] [--batch 50000] [--no-steps]
                                         [--drain] [--smoke]

Starts its own nats-server (temp store, random port; stopped at the end) and a Spark session
(``--master``, default ``local[2]``; ``--cluster``: a standalone master with two 1-core workers
on 127.0.0.1, :class:`~cg_pipelines.local.spark_cluster.SparkStandaloneCluster`). Publishes
flights-like events (the fields of :data:`flights.data.DECODER` plus two descriptive strings,
about 250 bytes) to ``flights.<carrier>.<tail>`` of an origin stream with an elastic group of 4
partitions (partitioned on the tail number), so the work queue holds what a real one does
(sourced messages with a ``Nats-Stream-Source`` header); partition 0 gets ``max(sizes)``
messages, and one message in ``--noise-every`` goes to partitions 1-3 instead. For each size
``k`` the range is partition 0's first ``k`` messages (``[1, seq of the k-th]``, filter
``0.>``), read and decoded with ``validate_subject`` as the engine does, by:

(a) ``driver``: the engine's driver read (``rangeread.read_range``, one batched direct get cut
    into Arrow in bulk) + ``decode_batch`` on the driver + ``spark.createDataFrame``;
(b) ``executors``: the ``jetstream`` data source (``--partitions`` input partitions, default
    the session's default parallelism; ``--batch`` messages per direct get) + the same decoder
    on the executors (``mapInArrow``, :meth:`SparkProcessor.process_range`'s decode step);

each ended by the same action (count, sum of a column, max ``_seq``; checked), so every row
has reached Spark. Unless ``--no-steps``, also the engine's whole batch step on the flights
``legs`` transform (state declared, none committed; result collected as Arrow):

(c) ``driver step``: ``read_range`` + ``SparkProcessor.process`` (one batch of ``k``: the
    driver path's best case — a real drain cuts it into 20k-200k batches);
(d) ``executor step``: ``SparkProcessor.process_range`` (read, decode, cache and facts job,
    state broadcast, transform, collect).

With ``--drain``, also whole engine runs (``run_partition`` into a Delta table, flights
``legs``) of partition 0's whole backlog (``max(sizes)`` messages): (e) the driver path with the
Dagster defaults (batches of 20k growing to 200k, read/commit pipelined), (f) the executor read
(``executor_read_min_msgs=1``: one batch), (g) the driver path in one batch
(``batch_max_msgs`` = the backlog: what (f) gains by being one batch, not by where it reads).
Each run drains its own elastic group (``--rounds`` x 3 groups on the same origin stream, all
sourced before the first run).

Rounds are interleaved (every path of every size in each round, the order alternating) after a
warm-up round; the median of ``--rounds`` is reported, with min-max. Also measured: the driver
read alone, one executor's read alone (data source, 1 input partition, ``count``) and the fixed
cost of an executor read (a 100-message range) — the figures that explain the crossover.

``--smoke``: one size, 2,000, one round, each explaining figure measured once (checks the
script runs; figures meaningless).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# The executors' Python workers import flights.data (validate_subject) too.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)

import nats  # noqa: E402
import pyarrow as pa  # noqa: E402
from nats.js.api import StreamConfig  # noqa: E402
from pyspark.sql import DataFrame, SparkSession  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402
from pyspark.sql.pandas.types import to_arrow_schema  # noqa: E402

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter  # noqa: E402
from cg_pipelines.core.record import RECORD_SCHEMA  # noqa: E402
from cg_pipelines.core.subjects import partition_for  # noqa: E402
from cg_pipelines.engine.options import EngineOptions  # noqa: E402
from cg_pipelines.engine.processing import decode_batch  # noqa: E402
from cg_pipelines.engine.processor import BatchContext  # noqa: E402
from cg_pipelines.engine.result import RunResult  # noqa: E402
from cg_pipelines.engine.runner import run_partition  # noqa: E402
from cg_pipelines.engine.state import KeyStateCache  # noqa: E402
from cg_pipelines.jetstream import admin  # noqa: E402
from cg_pipelines.jetstream.api import JetStreamAPI  # noqa: E402
from cg_pipelines.jetstream.publish import publish_many  # noqa: E402
from cg_pipelines.jetstream.rangeread import read_range  # noqa: E402
from cg_pipelines.local.nats_server import NatsServer  # noqa: E402
from cg_pipelines.sinks.delta import DeltaSink  # noqa: E402
from cg_pipelines.spark.processor import (  # noqa: E402
    _DEAD,
    RANGE_READ_BATCH,
    SparkProcessor,
    _decoded_spark_schema,
    _ExecutorDecode,
    read_range_with_spark,
)
from cg_pipelines.spark.session import get_spark, session_start_seconds, stop_spark  # noqa: E402
from flights.data import DECODER, LEGS_SCHEMA, validate_subject  # noqa: E402
from flights.legs import LEG_STATE, legs_transform  # noqa: E402

STREAM, GROUP, PARTS = "flights", "bench", 4
WQ = f"{STREAM}-{GROUP}"
CARRIERS = ["UA", "AA", "B6", "DL", "EV", "MQ", "US", "WN", "VX", "FL", "AS", "9E", "F9", "HA"]
AIRPORTS = ["EWR", "JFK", "LGA", "ATL", "ORD", "LAX", "SFO", "BOS", "MCO", "CLT", "MIA", "DFW"]


def tails(zero: bool, n: int) -> list[str]:
    """``n`` tail numbers of partition 0 (``zero``) or of the other partitions."""
    out, i = [], 0
    while len(out) < n:
        t = f"N{i:05d}"
        if (partition_for([t], PARTS) == 0) == zero:
            out.append(t)
        i += 1
    return out


def event(i: int, tail: str) -> tuple[str, bytes]:
    carrier = CARRIERS[i % len(CARRIERS)]
    day = i // 900
    body = {
        "carrier": carrier, "flight": 100 + i % 4000, "tailnum": tail, "year": 2013,
        "month": 1 + (day // 28) % 12, "day": 1 + day % 28,
        "origin": AIRPORTS[i % 3], "dest": AIRPORTS[3 + i % 9],
        "sched_dep_time": 500 + (i * 7) % 1800 // 60 * 100 + (i * 7) % 60,
        "dep_delay": (i * 13) % 90 - 10, "arr_time": (900 + i * 11) % 2400 // 100 * 100 + i % 60,
        "arr_delay": (i * 17) % 120 - 20, "distance": 200 + (i * 37) % 2500,
        "time_hour": f"2013-{1 + (day // 28) % 12:02d}-{1 + day % 28:02d}T{5 + i % 18:02d}:00:00Z",
        "name": "Regional carrier, scheduled service",
    }
    return f"flights.{carrier}.{tail}", json.dumps(body, separators=(",", ":")).encode()


async def add_groups(url: str, groups: list[str], total: int) -> None:
    """More elastic groups on the origin stream, each with all ``total`` messages sourced."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream(timeout=30)
        api = JetStreamAPI.from_js(js)
        for g in groups:
            await admin.create_elastic(js, STREAM, g, ElasticConfig(
                PARTS, (PartitioningFilter("flights.*.*", (2,)),), members=("m1",)))
        for g in groups:
            for _ in range(3000):
                if (await api.stream_info(f"{STREAM}-{g}"))["state"]["messages"] >= total:
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError(f"group {g} did not source {total} messages")
    finally:
        await nc.close()


DRAINS = {"e": "(e) drain, driver path (20k-200k batches)",
          "f": "(f) drain, executor read (one batch)",
          "g": "(g) drain, driver path (one batch)"}


async def drain(url: str, group: str, path: str, spark: SparkSession, table: str,
                batch: int, backlog: int, limit: int | None = None) -> RunResult:
    """One engine run of partition 0 of ``group`` into a fresh Delta table (``path``: a key
    of :data:`DRAINS`; ``limit``: ``max_messages``, for a warm-up)."""
    proc = SparkProcessor(DECODER, legs_transform, state=LEG_STATE, validate=validate_subject,
                          schema=LEGS_SCHEMA, spark=spark, read_options={"batch": batch})
    if path == "g":
        opts = EngineOptions(batch_max_msgs=backlog, batch_max_bytes=1 << 40, max_messages=limit)
    else:
        opts = EngineOptions(batch_max_msgs=20_000, adaptive_max_msgs=200_000,
                             executor_read_min_msgs=1 if path == "f" else None,
                             max_messages=limit)
    nc = await nats.connect(url)
    try:
        return await run_partition(nc, STREAM, group, 0, proc, DeltaSink(table), opts)
    finally:
        await nc.close()


async def publish(url: str, n: int, noise_every: int) -> tuple[list[int], float]:
    """Publish; returns the work-queue sequence of each partition-0 message, in order, and
    the average payload size."""
    mine, other = tails(True, 4000), tails(False, 3000)
    subjects, payloads, seqs = [], [], []
    i = 0
    while len(seqs) < n:
        noise = noise_every > 0 and i % noise_every == noise_every - 1
        s, p = event(i, other[i % len(other)] if noise else mine[(i * 7) % len(mine)])
        subjects.append(s)
        payloads.append(p)
        if not noise:
            seqs.append(i + 1)  # the work queue sources the stream in order from 1
        i += 1
    nc = await nats.connect(url)
    try:
        js = nc.jetstream(timeout=30)
        await js.add_stream(StreamConfig(name=STREAM, subjects=["flights.>"]))
        await admin.create_elastic(js, STREAM, GROUP, ElasticConfig(
            PARTS, (PartitioningFilter("flights.*.*", (2,)),), members=("m1",)))
        await publish_many(nc, subjects, payloads, stream=STREAM)
        api = JetStreamAPI.from_js(js)
        for _ in range(1200):
            state = (await api.stream_info(WQ))["state"]
            if state["messages"] >= len(payloads):
                break
            await asyncio.sleep(0.1)
        assert state["messages"] == len(payloads) and state["last_seq"] == len(payloads), state
        assert partition_for([mine[0]], PARTS) == 0
    finally:
        await nc.close()
    return seqs, sum(len(p) for p in payloads) / len(payloads)


def action(df: DataFrame) -> tuple[int, int]:
    row = df.agg(F.count(F.lit(1)).alias("n"), F.sum("distance").alias("d"),
                 F.max("_seq").alias("s")).first()
    return int(row["n"]), int(row["s"] or 0)


class Bench:
    def __init__(self, spark: SparkSession, url: str, seqs: list[int], partitions: int,
                 batch: int) -> None:
        self.spark, self.url, self.seqs = spark, url, seqs
        self.partitions, self.batch = partitions, batch
        self.loop = asyncio.new_event_loop()
        self.nc = self.loop.run_until_complete(nats.connect(url))
        self.schema = _decoded_spark_schema(DECODER)
        self.step = _ExecutorDecode(DECODER, validate_subject,
                                    to_arrow_schema(self.schema, timezone="UTC"))
        self.proc = SparkProcessor(DECODER, legs_transform, state=LEG_STATE,
                                   validate=validate_subject, spark=spark,
                                   read_options={"partitions": partitions, "batch": batch})
        self.split: dict[str, float] = {}

    def close(self) -> None:
        self.loop.run_until_complete(self.nc.close())
        self.loop.close()

    def last(self, k: int) -> int:
        return self.seqs[k - 1]

    def read(self, k: int) -> pa.Table:
        got = self.loop.run_until_complete(read_range(
            self.nc, WQ, 1, filter_subject="0.>", prefix="0.", max_msgs=k, max_bytes=1 << 40,
            last_seq=self.last(k), timeout_s=30, drop_nats_headers=True))
        return got.table(origin=True).cast(RECORD_SCHEMA)

    # (a)
    def driver(self, k: int) -> None:
        t = time.perf_counter()
        records = self.read(k)
        t1 = time.perf_counter()
        good, dead = decode_batch(records, DECODER, validate_subject)
        t2 = time.perf_counter()
        got = action(self.spark.createDataFrame(good))
        t3 = time.perf_counter()
        assert got == (k, self.last(k)) and not dead, (got, k, len(dead))
        self.split = {"read": t1 - t, "decode": t2 - t1, "spark": t3 - t2}

    def source(self, k: int, partitions: int | None = None) -> DataFrame:
        return read_range_with_spark(self.spark, self.url, WQ, "0.>", 1, self.last(k),
                                     partitions or self.partitions, strip_partition=True,
                                     batch=self.batch)

    # (b)
    def executors(self, k: int) -> None:
        df = self.source(k).mapInArrow(self.step, self.schema).filter(F.col(_DEAD).isNull())
        got = action(df)
        assert got == (k, self.last(k)), (got, k)

    def ctx(self, k: int) -> BatchContext:
        cache = KeyStateCache(LEG_STATE, lambda keys: LEG_STATE.empty())
        return BatchContext(STREAM, GROUP, 0, f"{STREAM}/{GROUP}/0", 1, self.last(k),
                            None, cache)  # type: ignore[arg-type]

    # (c)
    def driver_step(self, k: int) -> None:
        out = self.proc.process(self.read(k), self.ctx(k))
        assert out.table is not None and out.table.num_rows == k and not out.dead

    # (d)
    def executor_step(self, k: int) -> None:
        source = {"servers": self.url, "stream": WQ, "subject": "0.>", "first_seq": "1",
                  "last_seq": str(self.last(k)), "strip_partition": "true", "timeout": "30"}
        got = self.proc.process_range(source, self.ctx(k))
        table = got.processed.table
        assert table is not None and table.num_rows == k and got.messages == k
        assert got.last_seq == self.last(k)

    # explanations
    def driver_read_only(self, k: int) -> None:
        assert self.read(k).num_rows == k

    def one_executor_read(self, k: int) -> None:
        assert self.source(k, partitions=1).count() == k


def timed(fn: Callable[[int], None], k: int) -> float:
    t = time.perf_counter()
    fn(k)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="20000,100000,400000")
    ap.add_argument("--noise-every", type=int, default=4,
                    help="one message in N goes to partitions 1-3 (0: none)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--cluster", action="store_true",
                    help="a standalone cluster of two 1-core workers instead of --master")
    ap.add_argument("--partitions", type=int, default=0,
                    help="input partitions of the executor read (0: default parallelism)")
    ap.add_argument("--batch", type=int, default=RANGE_READ_BATCH,
                    help="messages per executor direct get")
    ap.add_argument("--no-steps", action="store_true", help="skip the engine step paths")
    ap.add_argument("--drain", action="store_true",
                    help="also whole engine runs of the largest backlog, driver vs executors")
    ap.add_argument("--smoke", action="store_true",
                    help="size 2,000, one round, explaining figures measured once")
    a = ap.parse_args()
    reps, reps_fixed = 3, 5  # repeats of the explaining figures, of the fixed cost
    if a.smoke:
        a.sizes, a.rounds, reps, reps_fixed = "2000", 1, 1, 1
    sizes = sorted(int(s) for s in a.sizes.split(",") if s.strip())

    # Whatever fails, the stack stops what was started: the bench's connection, the Spark
    # session, the cluster (last in, first out), then the nats-server.
    with tempfile.TemporaryDirectory() as d, NatsServer(Path(d)) as srv, \
            contextlib.ExitStack() as stack:
        t0 = time.perf_counter()
        seqs, avg = asyncio.run(publish(srv.url, sizes[-1], a.noise_every))
        print(f"published {len(seqs):,} events on partition 0 ({avg:.0f} B avg payload) + "
              f"{seqs[-1] - len(seqs):,} on partitions 1-3; work queue sourced in "
              f"{time.perf_counter() - t0:.1f} s")
        master = a.master
        if a.cluster:
            from cg_pipelines.local.spark_cluster import SparkStandaloneCluster

            cluster = SparkStandaloneCluster(workers=2, cores=1, memory="2g").start()
            stack.callback(cluster.stop)
            master = cluster.master_url
        drain_groups = [f"dr{i}" for i in range(3 * a.rounds + 1)] if a.drain else []
        if drain_groups:
            t0 = time.perf_counter()
            asyncio.run(add_groups(srv.url, drain_groups, seqs[-1]))
            print(f"{len(drain_groups)} more groups for the drains sourced in "
                  f"{time.perf_counter() - t0:.1f} s")
        stack.callback(stop_spark)
        spark = get_spark(master, app_name="bench-spark-read")
        parts = a.partitions or spark.sparkContext.defaultParallelism
        print(f"spark {master}: session start {session_start_seconds() or 0:.1f} s; executor "
              f"read with {parts} input partitions, {a.batch} messages per direct get")
        b = Bench(spark, srv.url, seqs, parts, a.batch)
        stack.callback(b.close)
        paths: list[tuple[str, Callable[[int], None]]] = [
            ("(a) driver: read_range + decode + createDataFrame", b.driver),
            ("(b) executors: data source + decode (mapInArrow)", b.executors)]
        if not a.no_steps:
            paths += [("(c) driver step: read_range + process (legs)", b.driver_step),
                      ("(d) executor step: process_range (legs)", b.executor_step)]
        for _, fn in paths:  # warm-up: Python workers, planning, first use
            fn(min(sizes[0], 5000))
        times: dict[tuple[str, int], list[float]] = {}
        splits: dict[int, list[dict[str, float]]] = {}
        for r in range(a.rounds):
            for k in sizes:
                order = paths if (r + sizes.index(k)) % 2 == 0 else paths[::-1]
                for name, fn in order:
                    times.setdefault((name, k), []).append(timed(fn, k))
                    if fn == b.driver:
                        splits.setdefault(k, []).append(dict(b.split))
            print(f"round {r + 1}/{a.rounds} done", flush=True)
        drains: dict[str, list[RunResult]] = {name: [] for name in DRAINS.values()}
        if drain_groups:  # warm-up: the engine's and Delta's first use (2,000 messages)
            asyncio.run(drain(srv.url, drain_groups.pop(0), "e", spark,
                              str(Path(d) / "legs-warm-up"), a.batch, len(seqs), 2000))
        for r in range(a.rounds if a.drain else 0):
            for path in ("efg" if r % 2 == 0 else "gfe"):
                group = drain_groups.pop(0)
                res = asyncio.run(drain(srv.url, group, path, spark,
                                        str(Path(d) / f"legs-{group}"), a.batch, len(seqs)))
                assert res.status == "drained" and res.processed == len(seqs), res
                drains[DRAINS[path]].append(res)
            print(f"drain round {r + 1}/{a.rounds} done", flush=True)
        # The figures that explain it.
        k = sizes[-1]
        read_only = statistics.median(timed(b.driver_read_only, k) for _ in range(reps))
        one_exec = statistics.median(timed(b.one_executor_read, k) for _ in range(reps))
        fixed = statistics.median(timed(b.executors, 100) for _ in range(reps_fixed))

    width = max(len(n) for n in [*(n for n, _ in paths), *(drains if a.drain else ())])
    print(f"\n{'path':<{width}}  {'messages':>8}  {'median s':>8}  {'msg/s':>9}  min-max s")
    for k in sizes:
        for name, _ in paths:
            ts = times[(name, k)]
            med = statistics.median(ts)
            note = ""
            if name.startswith("(a)"):
                sp = {p: statistics.median(s[p] for s in splits[k]) for p in splits[k][0]}
                note = "  (" + ", ".join(f"{p} {v:.2f}" for p, v in sp.items()) + ")"
            print(f"{name:<{width}}  {k:>8,}  {med:>8.2f}  {k / med:>9,.0f}  "
                  f"{min(ts):.2f}-{max(ts):.2f}{note}")
    print(f"\ndriver read alone ({k:,} msgs): {k / read_only:,.0f} msg/s; one executor's read "
          f"(data source, 1 input partition, count): {k / one_exec:,.0f} msg/s; an executor "
          f"read of 100 messages (fixed cost): {fixed:.2f} s")
    for name, runs in drains.items():
        if not runs:
            continue
        secs = [r.seconds for r in runs]
        med = statistics.median(secs)
        mid = sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]
        parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(mid.timings.items()) if v >= 0.05)
        print(f"{name:<{width}}  {len(seqs):>8,}  {med:>8.2f}  {len(seqs) / med:>9,.0f}  "
              f"{min(secs):.2f}-{max(secs):.2f}  ({mid.commits} commits; {parts})")
    if all(drains.values()):
        med = {k: statistics.median(r.seconds for r in drains[v]) for k, v in DRAINS.items()}
        print(f"drain of {len(seqs):,}: driver (20k-200k batches)/executors "
              f"{med['e'] / med['f']:.2f}, driver (one batch)/executors {med['g'] / med['f']:.2f}"
              " (> 1: the executor read is faster)")
    for a_name, b_name, what in (("(a)", "(b)", "read"), ("(c)", "(d)", "engine step")):
        names = [n for n, _ in paths if n.startswith((a_name, b_name))]
        if len(names) != 2:
            continue
        ratios = {k: statistics.median(times[(names[0], k)]) / statistics.median(
            times[(names[1], k)]) for k in sizes}
        wins = [k for k in sizes if ratios[k] > 1]
        line = ", ".join(f"{k:,}: driver/executors {r:.2f}" for k, r in ratios.items())
        if wins and all(ratios[k] > 1 for k in sizes if k >= wins[0]):
            print(f"{what}: crossover at or below {wins[0]:,} messages ({line})")
        else:
            print(f"{what}: no crossover up to {sizes[-1]:,} messages; the driver path is "
                  f"faster ({line})")
    print(f"(median of {a.rounds} interleaved rounds; {os.cpu_count()} cores on this machine; "
          f"spark {'standalone 2 x 1 core' if a.cluster else a.master})")


if __name__ == "__main__":
    main()
