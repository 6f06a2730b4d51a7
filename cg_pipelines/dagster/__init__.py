"""Dagster integration: consumer groups as partitioned assets, one group partition per run.

Requires the ``dagster`` extra (``pip install cg-pipelines[dagster]``; add ``spark`` for Spark
processors). A user project needs a few lines::

    from dagster import EnvVar
    from cg_pipelines import Field, JsonDecoder, KeyedState
    from cg_pipelines.dagster import (ConsumerGroupAsset, DeltaWarehouseResource,
                                      NatsResource, SparkResource, build_definitions)
    from cg_pipelines.spark import SparkProcessor

    totals = ConsumerGroupAsset(
        name="customer_totals", stream="orders", group="totals", partitions=4,
        processor=SparkProcessor(JsonDecoder([Field("customer", "string"),
                                              Field("amount", "float")]),
                                 running_totals,  # (spark, df, ctx) -> DataFrame
                                 state=KeyedState("customer", ("total", "orders"))))
    defs = build_definitions([totals], resources={
        "nats": NatsResource(servers=EnvVar("NATS_URL")),
        "spark": SparkResource(master="spark://spark-master:7077"),
        "warehouse": DeltaWarehouseResource(root="s3://lake/tables", ...)})

What you get per group: the partitioned asset (partition keys ``<group>-<p>``) with its asset
checks, its job, a membership sensor, a backlog sensor and a drain schedule (sensors and
schedule start stopped), and an IO manager that hands the table to downstream assets. Make runs
of one partition exclusive however they are launched with the instance setting in
:mod:`cg_pipelines.dagster.assets` (a ``dagster/partition`` tag limit).
"""

from cg_pipelines.dagster.assets import TICK_ERRORS, PartitionRunConfig, build_group_asset
from cg_pipelines.dagster.definitions import (
    GroupDefinitions,
    build_definitions,
    build_group_definitions,
)
from cg_pipelines.dagster.io_manager import DeltaTableIOManager
from cg_pipelines.dagster.resources import (
    DeltaWarehouseResource,
    NatsResource,
    PartitionRunsResource,
    SparkResource,
)
from cg_pipelines.dagster.sensors import backlog_tick, build_drain_schedule, build_sensors
from cg_pipelines.dagster.spec import ConsumerGroupAsset

__all__ = [
    "TICK_ERRORS",
    "ConsumerGroupAsset",
    "DeltaTableIOManager",
    "DeltaWarehouseResource",
    "GroupDefinitions",
    "NatsResource",
    "PartitionRunConfig",
    "PartitionRunsResource",
    "SparkResource",
    "backlog_tick",
    "build_definitions",
    "build_drain_schedule",
    "build_group_asset",
    "build_group_definitions",
    "build_sensors",
]
