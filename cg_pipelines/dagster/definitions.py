"""One call from consumer-group specs to Dagster definitions."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from dagster import (
    AssetChecksDefinition,
    AssetsDefinition,
    AssetSelection,
    Definitions,
    ExecutorDefinition,
    ScheduleDefinition,
    SensorDefinition,
    define_asset_job,
    in_process_executor,
)

from cg_pipelines.core.errors import ConfigError
from cg_pipelines.dagster.assets import build_group_asset
from cg_pipelines.dagster.checks import build_group_checks
from cg_pipelines.dagster.history import CHECK_MODE, MODE_TAG
from cg_pipelines.dagster.io_manager import table_io_manager
from cg_pipelines.dagster.joins import CoPartitionedAsset, build_copartitioned_definitions
from cg_pipelines.dagster.partition_checks import LAG_CHECK
from cg_pipelines.dagster.reconcile import build_reconcile_check
from cg_pipelines.dagster.resources import PartitionRunsResource, SparkResource
from cg_pipelines.dagster.retention import build_run_retention_sensor
from cg_pipelines.dagster.sensors import build_drain_schedule, build_sensors
from cg_pipelines.dagster.spec import ConsumerGroupAsset, partitioned_checks_preview
from cg_pipelines.dagster.warehouse import Warehouse
from cg_pipelines.engine.processor import with_defaults

__all__ = ["GroupDefinitions", "build_definitions", "build_group_definitions"]


@dataclass(frozen=True)
class GroupDefinitions:
    """The Dagster parts of one consumer group: ``asset`` (partitioned, with its checks),
    ``job`` (the asset job: one partition per run, draining), ``rebuild_job`` (the same asset,
    each run rebuilding its partition from the origin stream: backfill it over the partitions
    to recompute), ``sensors`` (membership, backlog, run retention), ``schedule`` (drain-all,
    or ``None``),
    ``checks`` (the operational checks), ``checks_job`` (the partitioned operational checks of
    one partition per run, no materialization: the backlog sensor's check-only runs)."""

    asset: AssetsDefinition
    job: Any
    rebuild_job: Any
    sensors: list[SensorDefinition]
    schedule: ScheduleDefinition | None
    checks: list[AssetChecksDefinition]
    checks_job: Any = None

    @property
    def jobs(self) -> list[Any]:
        return [self.job, self.rebuild_job, *([self.checks_job] if self.checks_job else [])]

    @property
    def schedules(self) -> list[ScheduleDefinition]:
        return [self.schedule] if self.schedule is not None else []


def build_group_definitions(spec: ConsumerGroupAsset, *,
                            origin_reconcile: bool = True) -> GroupDefinitions:
    """The asset, its jobs (``<name>_job`` drains, ``<name>_rebuild`` rebuilds,
    ``<name>_checks`` records a partition's partitioned operational checks), sensors
    (``<name>_membership``, ``<name>_backlog``, and ``<name>_run_retention``, which deletes old
    runs of these jobs and is running by default: :mod:`cg_pipelines.dagster.retention`),
    schedule (``<name>_drain``) and operational
    checks (:mod:`cg_pipelines.dagster.checks`) of one group;
    use these parts to compose your own ``Definitions``, or :func:`build_definitions` for all
    of it.

    Args:
        origin_reconcile: also the ``origin_reconciled`` check
            (:mod:`cg_pipelines.dagster.reconcile`), which reads the coverage each commit
            records in the Delta log: :func:`build_definitions` leaves it out for a warehouse
            of another table format (Iceberg), where it could only fail.
    """
    with partitioned_checks_preview():  # the asset's partitioned checks: a Dagster preview
        asset = build_group_asset(spec)
    partitioned = build_group_checks(spec)
    checks = [*partitioned, *([build_reconcile_check(spec)] if origin_reconcile else [])]
    # The operational checks are evaluated by the backlog sensor (or by hand), not by each
    # run; except lag_within_objective, the partition's freshness: each drain or rebuild run
    # evaluates it after its materialization, so a drained partition reads fresh against its
    # latest materialization without a check-only run (docs/signals.md, "Freshness").
    sensor_only = [c for c in checks if not any(k.name == LAG_CHECK for k in c.check_keys)]
    selection = AssetSelection.assets(asset) - AssetSelection.checks(*sensor_only)
    job = define_asset_job(f"{spec.name}_job", selection=selection,
                           description=f"Drain one partition of {spec.stream}.{spec.group} "
                           "per run.")
    rebuild = define_asset_job(
        f"{spec.name}_rebuild", selection=selection,
        config={"ops": {asset.op.name: {"config": {"mode": "rebuild"}}}},
        tags={MODE_TAG: "rebuild"},
        description=f"Rebuild one partition of {spec.stream}.{spec.group} per run from the "
        "origin stream's history, replacing its rows atomically (backfill it to recompute).")
    # Check-only runs: the sensor requests this job with no asset selected and the partitioned
    # checks only (as the Checks tab's "Execute" does). A job selecting checks alone has no
    # partitions in Dagster 1.13 (they are inferred from its assets), so the asset is in the
    # selection; launched whole, its run fails at once: the asset refuses cg/mode=check.
    checks_job = define_asset_job(
        f"{spec.name}_checks",
        selection=AssetSelection.assets(asset) - AssetSelection.checks(checks[-1]),
        tags={MODE_TAG: CHECK_MODE},
        description=f"Record the partitioned operational checks of one partition of "
        f"{spec.stream}.{spec.group} (the backlog sensor runs it with the checks only "
        "selected, for a partition whose results changed; it never materializes).")
    retention = build_run_retention_sensor(
        spec.name, asset.key, spec.partition_keys(), [job.name, rebuild.name, checks_job.name],
        sorted({k.name for k in asset.check_keys} | {k.name for c in checks for k in c.check_keys}),
        spec.runs_resource_key)
    return GroupDefinitions(asset, job, rebuild, [*build_sensors(spec, job, checks_job), retention],
                            build_drain_schedule(spec, job), checks, checks_job)


_Spec = ConsumerGroupAsset | CoPartitionedAsset
_SpecT = TypeVar("_SpecT", ConsumerGroupAsset, CoPartitionedAsset)


def _check_resources(groups: Sequence[_Spec], resources: Mapping[str, Any]) -> None:
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
        state = g.processor.state if isinstance(g, CoPartitionedAsset) else \
            with_defaults(g.processor).state
        warehouse = resources[g.warehouse_resource_key]
        if not isinstance(warehouse, Warehouse):
            raise ConfigError("resources", f"{g.name}: resource {g.warehouse_resource_key!r} "
                              f"({type(warehouse).__name__}) is not a warehouse: it needs "
                              "what cg_pipelines.dagster.Warehouse declares (table_format, "
                              "supports_state, table_uri, storage_options, sink, ...)")
        if isinstance(g, ConsumerGroupAsset) and g.reconcile_interval_s is not None \
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


def _check_partition_keys(groups: Sequence[_Spec]) -> None:
    """Partition keys must tell groups apart: the ``dagster/partition`` run tag is what keeps
    two runs of one partition from running at once. Every key of every group is compared
    (prefixes ``"a"`` and ``"a1"`` collide in the middle: ``a10`` is both ``a``'s partition 10
    and ``a1``'s partition 0); a set of all keys, O(total partitions).

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


def _format_kinds(spec: _SpecT, resources: Mapping[str, Any]) -> _SpecT:
    """``spec`` with default kinds (``kinds=None``) that name its warehouse's table format
    (``nats``, ``iceberg``, and ``spark`` when the processor uses Spark) instead of the
    asset's own default ``delta``; ``spec`` itself when it declares kinds or its warehouse
    holds Delta tables."""
    warehouse: Warehouse = resources[spec.warehouse_resource_key]
    fmt = warehouse.table_format
    if spec.kinds is not None or fmt == "delta":
        return spec
    kinds = {"nats", fmt, "spark"} if spec.uses_spark else {"nats", fmt}
    return dataclasses.replace(spec, kinds=frozenset(kinds))


def build_definitions(
    groups: Sequence[ConsumerGroupAsset],
    *,
    resources: Mapping[str, Any],
    joins: Sequence[CoPartitionedAsset] = (),
    assets: Sequence[Any] = (),
    jobs: Sequence[Any] = (),
    sensors: Sequence[SensorDefinition] = (),
    schedules: Sequence[ScheduleDefinition] = (),
    executor: ExecutorDefinition | None = in_process_executor,
    **kwargs: Any,
) -> Definitions:
    """``dagster.Definitions`` for consumer groups: each group's asset, job, sensors, schedule
    and checks, plus your own ``assets``/``jobs``/``sensors``/``schedules``.

    Args:
        groups: the consumer-group assets.
        joins: the co-partitioned assets (:class:`~cg_pipelines.dagster.joins.
            CoPartitionedAsset`: partition p of several groups per run, one commit), each
            with its job and backlog sensor.
        resources: your resources under the keys the groups name (defaults ``nats``,
            ``warehouse``, and ``spark`` for Spark processors). A
            :class:`~cg_pipelines.dagster.PartitionRunsResource` (serve every member, default
            engine options) and the warehouse's IO manager
            (:func:`~cg_pipelines.dagster.io_manager.table_io_manager`: a
            :class:`~cg_pipelines.dagster.DeltaTableIOManager` or an
            :class:`~cg_pipelines.dagster.iceberg.IcebergTableIOManager`, so downstream
            assets can take a group asset as input) are added under their keys unless given.
        executor: default executor; in-process by default (one asset per run, so a run needs
            no extra step process).
        kwargs: passed to ``Definitions`` (e.g. ``asset_checks``, ``loggers``).

    Raises:
        ConfigError: a missing resource, a warehouse resource that is not a
            :class:`~cg_pipelines.dagster.Warehouse`, a state-declaring processor without a
            state-capable warehouse, ``reconcile_interval_s`` on a warehouse that is not
            Delta's, or two groups whose partition keys collide.
    """
    res = dict(resources)
    specs: list[_Spec] = [*groups, *joins]
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
    parts = [build_group_definitions(
        _format_kinds(g, res),
        origin_reconcile=res[g.warehouse_resource_key].table_format == "delta") for g in groups]
    joined = [build_copartitioned_definitions(_format_kinds(j, res)) for j in joins]
    kwargs["asset_checks"] = [*(c for p in parts for c in p.checks),
                              *kwargs.get("asset_checks", ())]
    return Definitions(
        assets=[*(p.asset for p in parts), *(j.asset for j in joined), *assets],
        jobs=[*(j for p in parts for j in p.jobs), *(x for j in joined for x in j.jobs), *jobs],
        sensors=[*(s for p in parts for s in p.sensors), *(s for j in joined for s in j.sensors),
                 *sensors],
        schedules=[*(s for p in parts for s in p.schedules), *schedules],
        resources=res,
        executor=executor,
        **kwargs,
    )
