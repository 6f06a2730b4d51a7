"""The ONE builder (:func:`build_asset_definitions`): every Dagster part of one spec whatever
its inputs: the asset and its checks, the ``<name>_job`` (drain), ``<name>_rebuild`` and
``<name>_checks`` (the sensor's check-only runs) jobs, the membership and backlog sensors, the
drain schedule and the run retention sensor."""


from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dagster import (
    AssetCheckResult,
    AssetChecksDefinition,
    AssetExecutionContext,
    AssetsDefinition,
    AssetSelection,
    AssetSpec,
    MaterializeResult,
    MetadataValue,
    ScheduleDefinition,
    SensorDefinition,
    StaticPartitionsDefinition,
    define_asset_job,
    multi_asset,
)

from cg_pipelines.core.write import Merge
from cg_pipelines.dagster.checks import (
    LAG_CHECK,
    build_checks,
    build_reconcile_check,
    run_check_specs,
)
from cg_pipelines.dagster.history import CHECK_MODE, MODE_TAG
from cg_pipelines.dagster.retention import build_run_retention_sensor
from cg_pipelines.dagster.run import PartitionRunConfig, materialize
from cg_pipelines.dagster.spec import StreamAsset, asset_key_of, partitioned_checks_preview
from cg_pipelines.dagster.triggers import build_drain_schedule, build_sensors

__all__ = ["AssetDefinitions", "build_asset", "build_asset_definitions"]


@dataclass(frozen=True)
class AssetDefinitions:
    """The Dagster parts of one spec: ``asset`` (with its run checks), ``job``,
    ``rebuild_job``, ``checks_job``, ``sensors`` (membership, backlog, run retention),
    ``schedule`` (drain-all, or ``None``) and ``checks`` (the sensor checks, reconcile)."""

    asset: AssetsDefinition
    job: Any
    rebuild_job: Any
    sensors: list[SensorDefinition]
    schedule: ScheduleDefinition | None
    checks: list[AssetChecksDefinition]
    checks_job: Any

    @property
    def jobs(self) -> list[Any]:
        return [self.job, self.rebuild_job, self.checks_job]

    @property
    def schedules(self) -> list[ScheduleDefinition]:
        return [self.schedule] if self.schedule is not None else []


def build_asset(spec: StreamAsset, table_format: str = "delta") -> AssetsDefinition:
    """The partitioned asset of ``spec`` with its run checks (results of each run, also when
    it fails); default kinds ``nats``, ``table_format`` and ``spark`` if used."""
    partitions = StaticPartitionsDefinition(spec.partition_keys())
    keys = {spec.nats_resource_key, spec.warehouse_resource_key, spec.runs_resource_key}
    if spec.uses_spark:
        keys.add(spec.spark_resource_key)
    kinds = set(spec.kinds) if spec.kinds is not None else (
        {"nats", table_format, "spark"} if spec.uses_spark else {"nats", table_format})
    groups = {"cg/stream": spec.inputs[0].stream, "cg/group": spec.inputs[0].group} \
        if len(spec.inputs) == 1 else {"cg/inputs": MetadataValue.json(
            [{"name": i.name, "stream": i.stream, "group": i.group} for i in spec.inputs])}

    key = asset_key_of(spec)
    asset_spec = AssetSpec(
        key, freshness_policy=spec.freshness_policy, group_name=spec.group_name, kinds=kinds,
        description=spec.description or f"{spec.title[0].upper()}{spec.title[1:]}.",
        metadata={**groups, "cg/partitions": spec.partitions, "cg/table": spec.table_name,
                  "cg/partition_key_prefix": spec.effective_partition_key_prefix,
                  "cg/write_mode": spec.write.name,
                  **({"cg/merge_key": ", ".join(spec.write.keys)}
                     if isinstance(spec.write, Merge) else {}),
                  **spec.metadata},
    ).with_io_manager_key(spec.io_manager_key)

    # One asset as a subsettable multi-asset: a run over a range of partitions selects the
    # asset without its run checks (Dagster 1.13 records a range run's check result without a
    # partition; an @asset with checks cannot be subset).
    @multi_asset(
        name="__".join(key.path), specs=[asset_spec], partitions_def=partitions,
        check_specs=run_check_specs(spec, partitions), pool=spec.pool, can_subset=True,
        required_resource_keys=keys,
    )
    def _asset(context: AssetExecutionContext, config: PartitionRunConfig
               ) -> Iterator[MaterializeResult | AssetCheckResult]:
        yield from materialize(context, spec, config)

    return _asset


def build_asset_definitions(spec: StreamAsset, *, table_format: str = "delta"
                            ) -> AssetDefinitions:
    """Every part of one spec (see the module docstring) for a warehouse of ``table_format``
    (``origin_reconciled`` reads the Delta log: Delta only); compose your own
    ``Definitions`` from them, or :func:`~cg_pipelines.dagster.build_definitions` does."""
    with partitioned_checks_preview():
        asset_def = build_asset(spec, table_format)
    reconcile = [build_reconcile_check(spec, inp=i) for i in spec.inputs] \
        if table_format == "delta" else []
    checks = [*build_checks(spec), *reconcile]
    # The sensor checks run outside partition runs, except lag_within_objective: each drain or
    # rebuild run evaluates it after its materialization (docs/signals.md, "Freshness").
    sensor_only = [c for c in checks
                   if not any(k.name.startswith(LAG_CHECK) for k in c.check_keys)]
    selection = AssetSelection.assets(asset_def) - AssetSelection.checks(*sensor_only)
    job = define_asset_job(f"{spec.name}_job", selection=selection,
                           description=f"Drain one partition of {spec.title} per run.")
    rebuild = define_asset_job(
        f"{spec.name}_rebuild", selection=selection,
        config={"ops": {asset_def.op.name: {"config": {"mode": "rebuild"}}}},
        tags={MODE_TAG: "rebuild"},
        description=f"Rebuild one partition of {spec.title} per run from the origin history, "
        "replacing its rows atomically (backfill it to recompute).")
    # A job selecting checks alone has no partitions in Dagster 1.13 (inferred from its
    # assets), so the asset is in the selection; the sensor's requests select the checks only.
    checks_job = define_asset_job(
        f"{spec.name}_checks",
        selection=AssetSelection.assets(asset_def) - AssetSelection.checks(*reconcile),
        tags={MODE_TAG: CHECK_MODE},
        description=f"Record the partitioned sensor checks of one partition of {spec.title} "
        "(the backlog sensor runs it with the checks only selected; it never materializes).")
    retention = build_run_retention_sensor(
        spec.name, asset_def.key, spec.partition_keys(), [job.name, rebuild.name, checks_job.name],
        sorted({k.name for k in asset_def.check_keys} | {k.name for c in checks
                                                          for k in c.check_keys}),
        spec.runs_resource_key)
    return AssetDefinitions(asset_def, job, rebuild, [*build_sensors(spec, job, checks_job),
                                                      retention],
                            build_drain_schedule(spec, job), checks, checks_job)
