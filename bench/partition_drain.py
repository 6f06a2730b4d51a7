"""Benchmark: drain one partition of 200,000 messages three ways, on the same machine and run.

(a) per-message ordered baseline: ``max_ack_pending=1`` pinned pull of one message, process it
    (JSON decode + keep the row), ack it — the reference's consume loop;
(b) the engine without Spark: lease-and-range batches, Arrow transform, fenced Delta commit,
    purge, ack;
(c) the engine with the Spark job (the same batches through a Spark DataFrame transform).

Each path drains its own copy of the messages: three elastic groups on one stream, each with a
one-partition work-queue stream holding all 200,000. Prints a table, where the time of (b) and
(c) goes, peak RSS, and the final line ``ratio engine/per-message: <x>``.

Run: ``.venv/bin/python bench/partition_drain.py [--messages 200000] [--batch 20000]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import nats
import pyarrow as pa
import pyarrow.compute as pc
from nats.js.api import StreamConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter  # noqa: E402
from cg_pipelines.core.decode import Field, JsonDecoder  # noqa: E402
from cg_pipelines.devserver import NatsServer  # noqa: E402
from cg_pipelines.engine.model import BatchContext  # noqa: E402
from cg_pipelines.engine.processing import ArrowProcessor  # noqa: E402
from cg_pipelines.engine.runner import EngineOptions, run_partition  # noqa: E402
from cg_pipelines.jetstream import admin  # noqa: E402
from cg_pipelines.jetstream.api import JetStreamAPI, consumer_config  # noqa: E402
from cg_pipelines.sinks.delta import DeltaSink  # noqa: E402

DECODER = JsonDecoder([Field("key", "string"), Field("n", "int"), Field("v", "float")])


def arrow_transform(table: pa.Table, ctx: BatchContext) -> pa.Table:
    """Rows with a derived column (the same work the Spark transform does)."""
    return table.select(["key", "n", "v", "_seq"]).append_column(
        "v2", pc.multiply(table.column("v"), 2.0))


def spark_transform(spark, df, ctx):  # noqa: ANN001, ANN201 - Spark types imported lazily
    from pyspark.sql import functions as F

    return df.select("key", "n", "v", "_seq", (F.col("v") * 2.0).alias("v2"))


def rss_mb(who: int = resource.RUSAGE_SELF) -> float:
    return resource.getrusage(who).ru_maxrss / 1024


async def publish(js, n: int) -> float:  # noqa: ANN001
    t = time.monotonic()
    chunk = 5000
    for start in range(0, n, chunk):
        acks = [await js.publish_async(
            f"bench.k{i % 1000}", json.dumps({"key": f"k{i % 1000}", "n": i, "v": i * 0.5})
            .encode()) for i in range(start, min(n, start + chunk))]
        await asyncio.gather(*acks)
    return time.monotonic() - t


async def wait_sourced(api: JetStreamAPI, wq: str, n: int) -> None:
    while (await api.stream_info(wq))["state"]["messages"] < n:
        await asyncio.sleep(0.2)


async def per_message(nc, api: JetStreamAPI, wq: str, n: int) -> float:  # noqa: ANN001
    await api.create_consumer(wq, consumer_config(
        durable_name="per-message", filter_subjects=["0.>"], ack_wait_s=30, max_ack_pending=1,
        priority_groups=["PCG"], priority_policy="pinned_client", priority_timeout_s=30))
    rows = []
    pin = None
    t = time.monotonic()
    while len(rows) < n:
        got = await api.pull(wq, "per-message", batch=1, expires_s=5, pin_id=pin)
        if not got.messages:
            raise RuntimeError(f"per-message baseline stalled at {len(rows)}: {got}")
        pin = got.pin_id
        msg = got.messages[0]
        rows.append(DECODER.decode(msg.data))
        await msg.ack()
    return time.monotonic() - t


async def main(args: argparse.Namespace) -> None:
    n = args.messages
    with tempfile.TemporaryDirectory(prefix="cg-bench-") as tmp, \
            NatsServer(Path(tmp) / "nats") as server:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        api = JetStreamAPI(nc, timeout=30)
        await js.add_stream(StreamConfig(name="bench", subjects=["bench.>"]))
        for g in ("a", "b", "c"):
            await admin.create_elastic(js, "bench", g, ElasticConfig(
                1, (PartitioningFilter("bench.*", (1,)),)))
        pub_s = await publish(js, n)
        for g in ("a", "b", "c"):
            await wait_sourced(api, f"bench-{g}", n)
        print(f"published {n:,} messages in {pub_s:.1f} s ({n / pub_s:,.0f} msg/s); "
              f"3 work-queue copies ready", flush=True)

        rows: list[tuple[str, float, str]] = []
        a_s = await per_message(nc, api, "bench-a", n)
        rows.append(("(a) per-message pull+process+ack, max_ack_pending=1", a_s, ""))
        rss_a = rss_mb()

        opts = EngineOptions(batch_max_msgs=args.batch)
        sink_b = DeltaSink(str(Path(tmp) / "b"))
        rb = await run_partition(nc, "bench", "b", 0, ArrowProcessor(DECODER, arrow_transform),
                                 sink_b, opts)
        assert rb.processed == n and sink_b.read(columns=["n"]).num_rows == n, rb
        rows.append(("(b) engine, Arrow transform, Delta commit", rb.seconds,
                     _where(rb.timings, rb.seconds)))
        rss_b = rss_mb()

        rss_c = jvm = 0.0
        spark_start = 0.0
        if not args.no_spark:
            from cg_pipelines.spark.job import SparkProcessor
            from cg_pipelines.spark.session import get_spark, stop_spark

            t = time.monotonic()
            spark = get_spark("local[2]", app_name="cg-bench")
            spark.range(1).collect()
            spark_start = time.monotonic() - t
            try:
                sink_c = DeltaSink(str(Path(tmp) / "c"))
                rc = await run_partition(nc, "bench", "c", 0,
                                         SparkProcessor(DECODER, spark_transform, spark=spark),
                                         sink_c, opts)
                assert rc.processed == n and sink_c.read(columns=["n"]).num_rows == n, rc
                rows.append(("(c) engine, Spark transform, Delta commit", rc.seconds,
                             _where(rc.timings, rc.seconds)))
                rss_c = rss_mb()
            finally:
                stop_spark()
            jvm = rss_mb(resource.RUSAGE_CHILDREN)
        await api.close()
        await nc.close()

    print()
    print(f"{'path':<55} {'seconds':>8} {'msg/s':>10}  where the time goes")
    for name, secs, where in rows:
        print(f"{name:<55} {secs:>8.2f} {n / secs:>10,.0f}  {where}")
    print()
    print(f"batch size {args.batch:,}; Spark session start (not in (c)): {spark_start:.1f} s")
    print(f"peak RSS (python process): after (a) {rss_a:.0f} MB, after (b) {rss_b:.0f} MB"
          + (f", after (c) {rss_c:.0f} MB; Spark JVM (children) {jvm:.0f} MB"
             if not args.no_spark else ""))
    ratio = a_s / rows[1][1]
    if not args.no_spark:
        print(f"ratio engine+spark/per-message: {a_s / rows[2][1]:.1f}")
    print(f"ratio engine/per-message: {ratio:.1f}")


def _where(timings: dict[str, float], total: float) -> str:
    parts = sorted(timings.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{k} {v:.2f}s" for k, v in parts) + \
        f", other {max(0.0, total - sum(timings.values())):.2f}s"


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=200_000)
    p.add_argument("--batch", type=int, default=20_000)
    p.add_argument("--no-spark", action="store_true", help="skip path (c)")
    asyncio.run(main(p.parse_args()))
