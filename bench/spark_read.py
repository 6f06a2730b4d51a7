"""Reading one partition's backlog into Spark: driver-side direct get vs the Spark data source.

    .venv/bin/python bench/spark_read.py [--messages 200000] [--noise 100000] [--subjects 4000]
                                         [--batch 2000]
                                         [--partitions 1,2,4] [--repeat 2] [--master local[2]]

Starts its own nats-server (temp store, random port; stopped at the end) and a local Spark
session. Publishes ``--messages`` JSON events of about 100 bytes on partition 0's subjects
(``0.f.<tail>``, ``--subjects`` distinct tails, default 4000 like the real flights data)
interleaved with ``--noise`` events on partitions 1..3, into a stream with
``allow_direct: true``. Then, for the whole sequence range and subject filter ``0.>``:

(a) driver: ``JetStreamAPI.direct_get_batch`` in batches of ``--batch`` on the driver, each
    batch to an Arrow record batch, one table, ``spark.createDataFrame(table)``;
(b) source: the ``jetstream`` Spark data source with 1, 2, 4 input partitions (each read by a
    Python worker on an executor, same batch size).

Each variant ends with the same Spark action, ``count(*)`` and ``sum(length(data))`` (checked
against what was published), so every row has reached Spark. A warm-up of each path runs first
(Python worker start and first-use planning are excluded); the best of ``--repeat`` runs is
reported. Prints a table of seconds and msg/s and which path is faster.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import nats
import pyarrow as pa
from nats.js.api import StreamConfig
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from cg_pipelines.devserver import NatsServer
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.spark.datasource import messages_to_batch
from cg_pipelines.spark.job import read_range_with_spark
from cg_pipelines.spark.session import get_spark, session_start_seconds, stop_spark

STREAM = "BENCH"


def payload(i: int, subjects: int) -> bytes:
    return json.dumps(
        {"tail": f"N{i % subjects:05d}", "flight": i % 9000, "dep_delay": (i * 7) % 90 - 10,
         "arr_delay": (i * 13) % 120 - 20, "origin": "JFK", "dest": "LAX", "i": i},
        separators=(",", ":"),
    ).encode()


async def publish(url: str, n: int, noise: int, subjects: int) -> tuple[int, int, int]:
    """Publish; returns (messages on 0.>, their payload bytes, last stream sequence)."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=STREAM, subjects=["0.>", "1.>", "2.>", "3.>"],
                                     allow_direct=True))
    total = n + noise
    every = (total // noise) if noise else 0
    futs, sent, nbytes, last = [], 0, 0, 0
    for j in range(total):
        if every and j % every == every - 1 and j // every < noise:
            subject, data = f"{1 + j % 3}.f.N{j % subjects:05d}", payload(j, subjects)
        elif sent < n:
            subject, data = f"0.f.N{sent % subjects:05d}", payload(sent, subjects)
            sent += 1
            nbytes += len(data)
        else:
            continue
        futs.append(await js.publish_async(subject, data))
        if len(futs) >= 5000:
            last = max(a.seq for a in await asyncio.gather(*futs))
            futs.clear()
    if futs:
        last = max(last, *(a.seq for a in await asyncio.gather(*futs)))
    await nc.close()
    assert sent == n, (sent, n)
    return n, nbytes, last


async def driver_read(url: str, last: int, batch: int) -> pa.Table:
    nc = await nats.connect(url)
    try:
        api = JetStreamAPI(nc, timeout=10)
        batches, seq = [], 1
        while seq <= last:
            msgs = await api.direct_get_batch(STREAM, seq, "0.>", min(batch, last - seq + 1))
            if not msgs:
                break
            batches.append(messages_to_batch(msgs, strip_partition=False))
            seq = msgs[-1].seq + 1
        await api.close()
        return pa.Table.from_batches(batches)
    finally:
        await nc.close()


def action(df: DataFrame) -> tuple[int, int]:
    row = df.agg(F.count(F.lit(1)).alias("n"), F.sum(F.length("data")).alias("b")).first()
    return int(row["n"]), int(row["b"] or 0)


def best_of(repeat: int, run: Callable[[], tuple[float, float]]) -> tuple[float, float]:
    results = [run() for _ in range(repeat)]
    return min(results, key=lambda r: r[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--noise", type=int, default=100_000,
                    help="messages on other partitions, interleaved")
    ap.add_argument("--subjects", type=int, default=4000,
                    help="distinct subjects (tail numbers) per partition")
    ap.add_argument("--batch", type=int, default=2000)
    ap.add_argument("--partitions", default="1,2,4")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--master", default="local[2]")
    a = ap.parse_args()
    parts = [int(p) for p in a.partitions.split(",") if p.strip()]

    with tempfile.TemporaryDirectory() as d, NatsServer(Path(d)) as srv:
        t0 = time.perf_counter()
        n, nbytes, last = asyncio.run(publish(srv.url, a.messages, a.noise, a.subjects))
        print(f"published {n:,} msgs on 0.> ({nbytes / n:.0f} B avg payload, {a.subjects:,} "
              f"distinct subjects 0.f.<tail>) + {a.noise:,} on 1-3.> in "
              f"{time.perf_counter() - t0:.1f} s; last seq {last:,}")
        spark: SparkSession = get_spark(a.master, app_name="bench-spark-read")
        print(f"spark session start ({a.master}): {session_start_seconds() or 0:.1f} s")
        try:
            rows: list[tuple[str, float, float]] = []

            def run_driver() -> tuple[float, float]:
                t = time.perf_counter()
                table = asyncio.run(driver_read(srv.url, last, a.batch))
                t_read = time.perf_counter() - t
                got = action(spark.createDataFrame(table))
                total = time.perf_counter() - t
                assert got == (n, nbytes), (got, n, nbytes)
                return total, t_read

            def run_source(p: int) -> tuple[float, float]:
                t = time.perf_counter()
                df = read_range_with_spark(spark, srv.url, STREAM, "0.>", 1, last, p,
                                           batch=a.batch)
                got = action(df)
                total = time.perf_counter() - t
                assert got == (n, nbytes), (got, n, nbytes)
                return total, 0.0

            # Warm-up: Python workers, first-use planning, JIT.
            t = time.perf_counter()
            action(spark.createDataFrame(asyncio.run(driver_read(srv.url, 2000, a.batch))))
            action(read_range_with_spark(spark, srv.url, STREAM, "0.>", 1, 5000, max(parts)))
            print(f"warm-up: {time.perf_counter() - t:.1f} s")

            total, t_read = best_of(a.repeat, run_driver)
            rows.append((f"(a) driver direct_get_batch({a.batch}) -> Arrow -> createDataFrame",
                         total, t_read))
            for p in parts:
                total, _ = best_of(a.repeat, lambda p=p: run_source(p))
                rows.append((f"(b) data source, {p} input partition{'s' if p > 1 else ''}",
                             total, 0.0))
        finally:
            stop_spark()

    width = max(len(r[0]) for r in rows)
    print()
    print(f"{'path':<{width}}  {'seconds':>8}  {'msg/s':>9}  note")
    for name, secs, t_read in rows:
        note = f"NATS->Arrow {t_read:.2f} s, Spark {secs - t_read:.2f} s" if t_read else ""
        print(f"{name:<{width}}  {secs:>8.2f}  {n / secs:>9,.0f}  {note}")
    best = min(rows, key=lambda r: r[1])
    print(f"\nfastest: {best[0]} ({n / best[1]:,.0f} msg/s, best of {a.repeat}; "
          f"{n:,} msgs, cores: {a.master})")


if __name__ == "__main__":
    main()
