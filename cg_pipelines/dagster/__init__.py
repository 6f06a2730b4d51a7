"""Dagster integration: one partitioned asset per spec, one partition per run.

Requires the ``dagster`` extra (``pip install cg-pipelines[dagster]``; add ``spark`` for Spark
processors). A user project needs a few lines::

    from dagster import EnvVar
    from cg_pipelines.dagster import (ConsumerGroupAsset, DeltaWarehouseResource,
                                      NatsResource, build_definitions)

    totals = ConsumerGroupAsset(name="customer_totals", stream="orders", group="totals",
                                partitions=4, processor=running_totals)
    defs = build_definitions([totals], resources={
        "nats": NatsResource(servers=EnvVar("NATS_URL")),
        "warehouse": DeltaWarehouseResource(root="s3://lake/tables", ...)})

One spec, :class:`StreamAsset`: its inputs are one consumer group
(:class:`ConsumerGroupAsset`) or a co-partitioned set (:class:`CoPartitionedAsset`, a
``JoinProcessor``; docs/joins.md). Either gets the same parts
(:func:`~cg_pipelines.dagster.asset.build_asset_definitions`): the partitioned asset (keys
``<group>-<p>``) and its checks (per input where they are about an input), the drain, rebuild
and checks jobs, the membership and backlog sensors and the drain schedule (stopped), a run
retention sensor (running) and an IO manager that hands the table to downstream assets. In a
``dg`` project, ``defs.yaml`` declares either: :class:`ConsumerGroupAssetComponent`.

Where each concept lives: ``spec`` (what a user declares), ``asset`` (the builder), ``run``
(a partition run; the one call into the engine), ``triggers`` (sensors, schedule), ``tick``
(the backlog tick, its cursor and observers), ``reading`` (the NATS read they start from),
``checks`` and ``reconcile`` (asset checks), ``history`` and ``retention`` (what the Dagster
instance knows, and run deletion), ``resources``, ``warehouse``, ``io_manager``, ``iceberg``,
``component``, ``definitions`` (all specs to ``Definitions``).
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
