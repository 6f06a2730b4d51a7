"""The partitioned asset of a consumer group, its job and its asset checks.

Each run drains one group partition through the ordered engine
(:func:`cg_pipelines.engine.run_partition`) into the group's table, Delta or Iceberg: the op
speaks to the ``warehouse`` resource only through
:class:`~cg_pipelines.dagster.warehouse.Warehouse` and to its table through
:class:`~cg_pipelines.sinks.table.TableSink` (resolve the run, run it, report it).

**One run per partition at a time, however it was launched** (asset job, ``dagster asset
materialize --partition``, UI materialization, UI backfill, sensor, schedule). Every such run
carries Dagster's own ``dagster/partition`` tag with the group-qualified key, and the Dagster
instance records them all, so:

1. before touching NATS, a run looks up the instance's in-progress runs of its asset partition
   and waits until those that started before it have finished (runs executed in the calling
   process, like ``dagster asset materialize``, never pass a run queue: this covers them);
2. with this instance setting (``dagster.yaml``), launched runs do not even start while
   another run of the partition is in progress — they wait in the run queue instead of in a
   run::

       concurrency:
         runs:
           tag_concurrency_limits:
             - key: "dagster/partition"
               value: {applyLimitPerUniqueValue: true}
               limit: 1

The engine's lease and fenced commit stay the last line: a second holder commits nothing.
"""


import time
from collections.abc import Iterator
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
    StaticPartitionsDefinition,
    asset,
)

from cg_pipelines.core.assignment import assignment, owners
from cg_pipelines.core.write import Merge
from cg_pipelines.dagster.history import CODE_TAG
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
from cg_pipelines.dagster.spec import (
    TICK_ERRORS,
    ConsumerGroupAsset,
    load_group_config,
)
from cg_pipelines.dagster.warehouse import Warehouse
from cg_pipelines.engine.processor import Processor
from cg_pipelines.engine.rebuild import rebuild_partition
from cg_pipelines.engine.result import RunResult
from cg_pipelines.engine.runner import run_partition
from cg_pipelines.sinks.table import TableSink

__all__ = [
    "PartitionRunConfig",
    "RunProgress",
    "build_group_asset",
    "wait_for_earlier_runs",
]

PROGRESS_EVERY_S = 10.0
"""A run logs its progress at most once per this many seconds (and once at the end)."""


class RunProgress:
    """The engine hook of a Dagster run: after a committed batch, at most every
    :data:`PROGRESS_EVERY_S` seconds, one line: messages committed, sequence, backlog left,
    dead letters, rate."""

    def __init__(self, log: Any, partition: int, every_s: float = PROGRESS_EVERY_S) -> None:
        self.log, self.partition, self.every_s = log, partition, every_s
        self._last = time.monotonic()

    def __call__(self, step: str, info: dict[str, Any]) -> None:
        if step != "committed" or "processed" not in info:
            return
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        self._last = now
        seconds = float(info.get("seconds") or 0.0)
        rate = info["processed"] / seconds if seconds > 0 else 0.0
        self.log.info(
            f"partition {self.partition}: {info['processed']:,} messages committed through "
            f"sequence {info['last_seq']}, {info.get('left', 0):,} left, "
            f"{info.get('dead_lettered', 0):,} dead-lettered, {rate:,.0f} msg/s")


def summary_line(p: int, result: RunResult) -> str:
    """The run's last log line: status, rows, every message counted, time, rate, detail."""
    handled = result.processed + result.dead_lettered + result.duplicates_skipped
    line = (f"partition {p}: {result.status}, {result.processed:,} messages committed of "
            f"{handled:,} handled ({result.dead_lettered:,} dead-lettered, "
            f"{result.duplicates_skipped:,} already committed and skipped) in "
            f"{result.seconds:.1f} s ({result.messages_per_second:,.0f}/s)")
    return f"{line}; {result.detail}" if result.detail else line


def _run_metadata(result: RunResult, owner: str, revision: int) -> dict[str, Any]:
    return {
        "status": result.status,
        "first_seq": result.first_seq or 0,
        "last_seq": result.last_seq or 0,
        "messages": result.processed,
        "dead_lettered": result.dead_lettered,
        "duplicates_skipped": result.duplicates_skipped,
        "commits": result.commits,
        "fence_conflicts": result.fence_conflicts,
        "watermark": result.watermark,
        "seconds": MetadataValue.float(round(result.seconds, 3)),
        "messages_per_second": MetadataValue.float(round(result.messages_per_second, 1)),
        "owner_member": owner,
        "config_revision": revision,
        "detail": result.detail or "",
        "timings": MetadataValue.json({k: round(v, 3) for k, v in result.timings.items()}),
    }


def build_group_asset(spec: ConsumerGroupAsset) -> AssetsDefinition:
    """The partitioned asset of ``spec`` with its three partitioned asset checks (results of
    each run, also when it fails: :func:`failed_run_checks`), and ``spec.freshness_policy``
    (none by default: a partition's freshness is its ``lag_within_objective`` check, which
    each drain run evaluates after its materialization, docs/signals.md)."""
    partitions = StaticPartitionsDefinition(spec.partition_keys())
    # Partitioned checks (Dagster 1.13): each run's results are its partition's.
    checks = [
        AssetCheckSpec(DRAINED_CHECK, asset=spec.name, partitions_def=partitions,
                       description="The run drained the partition's backlog seen at its start "
                       "(a failed run did not; its description starts with the cause)."),
        AssetCheckSpec(FENCE_CHECK, asset=spec.name, partitions_def=partitions,
                       description="No commit of the run was refused by the watermark fence "
                       "(a refusal means another holder took the partition over mid-run). A "
                       "run that failed for another reason passes: it is not a fence "
                       "conflict."),
        AssetCheckSpec(DEAD_LETTER_CHECK, asset=spec.name, partitions_def=partitions,
                       description="The run dead-lettered no message (a warning otherwise: "
                       "new dead letters since the partition's previous successful run; the "
                       "backlog sensor's observations give each partition's count, latest "
                       "sequence and reason)."),
    ]
    keys = {spec.nats_resource_key, spec.warehouse_resource_key, spec.runs_resource_key}
    if spec.uses_spark:
        keys.add(spec.spark_resource_key)
    kinds = set(spec.kinds) if spec.kinds is not None else (
        {"nats", "delta", "spark"} if spec.uses_spark else {"nats", "delta"})

    @asset(
        freshness_policy=spec.freshness_policy,
        name=spec.name,
        key_prefix=spec.key_prefix,
        group_name=spec.group_name,
        partitions_def=partitions,
        check_specs=checks,
        description=spec.description or f"Consumer group {spec.group} on {spec.stream}.",
        kinds=kinds,
        pool=spec.pool,
        required_resource_keys=keys,
        io_manager_key=spec.io_manager_key,
        metadata={"cg/stream": spec.stream, "cg/group": spec.group,
                  "cg/partitions": spec.partitions, "cg/table": spec.table_name,
                  "cg/partition_key_prefix": spec.effective_partition_key_prefix,
                  "cg/write_mode": spec.write.name,
                  **({"cg/merge_key": ", ".join(spec.write.keys)}
                     if isinstance(spec.write, Merge) else {}),
                  **spec.metadata},
    )
    def _group_asset(context: AssetExecutionContext, config: PartitionRunConfig
                     ) -> Iterator[MaterializeResult | AssetCheckResult]:
        try:
            with run_alive(context, spec):
                if not spec.uses_spark:
                    result = _materialize(context, spec, config)
                else:
                    with stopping_foreign_spark(context, spec.spark_resource_key):
                        result = _materialize(context, spec, config)
        except Exception as e:
            # The partition's checks say what a failed run means for each of them (else
            # Dagster marks them all "execution failed").
            yield from failed_run_checks(e)
            raise
        yield result

    return _group_asset


@dataclass(frozen=True)
class GroupRun:
    """What a partition run of a group asset works with, resolved from the asset's spec
    before it touches the partition (``_resolve``; running and reporting then read this
    only): the group's ``stream`` and ``group``, the ``table_name`` and ``write_mode``, the
    ``partition``, its ``owner`` member and the group config's ``revision``, the run's
    ``mode`` (``drain``/``rebuild``), the runs it ``waited`` for, the table ``sink``, the
    ``processor`` (bound to the run's Spark session if it uses Spark) and the ``nats`` and
    ``runs`` resources."""

    stream: str
    group: str
    table_name: str
    write_mode: str
    partition: int
    owner: str
    revision: int
    mode: str
    waited: list[str]
    sink: TableSink
    processor: Processor
    nats: NatsResource
    runs: PartitionRunsResource


def _materialize(context: AssetExecutionContext, spec: ConsumerGroupAsset,
                 config: PartitionRunConfig) -> MaterializeResult:
    run = _resolve(context, spec, config)
    result = _run(context, config, run)
    return _report(run, result)


def _resolve(context: AssetExecutionContext, spec: ConsumerGroupAsset,
             config: PartitionRunConfig) -> GroupRun:
    """Tag the run, wait for earlier runs of its partition, check this deployment serves the
    partition's owner, and make the run's sink and processor (nothing is leased yet).

    Raises:
        Failure: an earlier run is still in progress after ``run_timeout_s``, the group's
            config cannot be read, or another deployment serves the partition's owner.
    """
    res = context.resources
    nats_res: NatsResource = getattr(res, spec.nats_resource_key)
    warehouse: Warehouse = getattr(res, spec.warehouse_resource_key)
    runs: PartitionRunsResource = getattr(res, spec.runs_resource_key)
    p = spec.partition_of(context.partition_key)
    # The code version (retry rule) and this run's worker process (lost-run detection), for
    # the backlog sensor (cg_pipelines.dagster.history).
    context.instance.add_run_tags(context.run.run_id, {
        CODE_TAG: spec.current_code_version()})
    waited = wait_for_earlier_runs(context, runs.run_timeout_s)
    try:
        v = load_group_config(nats_res, spec)
    except TICK_ERRORS as e:
        raise Failure(f"cannot read consumer group {spec.stream}.{spec.group}: {e}") from e
    owner = owners(assignment(v.config)).get(p)
    served = runs.served()
    if owner is None or (served is not None and owner not in served):
        raise Failure(
            f"partition {p} of {spec.stream}.{spec.group} is owned by "
            f"{owner or 'no member'}; this deployment serves "
            f"{', '.join(served) if served else 'every member'}")
    mode = run_mode(context.run.tags, config)
    sink = warehouse.sink(spec.table_name, write=spec.write,
                          commit_metadata={"dagster_run_id": context.run.run_id},
                          maintenance=spec.maintenance)
    processor = spec.processor
    if spec.uses_spark:
        processor = processor.bind(run_spark_session(getattr(res, spec.spark_resource_key)))
    return GroupRun(spec.stream, spec.group, spec.table_name, spec.write.name, p, owner,
                    v.revision, mode, waited, sink, processor, nats_res, runs)


def _run(context: AssetExecutionContext, config: PartitionRunConfig, run: GroupRun) -> RunResult:
    """Drain (or rebuild) the partition through the engine; log its summary line.

    Raises:
        Failure: the engine raised (:func:`run_failure`: the cause first, then the
            partition's facts).
    """
    p, sink, processor, opts = run.partition, run.sink, run.processor, run.runs.engine_options()
    progress = RunProgress(context.log, p)
    try:
        if run.mode == "rebuild":
            result = run.nats.run(
                lambda nc: rebuild_partition(nc, run.stream, run.group, p, processor, sink,
                                             opts, allow_partial=config.allow_partial,
                                             hook=progress),
                timeout_s=run.runs.run_timeout_s)
        else:
            result = run.nats.run(
                lambda nc: run_partition(nc, run.stream, run.group, p, processor, sink, opts,
                                         hook=progress),
                timeout_s=run.runs.run_timeout_s)
    except Exception as e:
        raise run_failure(e, run, p) from trim_traceback(e)
    context.log.info(summary_line(p, result))
    return result


def _report(run: GroupRun, result: RunResult) -> MaterializeResult:
    """The materialization of a run that ended: its metadata (the run's figures, the table's:
    :func:`table_metadata`, ``table_versions``) and the three check results.

    Raises:
        Failure: the run halted at a message (``dead_letter_policy='halt'``) or processed
            nothing because another holder has the partition (``held``); with the metadata.
    """
    p = run.partition
    md = _run_metadata(result, run.owner, run.revision)
    md["mode"] = run.mode
    md["write_mode"] = run.write_mode
    md["table_versions"] = MetadataValue.json(run.sink.versions_written)
    if result.maintenance:
        md["maintenance"] = MetadataValue.json(result.maintenance)
    md["waited_for_runs"] = ", ".join(run.waited)
    if run.mode == "rebuild":
        md.update({"rebuilt": result.status == "rebuilt",
                   "origin_first_seq": result.origin_first_seq or 0,
                   "origin_last_seq": result.origin_last_seq or 0,
                   "messages_read": result.messages_read,
                   "rows_replaced": result.rows_replaced,
                   "rows_written": result.rows_written})
    if result.status == "halted":
        raise Failure(f"{result.detail}\npartition {p} of {run.stream}.{run.group} halted "
                      f"there (dead_letter_policy='halt'): see it with `cg halt show "
                      f"{run.stream} {run.group} {p}`, move it to the dead letters with "
                      f"`cg halt skip {run.stream} {run.group} {p} --reason TEXT`",
                      metadata=md)
    if result.status == "held":
        # Not a materialization: nothing was processed. Failing makes the sensor retry it
        # after its backoff (the holder's lease returns within the ack wait).
        raise Failure(f"partition {p} was not processed: {result.detail}; it is retried "
                      "when the holder lets go", metadata=md)
    md.update(table_metadata(run.sink, p, run.table_name))
    return MaterializeResult(metadata=md, check_results=_check_results(result))


def _check_results(result: RunResult) -> list[AssetCheckResult]:
    """The partition's three check results of a run that ended (drained, fence, dead
    letters)."""
    drained = result.status in ("drained", "empty", "rebuilt")
    return [
        AssetCheckResult(
            check_name=DRAINED_CHECK, passed=drained, severity=AssetCheckSeverity.WARN,
            description=f"{result.status}: {result.detail}" if result.detail else
            result.status,
            metadata={"status": result.status, "detail": result.detail}),
        AssetCheckResult(
            check_name=FENCE_CHECK, passed=result.fence_conflicts == 0,
            severity=AssetCheckSeverity.WARN,
            description=f"{result.fence_conflicts} commit(s) refused by the fence: "
            f"{result.detail}" if result.fence_conflicts else "no commit refused",
            metadata={"fence_conflicts": result.fence_conflicts,
                      "detail": result.detail}),
        AssetCheckResult(
            check_name=DEAD_LETTER_CHECK, passed=result.dead_lettered == 0,
            severity=AssetCheckSeverity.WARN,
            description=f"{result.dead_lettered:,} message(s) dead-lettered (dead-letter "
            "stream: cg dlq ls)" if result.dead_lettered else "none dead-lettered",
            metadata={"dead_lettered": result.dead_lettered}),
    ]
