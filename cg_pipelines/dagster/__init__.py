"""Dagster integration: consumer groups as partitioned assets, one group partition per run.

Requires the ``dagster`` extra (``pip install cg-pipelines[dagster]``; add ``spark`` for Spark
processors). A user project needs a few lines::

    from dagster import EnvVar
    from cg_pipelines import JsonDecoder, JsonField, KeyedState
    from cg_pipelines.dagster import (ConsumerGroupAsset, DeltaWarehouseResource,
                                      NatsResource, SparkResource, build_definitions)
    from cg_pipelines.spark import SparkProcessor

    totals = ConsumerGroupAsset(
        name="customer_totals", stream="orders", group="totals", partitions=4,
        processor=SparkProcessor(JsonDecoder([JsonField("customer", "string"),
                                              JsonField("amount", "float")]),
                                 running_totals,  # (spark, df, ctx) -> DataFrame
                                 state=KeyedState("customer", ("total", "orders"))))
    defs = build_definitions([totals], resources={
        "nats": NatsResource(servers=EnvVar("NATS_URL")),
        "spark": SparkResource(master="spark://spark-master:7077"),
        "warehouse": DeltaWarehouseResource(root="s3://lake/tables", ...)})

What you get per group: the partitioned asset (partition keys ``<group>-<p>``) with its asset
checks, its job, a membership sensor, a backlog sensor and a drain schedule (these start
stopped), a run retention sensor (running: it deletes the asset's runs nothing reads any more,
:mod:`cg_pipelines.dagster.retention`), and an IO manager that hands the table to downstream
assets. Make runs
of one partition exclusive however they are launched with the instance setting in
:mod:`cg_pipelines.dagster.assets` (a ``dagster/partition`` tag limit). In a ``dg`` project, a
group can be declared in ``defs.yaml`` instead: :class:`ConsumerGroupAssetComponent`
(:mod:`cg_pipelines.dagster.component`).
"""

from cg_pipelines.dagster.component import ConsumerGroupAssetComponent
from cg_pipelines.dagster.definitions import (
    GroupDefinitions,
    build_definitions,
    build_group_definitions,
)
from cg_pipelines.dagster.io_manager import DeltaTableIOManager
from cg_pipelines.dagster.joins import CoPartitionedAsset, build_copartitioned_definitions
from cg_pipelines.dagster.resources import (
    DeltaWarehouseResource,
    NatsResource,
    PartitionRunsResource,
    SparkResource,
)
from cg_pipelines.dagster.spec import ConsumerGroupAsset
from cg_pipelines.dagster.warehouse import Warehouse

# What a user project needs. The building blocks (the asset, sensors, schedule and checks
# factories, the backlog tick, run config) stay importable from their submodules:
# cg_pipelines.dagster.{assets,sensors,checks,history,spec,resources,warehouse,io_manager,
# definitions}; the Iceberg warehouse and IO manager from cg_pipelines.dagster.iceberg.
__all__ = [
    "CoPartitionedAsset",
    "ConsumerGroupAsset",
    "ConsumerGroupAssetComponent",
    "DeltaTableIOManager",
    "DeltaWarehouseResource",
    "GroupDefinitions",
    "NatsResource",
    "PartitionRunsResource",
    "SparkResource",
    "Warehouse",
    "build_copartitioned_definitions",
    "build_definitions",
    "build_group_definitions",
]
