"""A Spark processor in Airflow's drain task (``ConsumerGroupDag(spark_master=...,
spark_config=...)``): the task binds the processor to the session of the spec's settings and
drains each partition exactly (table == pandas reference). The task is called as Airflow's
worker calls it, with the context's parts the task reads (run key, try, asset state store,
outlet events); the Airflow services themselves are tested in ``tests/airflow``."""

from __future__ import annotations

import asyncio
from typing import Any

import nats
import pytest
from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from cg_pipelines.airflow import ConsumerGroupDag
from cg_pipelines.airflow.tasks import drain
from cg_pipelines.core.errors import ConfigError
from cg_pipelines.jetstream.connect import ConnectOptions
from cg_pipelines.sinks.delta import DeltaSink
from cg_pipelines.spark.processor import SparkProcessor
from tests.dagster import helpers as h
from tests.support import keyed
from tests.support.airflow_context import Outlet, StateStore, run_context

TABLE = "table"


def running(spark: SparkSession, df: DataFrame, ctx: object) -> DataFrame:
    """keyed.transform on Spark: per key, the running count and the previous ``n``."""
    w = Window.partitionBy("key").orderBy("_seq")
    rn = F.row_number().over(w)
    prev = F.when(rn == 1, F.col("last_n")).otherwise(F.lag("n").over(w))
    return df.select("key", F.col("n").cast("long").alias("n"),
                     (rn + F.coalesce(F.col("last_count"), F.lit(0))).cast("long").alias("count"),
                     prev.cast("long").alias("prev_n"), F.col("_seq").alias("seq"))


def test_spark_settings_are_checked() -> None:
    with pytest.raises(ConfigError) as e:
        ConsumerGroupDag("t", "S", "g", 2, keyed.processor(), "/tmp/t",
                         spark_remote="localhost:15002")
    assert e.value.field == "spark_remote"
    with pytest.raises(ConfigError) as e:
        ConsumerGroupDag("t", "S", "g", 2, keyed.processor(), "/tmp/t",
                         spark_config={"spark.sql.shuffle.partitions": 3})  # type: ignore[dict-item]
    assert e.value.field == "spark_config"


async def _publish(url: str, stream: str, evs: list[tuple[str, int]]) -> None:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await h.create_group(js, stream)
        await h.publish(js, stream, evs, len(evs))
    finally:
        await nc.close()


@pytest.mark.integration
def test_drain_task_runs_a_spark_processor_on_the_spec_s_session(
        spark: SparkSession, nats_url: str, unique_name: str, tmp_path: Any) -> None:
    # a sync test: the task runs its own event loop, as on an Airflow worker
    evs = h.events_on({0, 2}, n_events=300)
    asyncio.run(_publish(nats_url, unique_name, evs))
    spec = ConsumerGroupDag(
        "legs", unique_name, "g", h.PARTITIONS,
        SparkProcessor(keyed.DECODER, running, state=keyed.STATE, schema=keyed.OUT_SCHEMA,
                       order_by="seq"),
        str(tmp_path / "legs"), nats=ConnectOptions(nats_url),
        spark_master=spark.sparkContext.master,
        spark_config={"spark.sql.shuffle.partitions": "3"})
    before = spark.conf.get("spark.sql.shuffle.partitions")
    store = StateStore()
    try:
        outs = {p: drain(spec, p, TABLE, run_context(f"g-{p}", {TABLE: store},
                                                     {TABLE: Outlet()}))
                for p in (0, 2)}
        assert spark.conf.get("spark.sql.shuffle.partitions") == "3"  # the spec's setting
    finally:
        spark.conf.set("spark.sql.shuffle.partitions", before)
    table = DeltaSink(spec.table_uri).read()
    assert keyed.mismatches(table, evs) is None
    assert sum(o["messages"] for o in outs.values()) == len(evs)
    assert {o["status"] for o in outs.values()} == {"drained"}
    assert {k: v["state"] for k, v in store.rows.items()} == {"p0": "succeeded",
                                                               "p2": "succeeded"}
