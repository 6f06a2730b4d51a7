"""Dagster integration: one partitioned asset per spec, one partition per run (the
``dagster`` extra; ``spark`` for Spark processors)::

    totals = ConsumerGroupAsset(name="customer_totals", stream="orders", group="totals",
                                partitions=4, processor=running_totals)
    defs = build_definitions([totals], resources={
        "nats": NatsResource(servers=EnvVar("NATS_URL")),
        "warehouse": DeltaWarehouseResource(root="s3://lake/tables", ...)})

One spec, :class:`StreamAsset`, whose inputs are one consumer group (:class:`ConsumerGroupAsset`)
or a co-partitioned set (:class:`CoPartitionedAsset`, docs/joins.md), gets the same parts
(:mod:`~cg_pipelines.dagster.asset`): the asset (keys ``<group>-<p>``) and its checks, the
drain, rebuild and checks jobs, the membership and backlog sensors, the drain schedule, the run
retention sensor and an IO manager; in a ``dg`` project :class:`ConsumerGroupAssetComponent`.

Modules: ``spec`` (what a user declares), ``asset`` (the builder), ``run`` (a partition run;
the one call into the engine), ``triggers`` (sensors, schedule, the backlog tick, its cursor and
observers), ``reading`` (their NATS read), ``checks`` (every check, reconcile too), ``history``
and ``retention`` (the Dagster instance), ``resources``, ``warehouse``, ``io_manager``,
``iceberg``, ``component``, ``definitions`` (all specs to ``Definitions``).
"""

from cg_pipelines.dagster.asset import AssetDefinitions, build_asset_definitions
from cg_pipelines.dagster.component import ConsumerGroupAssetComponent
from cg_pipelines.dagster.definitions import build_definitions
from cg_pipelines.dagster.io_manager import DeltaTableIOManager
from cg_pipelines.dagster.resources import (
    DeltaWarehouseResource,
    NatsResource,
    PartitionRunsResource,
    SparkResource,
)
from cg_pipelines.dagster.spec import (
    ConsumerGroupAsset,
    CoPartitionedAsset,
    JoinInput,
    StreamAsset,
)
from cg_pipelines.dagster.warehouse import Warehouse

GroupDefinitions = AssetDefinitions
"""The former name of :class:`~cg_pipelines.dagster.asset.AssetDefinitions`."""
build_group_definitions = build_copartitioned_definitions = build_asset_definitions

__all__ = [
    "AssetDefinitions",
    "CoPartitionedAsset",
    "ConsumerGroupAsset",
    "ConsumerGroupAssetComponent",
    "DeltaTableIOManager",
    "DeltaWarehouseResource",
    "GroupDefinitions",
    "JoinInput",
    "NatsResource",
    "PartitionRunsResource",
    "SparkResource",
    "StreamAsset",
    "Warehouse",
    "build_asset_definitions",
    "build_copartitioned_definitions",
    "build_definitions",
    "build_group_definitions",
]
