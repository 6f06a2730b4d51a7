"""Per-customer running totals of orders.<region>.<customer>, one Dagster run per partition."""
from dagster import EnvVar
from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from cg_pipelines import JsonDecoder, JsonField, KeyedState
from cg_pipelines.dagster import (
    ConsumerGroupAsset,
    DeltaWarehouseResource,
    NatsResource,
    PartitionRunsResource,
    SparkResource,
    build_definitions,
)
from cg_pipelines.spark import SparkProcessor


def running_totals(spark: SparkSession, df: DataFrame, ctx: object) -> DataFrame:
    # df: the batch's orders in stream order (_seq), plus each customer's committed state
    # before the batch as last_total / last_orders (null for a new customer)
    upto = Window.partitionBy("customer").orderBy("_seq").rowsBetween(
        Window.unboundedPreceding, Window.currentRow)
    return df.select(
        "customer", "amount", "_seq",
        (F.coalesce("last_total", F.lit(0.0)) + F.sum("amount").over(upto)).alias("total"),
        (F.coalesce("last_orders", F.lit(0)) + F.count("*").over(upto)).alias("orders"))


customer_totals = ConsumerGroupAsset(
    name="customer_totals", stream="orders", group="totals", partitions=4,
    processor=SparkProcessor(
        JsonDecoder([JsonField("customer", "string"), JsonField("amount", "float")]),
        running_totals, state=KeyedState("customer", ("total", "orders"))))

defs = build_definitions([customer_totals], resources={
    "nats": NatsResource(servers=EnvVar("NATS_URL")),
    "spark": SparkResource(master=EnvVar("SPARK_MASTER"), app_name="customer_totals"),
    "warehouse": DeltaWarehouseResource(root=EnvVar("WAREHOUSE")),
    "partition_runs": PartitionRunsResource(batch_max_msgs=25),  # small: customers cross batches
})
