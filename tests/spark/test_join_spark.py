"""A co-partitioned run with a Spark processor (issue 39): each input as a Spark DataFrame, the
state shared by the join key, one commit; compared with the independent pandas join."""

from __future__ import annotations

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from cg_pipelines.engine.join import run_copartitioned
from cg_pipelines.engine.join_processor import JoinContext
from cg_pipelines.engine.options import EngineOptions
from cg_pipelines.sinks.delta import DeltaSink
from cg_pipelines.spark.join import SparkJoinProcessor
from tests.support import joined

STATE_COLS = ["auction", "last_ad", "last_clicks", "last_value", "last_updates"]


def transform(spark: SparkSession, dfs: dict[str, DataFrame], ctx: JoinContext) -> DataFrame:
    imp, clk = dfs[joined.IMP], dfs[joined.CLK]
    state = imp.select(STATE_COLS).unionByName(clk.select(STATE_COLS)).dropDuplicates(["auction"])
    ad = imp.groupBy("auction").agg(F.max_by("ad", "_seq").alias("ad"))
    clicks = clk.groupBy("auction").agg(F.count("*").alias("n"))
    out = state.join(ad, "auction", "left").join(clicks, "auction", "left")
    return out.select(
        "auction", F.coalesce("ad", "last_ad").alias("ad"),
        (F.coalesce("last_clicks", F.lit(0)) + F.coalesce("n", F.lit(0))).alias("clicks"),
        F.coalesce("last_value", F.lit(0)).alias("value"),
        (F.coalesce("last_updates", F.lit(0)) + 1).alias("updates"))


async def test_spark_join(spark, nc, js, unique_name, tmp_path) -> None:
    evs = joined.events(120)
    api = await joined.setup(js, unique_name, evs, n_partitions=2)
    sink = DeltaSink(str(tmp_path / "t"), write=joined.WRITE)
    proc = SparkJoinProcessor({n: joined.DECODERS[n] for n in (joined.IMP, joined.CLK)},
                              transform, state=joined.STATE, schema=joined.OUT_SCHEMA
                              ).bind(spark)
    for p in range(2):
        r = await run_copartitioned(nc, joined.inputs(unique_name), p, proc, sink,
                                    EngineOptions(batch_max_msgs=50, ack_wait_s=5.0))
        assert r.status == "drained" and r.commits > 1, r.detail
    assert joined.mismatches(sink.read(), evs) is None
    assert await joined.left(api, unique_name) == 0
