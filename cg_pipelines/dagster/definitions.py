"""One call from asset specs to Dagster ``Definitions``: :func:`build_definitions` (each spec's
parts, :func:`~cg_pipelines.dagster.asset.build_asset_definitions`, plus the resources they
need and the definition-time checks)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dagster import (
    Definitions,
    ExecutorDefinition,
    ScheduleDefinition,
    SensorDefinition,
    in_process_executor,
)

from cg_pipelines.core.errors import ConfigError
from cg_pipelines.dagster.asset import build_asset_definitions
from cg_pipelines.dagster.io_manager import table_io_manager
from cg_pipelines.dagster.resources import PartitionRunsResource, SparkResource
from cg_pipelines.dagster.spec import StreamAsset
from cg_pipelines.dagster.warehouse import Warehouse

__all__ = ["build_definitions"]


def _check_resources(groups: Sequence[StreamAsset], resources: Mapping[str, Any]) -> None:
    """Definition-time checks: the resources each group needs are given, a Spark resource where
    a processor uses Spark, and a state-capable warehouse where a processor declares state."""
    for g in groups:
        need = [g.nats_resource_key, g.warehouse_resource_key]
        if g.uses_spark:
            need.append(g.spark_resource_key)
        missing = [k for k in need if k not in resources]
        if missing:
            raise ConfigError("resources", f"{g.name} needs resource(s) {missing} "
                              f"(given: {sorted(resources)})")
        state = g.state
        warehouse = resources[g.warehouse_resource_key]
        if not isinstance(warehouse, Warehouse):
            raise ConfigError("resources", f"{g.name}: resource {g.warehouse_resource_key!r} "
                              f"({type(warehouse).__name__}) is not a warehouse: it needs "
                              "what cg_pipelines.dagster.Warehouse declares (table_format, "
                              "supports_state, table_uri, storage_options, sink, ...)")
        if g.reconcile_interval_s is not None \
                and warehouse.table_format != "delta":
            raise ConfigError("reconcile_interval_s", f"{g.name}: the origin reconcile reads "
                              "the coverage each commit records in the Delta log; the "
                              f"warehouse resource {type(warehouse).__name__} holds "
                              f"{warehouse.table_format} tables (leave reconcile_interval_s "
                              "unset)")
        if state is not None and not warehouse.supports_state:
            raise ConfigError("resources", f"{g.name} declares per-key state on "
                              f"{state.key!r} but the warehouse resource "
                              f"{type(warehouse).__name__} cannot serve it (its sink has no "
                              "last_rows): use DeltaWarehouseResource or IcebergWarehouseResource")


def _check_partition_keys(groups: Sequence[StreamAsset]) -> None:
    """Partition keys must tell specs apart (the ``dagster/partition`` run tag keeps runs of
    one partition exclusive); every key is compared (``a10`` is ``a``'s 10 and ``a1``'s 0).

    Raises:
        ConfigError: two groups share a partition key (the message names both and the key).
    """
    seen: dict[str, str] = {}
    for g in groups:
        for key in g.partition_keys():
            if key in seen and seen[key] != g.name:
                raise ConfigError("partition_key_prefix", f"{g.name} and {seen[key]} share "
                                  f"partition key {key!r}: give them different "
                                  "partition_key_prefix values")
            seen[key] = g.name


def build_definitions(
    groups: Sequence[StreamAsset],
    *,
    resources: Mapping[str, Any],
    joins: Sequence[StreamAsset] = (),
    assets: Sequence[Any] = (),
    jobs: Sequence[Any] = (),
    sensors: Sequence[SensorDefinition] = (),
    schedules: Sequence[ScheduleDefinition] = (),
    executor: ExecutorDefinition | None = in_process_executor,
    **kwargs: Any,
) -> Definitions:
    """``dagster.Definitions`` for asset specs: each spec's asset, jobs, sensors, schedule
    and checks (:func:`~cg_pipelines.dagster.asset.build_asset_definitions`), plus your own
    ``assets``/``jobs``/``sensors``/``schedules``.

    Args:
        groups: the specs (``ConsumerGroupAsset``, ``CoPartitionedAsset``, ``StreamAsset``).
        joins: more specs, the same as in ``groups``.
        resources: yours, under the keys the specs name (``nats``, ``warehouse``, ``spark``
            for Spark); a ``PartitionRunsResource`` and the warehouse's IO manager
            (:func:`~cg_pipelines.dagster.io_manager.table_io_manager`) are added unless given.
        executor: default executor; in-process by default (one asset per run).
        kwargs: passed to ``Definitions`` (e.g. ``asset_checks``, ``loggers``).

    Raises:
        ConfigError: a missing resource, a warehouse that is not a ``Warehouse``, declared
            state without a state-capable warehouse, ``reconcile_interval_s`` on a warehouse
            that is not Delta's, or two specs whose partition keys collide.
    """
    res = dict(resources)
    specs: list[StreamAsset] = [*groups, *joins]
    _check_resources(specs, res)
    _check_partition_keys(specs)
    for g in specs:
        res.setdefault(g.runs_resource_key, PartitionRunsResource())
        if g.io_manager_key not in res:
            spark = res.get(g.spark_resource_key)
            # Another Spark resource (e.g. dagster_pyspark.PySparkResource) drives the runs;
            # the IO manager then reads Spark DataFrames through its own SparkResource only.
            warehouse = res[g.warehouse_resource_key]
            sp = spark if isinstance(spark, SparkResource) else None
            res[g.io_manager_key] = table_io_manager(warehouse, sp)
    parts = [build_asset_definitions(
        g, table_format=res[g.warehouse_resource_key].table_format) for g in specs]
    kwargs["asset_checks"] = [*(c for p in parts for c in p.checks),
                              *kwargs.get("asset_checks", ())]
    return Definitions(
        assets=[*(p.asset for p in parts), *assets],
        jobs=[*(j for p in parts for j in p.jobs), *jobs],
        sensors=[*(s for p in parts for s in p.sensors), *sensors],
        schedules=[*(s for p in parts for s in p.schedules), *schedules],
        resources=res,
        executor=executor,
        **kwargs,
    )
