"""Merge write mode with the Spark processor: the devices pipeline (tests/support/devices.py)
transformed on local Spark (window functions over ``_seq``; Spark does not keep row order),
drained in small batches by the real engine from a real nats-server into a real Delta table in
merge mode, equals the independent reference (upserts, deletes, keys crossing batches,
re-sent messages); the Arrow processor and the Spark executor read on the same stream give
the same table."""

from __future__ import annotations

import asyncio

import nats
from nats.js.api import StreamConfig
from pyspark.sql import SparkSession

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.engine.options import EngineOptions
from cg_pipelines.engine.runner import run_partition
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.sinks.delta import DeltaSink
from cg_pipelines.spark.processor import SparkProcessor
from tests.support import devices

PARTS = 2
FAST = dict(ack_wait_s=5.0, priority_timeout_s=5.0, hold_wait_s=6.0)


async def test_spark_merge_equals_reference_and_arrow(spark: SparkSession, nats_url: str,
                                                      tmp_path) -> None:
    stream = "MERGESPARK"
    evs = devices.events(900, 30, seed=21)
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream(timeout=5)
        await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
        for group in ("s", "a", "x"):  # same messages: Spark, Arrow, Spark executor read
            await admin.create_elastic(js, stream, group, ElasticConfig(
                PARTS, (PartitioningFilter(f"{stream}.*", (1,)),), members=("m1",)))
        await devices.publish(js, stream, evs)
        api = JetStreamAPI.from_js(js)
        for _ in range(400):
            done = [int((await api.stream_info(f"{stream}-{g}"))["state"]["last_seq"])
                    for g in ("s", "a", "x")]
            if min(done) >= len(evs):
                break
            await asyncio.sleep(0.05)
        proc = SparkProcessor(devices.DECODER, devices.spark_transform, state=devices.STATE,
                              spark=spark, schema=devices.OUT_SCHEMA)
        s_sink = DeltaSink(str(tmp_path / "spark"), write=devices.MERGE)
        a_sink = DeltaSink(str(tmp_path / "arrow"), write=devices.MERGE)
        x_sink = DeltaSink(str(tmp_path / "executors"), write=devices.MERGE)
        commits = 0
        for p in range(PARTS):
            r = await run_partition(nc, stream, "s", p, proc, s_sink,
                                    EngineOptions(batch_max_msgs=150, **FAST))
            assert r.status == "drained", r
            commits += r.commits
            r = await run_partition(nc, stream, "a", p, devices.processor(), a_sink,
                                    EngineOptions(batch_max_msgs=61, **FAST))
            assert r.status == "drained", r
            # the first 50 messages on the driver, the rest read on the executors at once
            r = await run_partition(nc, stream, "x", p, proc, x_sink,
                                    EngineOptions(batch_max_msgs=50, max_messages=50, **FAST))
            assert r.status == "limit", r
            r = await run_partition(nc, stream, "x", p, proc, x_sink, EngineOptions(
                batch_max_msgs=50, executor_read_min_msgs=100, **FAST))
            assert r.status == "drained" and r.commits == 1, r
        assert commits >= 6  # keys cross batches, state read back from the merged table
        assert devices.mismatches(s_sink.read(), evs) is None
        assert devices.table_frame(s_sink.read()).equals(devices.table_frame(a_sink.read()))
        assert devices.mismatches(x_sink.read(), evs) is None
    finally:
        await nc.close()
