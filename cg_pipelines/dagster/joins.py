"""A co-partitioned set of consumer groups as ONE partitioned Dagster asset: partition ``p`` of
every group in one run, one commit (:func:`cg_pipelines.engine.join.run_copartitioned`).

What a user declares: :class:`CoPartitionedAsset` (defined in
:mod:`cg_pipelines.dagster.join_spec`; the inputs, their shared partition count, a
:class:`~cg_pipelines.engine.join_processor.JoinProcessor`). What it builds
(:func:`build_copartitioned_definitions`, or ``build_definitions(..., joins=[...])``):

- the partitioned asset (keys ``<prefix><p>``), each run draining partition ``p`` of every input
  and committing the output with every input's watermark at once; its metadata names each
  input's sequence range, messages, dead letters and watermark (``<input>/first_seq`` ...), and
  its checks say whether the run drained, was fenced, or dead-lettered;
- ``<name>_rebuild``: each run rebuilds its partition from every input's origin history
  (:func:`~cg_pipelines.engine.rebuild.rebuild_copartitioned`);
- ``<name>_job`` and the ``<name>_backlog`` sensor: a run for partition ``p`` is requested when
  ANY input has a backlog at ``p`` (with the group asset's retry rule, lost-run detection and
  repeat suppression, :mod:`cg_pipelines.core.triggers`), and each input's lag per partition is
  observed at a bounded rate (``<input>/pending``, ``<input>/oldest_pending_age_s``).

Every run first checks, from the groups' KV configs, that the set is still co-partitioned
(:func:`~cg_pipelines.core.copartition.check_copartitioned`) with the declared partition count.
Runs of one partition are exclusive as for a group asset (the ``dagster/partition`` tag limit,
:mod:`cg_pipelines.dagster.assets`); the leases and the fence on every input stay the last line.
"""

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetsDefinition,
    Failure,
    MaterializeResult,
    MetadataValue,
    SensorDefinition,
    StaticPartitionsDefinition,
    asset,
    define_asset_job,
)

from cg_pipelines.dagster.history import (
    CODE_TAG,
    MODE_TAG,
)
from cg_pipelines.dagster.join_sensor import build_join_sensor, set_configs
from cg_pipelines.dagster.join_spec import CoPartitionedAsset
from cg_pipelines.dagster.partition_run import (
    DEAD_LETTER_CHECK,
    DRAINED_CHECK,
    FENCE_CHECK,
    PartitionRunConfig,
    failed_run_checks,
    run_alive,
    run_failure,
    run_mode,
    table_metadata,
    trim_traceback,
    wait_for_earlier_runs,
)
from cg_pipelines.dagster.resources import (
    NatsResource,
    PartitionRunsResource,
    run_spark_session,
    stopping_foreign_spark,
)
from cg_pipelines.dagster.retention import build_run_retention_sensor
from cg_pipelines.dagster.spec import TICK_ERRORS, partitioned_checks_preview
from cg_pipelines.dagster.warehouse import Warehouse
from cg_pipelines.engine.join import JoinInput, run_copartitioned
from cg_pipelines.engine.rebuild import rebuild_copartitioned
from cg_pipelines.engine.result import RunResult
from cg_pipelines.sinks.base import JoinSink

__all__ = [
    "CoPartitionedAsset",
    "JoinDefinitions",
    "build_copartitioned_asset",
    "build_copartitioned_definitions",
]


@dataclass(frozen=True)
class JoinDefinitions:
    """The Dagster parts of one co-partitioned asset: ``asset``, ``job`` (one partition per
    run), ``rebuild_job`` (each run rebuilds its partition from every input's origin history:
    backfill it to recompute), ``sensors`` (the backlog sensor, the run retention sensor)."""

    asset: AssetsDefinition
    job: Any
    rebuild_job: Any
    sensors: list[SensorDefinition]

    @property
    def jobs(self) -> list[Any]:
        return [self.job, self.rebuild_job]


# ------------------------------------------------------------------------------ the asset

def build_copartitioned_asset(spec: CoPartitionedAsset) -> AssetsDefinition:
    """The partitioned asset of ``spec`` with its three run checks (as a group asset's:
    ``backlog_drained``, ``no_unexplained_fence_conflicts``, ``no_new_dead_letters``)."""
    partitions = StaticPartitionsDefinition(spec.partition_keys())
    checks = [
        AssetCheckSpec(DRAINED_CHECK, asset=spec.name, partitions_def=partitions,
                       description="The run drained every input's backlog seen at its start."),
        AssetCheckSpec(FENCE_CHECK, asset=spec.name, partitions_def=partitions,
                       description="No joint commit of the run was refused by the fence of "
                       "any input."),
        AssetCheckSpec(DEAD_LETTER_CHECK, asset=spec.name, partitions_def=partitions,
                       description="The run dead-lettered no message of any input."),
    ]
    keys = {spec.nats_resource_key, spec.warehouse_resource_key, spec.runs_resource_key}
    if spec.uses_spark:
        keys.add(spec.spark_resource_key)
    kinds = set(spec.kinds) if spec.kinds is not None else (
        {"nats", "delta", "spark"} if spec.uses_spark else {"nats", "delta"})
    inputs = [{"name": i.name, "stream": i.stream, "group": i.group} for i in spec.inputs]

    @asset(
        name=spec.name, key_prefix=spec.key_prefix, group_name=spec.group_name,
        partitions_def=partitions, check_specs=checks, kinds=kinds, pool=spec.pool,
        description=spec.description or "Co-partitioned join of " + ", ".join(
            f"{i.stream}.{i.group}" for i in spec.inputs),
        required_resource_keys=keys, io_manager_key=spec.io_manager_key,
        metadata={"cg/inputs": MetadataValue.json(inputs), "cg/partitions": spec.partitions,
                  "cg/table": spec.table_name, "cg/write_mode": spec.write.name,
                  "cg/partition_key_prefix": spec.effective_partition_key_prefix,
                  **spec.metadata},
    )
    def _joined_asset(context: AssetExecutionContext, config: PartitionRunConfig
                      ) -> Iterator[MaterializeResult | AssetCheckResult]:
        try:
            with run_alive(context, spec):
                if not spec.uses_spark:
                    result = _materialize(context, spec, config)
                else:
                    with stopping_foreign_spark(context, spec.spark_resource_key):
                        result = _materialize(context, spec, config)
        except Exception as e:
            yield from failed_run_checks(e)
            raise
        yield result

    return _joined_asset


def _materialize(context: AssetExecutionContext, spec: CoPartitionedAsset,
                 config: PartitionRunConfig) -> MaterializeResult:
    res = context.resources
    nats_res: NatsResource = getattr(res, spec.nats_resource_key)
    warehouse: Warehouse = getattr(res, spec.warehouse_resource_key)
    runs: PartitionRunsResource = getattr(res, spec.runs_resource_key)
    p = spec.partition_of(context.partition_key)
    context.instance.add_run_tags(context.run.run_id, {
        CODE_TAG: spec.current_code_version()})
    waited = wait_for_earlier_runs(context, runs.run_timeout_s)
    try:
        nats_res.run(lambda nc: set_configs(nc, spec, nats_res.call_timeout_s))
    except TICK_ERRORS as e:
        raise Failure(f"cannot use the co-partitioned set of {spec.name}: {e}") from e
    sink = warehouse.sink(spec.table_name, write=spec.write,
                          commit_metadata={"dagster_run_id": context.run.run_id},
                          maintenance=spec.maintenance)
    if not isinstance(sink, JoinSink):
        raise Failure(f"{type(warehouse).__name__}'s tables cannot commit several inputs at "
                      "once (JoinSink.commit_inputs): a co-partitioned asset needs a Delta or "
                      "Iceberg warehouse")
    processor = spec.processor
    if spec.uses_spark:
        processor = processor.bind(run_spark_session(getattr(res, spec.spark_resource_key)))
    mode = run_mode(context.run.tags, config)
    try:
        if mode == "rebuild":
            result = nats_res.run(
                lambda nc: rebuild_copartitioned(nc, spec.inputs, p, processor, sink,
                                                 runs.engine_options(),
                                                 allow_partial=config.allow_partial),
                timeout_s=runs.run_timeout_s)
        else:
            result = nats_res.run(
                lambda nc: run_copartitioned(nc, spec.inputs, p, processor, sink,
                                             runs.engine_options()),
                timeout_s=runs.run_timeout_s)
    except Exception as e:
        first = spec.inputs[0]
        raise run_failure(e, first, p) from trim_traceback(e)
    context.log.info(join_summary(result))
    md = join_metadata(result, spec.inputs)
    md["mode"] = mode
    md["waited_for_runs"] = ", ".join(waited)
    if result.status == "held":
        raise Failure(f"partition {p} was not processed: {result.detail}; it is retried when "
                      "the holder lets go", metadata=md)
    md.update(table_metadata(sink, p, spec.table_name))
    dead = sum(r.dead_lettered for r in result.inputs.values())
    fenced = result.status == "fenced"
    return MaterializeResult(metadata=md, check_results=[
        AssetCheckResult(check_name=DRAINED_CHECK,
                         passed=result.status in ("drained", "empty", "rebuilt"),
                         severity=AssetCheckSeverity.WARN,
                         description=f"{result.status}: {result.detail}" if result.detail
                         else result.status),
        AssetCheckResult(check_name=FENCE_CHECK, passed=not fenced,
                         severity=AssetCheckSeverity.WARN,
                         description=result.detail if fenced else "no commit refused"),
        AssetCheckResult(check_name=DEAD_LETTER_CHECK, passed=dead == 0,
                         severity=AssetCheckSeverity.WARN,
                         description=f"{dead:,} message(s) dead-lettered" if dead else
                         "none dead-lettered",
                         metadata={f"{n}/dead_lettered": r.dead_lettered
                                   for n, r in result.inputs.items()}),
    ])


def join_summary(result: RunResult) -> str:
    """The run's last log line: status, messages per input, rows, time, detail."""
    per = ", ".join(f"{n} {r.processed:,}" for n, r in result.inputs.items())
    line = (f"partition {result.partition}: {result.status}, {result.processed:,} messages "
            f"committed ({per}) as {result.rows_written:,} rows in {result.commits} joint "
            f"commit(s), {result.seconds:.1f} s")
    return f"{line}; {result.detail}" if result.detail else line


def join_metadata(result: RunResult, inputs: Sequence[JoinInput]) -> dict[str, Any]:
    """The materialization's metadata: the run's figures, and per input (``<name>/...``) its
    stream, group, sequence range, messages, dead letters and watermark; ``lineage`` lists
    the same per input as one JSON value."""
    md: dict[str, Any] = {
        "status": result.status, "commits": result.commits,
        "rows_written": result.rows_written, "messages": result.processed,
        "seconds": MetadataValue.float(round(result.seconds, 3)),
        "detail": result.detail or "",
        "timings": MetadataValue.json({k: round(v, 3) for k, v in result.timings.items()}),
    }
    lineage = []
    for inp in inputs:
        r = result.inputs[inp.name]
        row = {"stream": inp.stream, "group": inp.group, "first_seq": r.first_seq or 0,
               "last_seq": r.last_seq or 0, "messages": r.processed,
               "dead_lettered": r.dead_lettered, "watermark": r.watermark}
        lineage.append({"input": inp.name, **row})
        md.update({f"{inp.name}/{k}": v for k, v in row.items()})
    md["lineage"] = MetadataValue.json(lineage)
    if result.maintenance:
        md["maintenance"] = MetadataValue.json(result.maintenance)
    return md


def build_copartitioned_definitions(spec: CoPartitionedAsset) -> JoinDefinitions:
    """The asset, ``<name>_job`` (one partition per run), ``<name>_rebuild``, the
    ``<name>_backlog`` sensor and the ``<name>_run_retention`` sensor (running by default, as a
    group asset's: :mod:`cg_pipelines.dagster.retention`) of one co-partitioned asset (or pass
    it to ``build_definitions(..., joins=[spec])``)."""
    with partitioned_checks_preview():
        asset_def = build_copartitioned_asset(spec)
    job = define_asset_job(f"{spec.name}_job", selection=[asset_def],
                           description=f"Drain partition p of every input of {spec.name} "
                           "per run, one commit for all.")
    rebuild = define_asset_job(
        f"{spec.name}_rebuild", selection=[asset_def],
        config={"ops": {asset_def.op.name: {"config": {"mode": "rebuild"}}}},
        tags={MODE_TAG: "rebuild"},
        description=f"Rebuild partition p of {spec.name} per run from every input's origin "
        "history, replacing its rows in one commit (backfill it to recompute).")
    retention = build_run_retention_sensor(
        spec.name, asset_def.key, spec.partition_keys(), [job.name, rebuild.name],
        sorted(k.name for k in asset_def.check_keys), spec.runs_resource_key)
    return JoinDefinitions(asset_def, job, rebuild, [build_join_sensor(spec, job), retention])
