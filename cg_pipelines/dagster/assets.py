"""The partitioned asset of a consumer group, its job and its asset checks.

Each run drains one group partition through the ordered engine
(:func:`cg_pipelines.engine.run_partition`) into the group's Delta table.

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


import asyncio
import concurrent.futures
import os
import threading
import time
import types
from collections.abc import Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetKey,
    AssetsDefinition,
    Config,
    DagsterRun,
    DagsterRunStatus,
    Failure,
    FreshnessPolicy,
    MaterializeResult,
    MetadataValue,
    RunsFilter,
    StaticPartitionsDefinition,
    TableColumn,
    TableColumnConstraints,
    TableSchema,
    asset,
)
from pydantic import Field as PydanticField

from cg_pipelines.core.assignment import assignment, owners
from cg_pipelines.core.errors import (
    PartitionRunError,
    cause_text,
    exception_chain,
    one_line,
)
from cg_pipelines.core.write import Merge
from cg_pipelines.dagster.history import CODE_TAG, MODE_TAG, run_worker_tags
from cg_pipelines.dagster.resources import (
    DeltaWarehouseResource,
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
from cg_pipelines.engine.rebuild import rebuild_partition
from cg_pipelines.engine.result import RunResult
from cg_pipelines.engine.runner import run_partition
from cg_pipelines.sinks.base import FenceConflictError
from cg_pipelines.sinks.delta import DeltaSink, TableStats

__all__ = [
    "PartitionRunConfig",
    "RunProgress",
    "build_group_asset",
    "wait_for_earlier_runs",
]

class PartitionRunConfig(Config):
    """Run config of a consumer-group asset's run (Launchpad: ``ops.<asset>.config``)."""

    mode: Literal["drain", "rebuild"] = PydanticField(
        "drain", description="drain: process the partition's backlog (the default). rebuild: "
        "recompute the partition from the origin stream's history with today's code and "
        "replace its rows atomically (cg_pipelines.engine.rebuild_partition).")
    allow_partial: bool = PydanticField(
        False, description="rebuild only: go on when retention trimmed the origin stream's "
        "first messages (their effects are then missing).")


def run_mode(tags: Mapping[str, str], config: PartitionRunConfig) -> str:
    """The run's mode: the ``cg/mode`` tag when set (``drain`` or ``rebuild``), else the run
    config's ``mode``. Raises ``Failure`` for another tag value."""
    tag = tags.get(MODE_TAG)
    if tag is None:
        return config.mode
    if tag not in ("drain", "rebuild"):
        raise Failure(f"run tag {MODE_TAG}={tag!r}: expected 'drain' or 'rebuild'")
    return tag


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


def _table_metadata(stats: TableStats | None, uri: str, table: str,
                    table_format: str = "delta") -> dict[str, Any]:
    """Dagster's standard table metadata keys (``dagster/table_name``, ``dagster/uri``,
    ``dagster/row_count``, ``dagster/partition_row_count``, ``dagster/column_schema``,
    ``dagster/storage_kind`` = ``table_format``; the catalog shows them) plus the table's
    version (``delta_version``: a Delta version, or an Iceberg table's sequence number)."""
    md: dict[str, Any] = {"dagster/table_name": table, "dagster/uri": uri,
                          "dagster/storage_kind": table_format}
    if stats is None:
        return md
    md["dagster/row_count"] = MetadataValue.int(stats.rows)
    if stats.partition_rows is not None:
        md["dagster/partition_row_count"] = MetadataValue.int(stats.partition_rows)
    md["dagster/column_schema"] = MetadataValue.table_schema(TableSchema(columns=[
        TableColumn(f.name, str(f.type), constraints=TableColumnConstraints(nullable=f.nullable))
        for f in stats.schema]))
    md["delta_version"] = stats.version
    return md


def build_group_asset(spec: ConsumerGroupAsset) -> AssetsDefinition:
    """The partitioned asset of ``spec`` with its three partitioned asset checks (results of
    each run, also when it fails: :func:`failed_run_checks`) and its freshness policy
    (:func:`freshness_policy_of`)."""
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
        freshness_policy=freshness_policy_of(spec),
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


DRAINED_CHECK = "backlog_drained"
FENCE_CHECK = "no_unexplained_fence_conflicts"
DEAD_LETTER_CHECK = "no_new_dead_letters"


def freshness_policy_of(spec: ConsumerGroupAsset) -> FreshnessPolicy | None:
    """The group asset's Dagster freshness policy (the 1.13 ``FreshnessPolicy`` API), derived
    from ``spec.lag_objective_s``: warn when no partition was materialized for the objective
    plus one sensor interval (at least 60 s, Dagster's minimum), fail after twice that.
    ``None`` without an objective. A group
    whose stream is idle for that long shows as stale too: no run, no materialization."""
    if spec.lag_objective_s is None:
        return None
    warn = max(60.0, spec.lag_objective_s + spec.sensor_interval_s)
    return FreshnessPolicy.time_window(fail_window=timedelta(seconds=2 * warn),
                                       warn_window=timedelta(seconds=warn))


def _cause(e: BaseException) -> str:
    return one_line(getattr(e, "description", None) or str(e)) or type(e).__name__


def _fenced(e: BaseException) -> bool:
    return any(isinstance(x, FenceConflictError) for x in exception_chain(e))


def failed_run_checks(e: BaseException) -> list[AssetCheckResult]:
    """The partition's check results of a run that raised ``e``: ``backlog_drained`` fails
    (its description is the cause, up to
    :data:`~cg_pipelines.core.errors.CAUSE_CHARS` characters); ``no_unexplained_fence_conflicts``
    fails only when the cause is a fence conflict (a ``FenceConflictError`` in the chain, or
    a ``Failure`` whose metadata counts ``fence_conflicts``), else passes;
    ``no_new_dead_letters`` is evaluated when a ``Failure``'s metadata counts ``dead_lettered``
    (a halted or held run), else left to Dagster (execution failed)."""
    md = dict(getattr(e, "metadata", None) or {})

    def count(name: str) -> int | None:
        v = md.get(name)
        v = getattr(v, "value", v)
        return int(v) if isinstance(v, int) else None

    cause = _cause(e)
    fences = count("fence_conflicts") or 0
    fenced = fences > 0 or _fenced(e)
    out = [
        AssetCheckResult(check_name=DRAINED_CHECK, passed=False, severity=AssetCheckSeverity.WARN,
                         description=cause, metadata={"error_type": type(e).__name__}),
        AssetCheckResult(check_name=FENCE_CHECK, passed=not fenced,
                         severity=AssetCheckSeverity.WARN,
                         description=f"fence conflict: {cause}" if fenced else
                         "the run failed, not for a fence conflict",
                         metadata={"fence_conflicts": fences, "run_failed": True}),
    ]
    dead = count("dead_lettered")
    if dead is not None:
        out.append(AssetCheckResult(
            check_name=DEAD_LETTER_CHECK, passed=dead == 0, severity=AssetCheckSeverity.WARN,
            description=f"{dead} message(s) dead-lettered" if dead else "none dead-lettered",
            metadata={"dead_lettered": dead}))
    return out


_ACTIVE = [DagsterRunStatus.STARTING, DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING]


def _targets(run: DagsterRun, key: AssetKey) -> bool:
    """Whether ``run`` materializes asset ``key`` (a run without an explicit asset selection,
    e.g. a whole asset job or the implicit one, is taken to: its partition key, qualified by the
    group, already names the partition)."""
    return not run.asset_selection or key in run.asset_selection


def wait_for_earlier_runs(context: AssetExecutionContext, timeout_s: float,
                          poll_s: float = 1.0) -> list[str]:
    """Wait until no other run of this asset partition that started before this one is in
    progress (see the module docstring). Returns the ids of the runs waited for.

    Raises:
        Failure: still waiting after ``timeout_s`` seconds (nothing was consumed).
    """
    instance, me = context.instance, context.run.run_id
    key = context.partition_key
    mine = instance.get_run_record_by_id(me)
    my_order = ((mine.start_time or time.time()) if mine else time.time(), me)
    waited: list[str] = []
    deadline = time.monotonic() + timeout_s
    while True:
        records = instance.get_run_records(RunsFilter(
            tags={"dagster/partition": key}, statuses=_ACTIVE))
        earlier = [r.dagster_run.run_id for r in records
                   if r.dagster_run.run_id != me and r.start_time is not None
                   and (r.start_time, r.dagster_run.run_id) < my_order
                   and _targets(r.dagster_run, context.asset_key)]
        if not earlier:
            return waited
        for run_id in earlier:
            if run_id not in waited:
                waited.append(run_id)
                context.log.info(f"partition {key}: waiting for run {run_id}, which started "
                                 "first, to finish")
        if time.monotonic() > deadline:
            raise Failure(f"partition {key} is still being processed by run(s) "
                          f"{', '.join(earlier)} after {timeout_s:g} s; nothing was consumed")
        time.sleep(poll_s)


def _materialize(context: AssetExecutionContext, spec: ConsumerGroupAsset,
                 config: PartitionRunConfig) -> MaterializeResult:
    res = context.resources
    nats_res: NatsResource = getattr(res, spec.nats_resource_key)
    warehouse: DeltaWarehouseResource = getattr(res, spec.warehouse_resource_key)
    runs: PartitionRunsResource = getattr(res, spec.runs_resource_key)
    p = spec.partition_of(context.partition_key)
    # The code version (retry rule) and this run's worker process (lost-run detection), for
    # the backlog sensor (cg_pipelines.dagster.history).
    context.instance.add_run_tags(context.run.run_id, {
        CODE_TAG: spec.current_code_version(), **run_worker_tags()})
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
    progress = RunProgress(context.log, p)
    try:
        if mode == "rebuild":
            result = nats_res.run(
                lambda nc: rebuild_partition(nc, spec.stream, spec.group, p, processor, sink,
                                             runs.engine_options(),
                                             allow_partial=config.allow_partial,
                                             hook=progress),
                timeout_s=runs.run_timeout_s)
        else:
            result = nats_res.run(
                lambda nc: run_partition(nc, spec.stream, spec.group, p, processor, sink,
                                         runs.engine_options(), hook=progress),
                timeout_s=runs.run_timeout_s)
    except Exception as e:
        raise run_failure(e, spec, p) from trim_traceback(e)
    context.log.info(summary_line(p, result))
    md = _run_metadata(result, owner, v.revision)
    md["mode"] = mode
    md["write_mode"] = spec.write.name
    md["delta_versions"] = MetadataValue.json(sink.versions_written)
    if result.maintenance:
        md["maintenance"] = MetadataValue.json(result.maintenance)
    md["waited_for_runs"] = ", ".join(waited)
    if mode == "rebuild":
        md.update({"rebuilt": result.status == "rebuilt",
                   "origin_first_seq": result.origin_first_seq or 0,
                   "origin_last_seq": result.origin_last_seq or 0,
                   "messages_read": result.messages_read,
                   "rows_replaced": result.rows_replaced,
                   "rows_written": result.rows_written})
    if result.status == "halted":
        raise Failure(f"{result.detail}\npartition {p} of {spec.stream}.{spec.group} halted "
                      f"there (dead_letter_policy='halt'): see it with `cg halt show "
                      f"{spec.stream} {spec.group} {p}`, move it to the dead letters with "
                      f"`cg halt skip {spec.stream} {spec.group} {p} --reason TEXT`",
                      metadata=md)
    if result.status == "held":
        # Not a materialization: nothing was processed. Failing makes the sensor retry it
        # after its backoff (the holder's lease returns within the ack wait).
        raise Failure(f"partition {p} was not processed: {result.detail}; it is retried "
                      "when the holder lets go", metadata=md)
    md.update(_table_metadata(_stats(sink, p), sink.uri, spec.table_name,
                              sink.table_format))
    drained = result.status in ("drained", "empty", "rebuilt")
    return MaterializeResult(
        metadata=md,
        check_results=[
            AssetCheckResult(
                check_name=DRAINED_CHECK, passed=drained, severity=AssetCheckSeverity.WARN,
                description=f"{result.status}: {result.detail}" if result.detail else
                result.status,
                metadata={"partition": p, "status": result.status, "detail": result.detail}),
            AssetCheckResult(
                check_name=FENCE_CHECK, passed=result.fence_conflicts == 0,
                severity=AssetCheckSeverity.WARN,
                description=f"{result.fence_conflicts} commit(s) refused by the fence: "
                f"{result.detail}" if result.fence_conflicts else "no commit refused",
                metadata={"partition": p, "fence_conflicts": result.fence_conflicts,
                          "detail": result.detail}),
            AssetCheckResult(
                check_name=DEAD_LETTER_CHECK, passed=result.dead_lettered == 0,
                severity=AssetCheckSeverity.WARN,
                description=f"{result.dead_lettered:,} message(s) dead-lettered (dead-letter "
                "stream: cg dlq ls)" if result.dead_lettered else "none dead-lettered",
                metadata={"partition": p, "dead_lettered": result.dead_lettered}),
        ],
    )


def _stats(sink: DeltaSink, partition: int) -> TableStats | None:
    """The table's statistics, or ``None`` when it does not exist (nothing committed yet)."""
    return sink.stats(partition) if sink.exists() else None


def run_failure(error: Exception, spec: ConsumerGroupAsset, partition: int) -> Failure:
    """The ``Failure`` a failed partition run raises: its description starts with the cause
    (``<type>: <message>``, at most :data:`~cg_pipelines.core.errors.CAUSE_CHARS`
    characters), then the partition facts of the engine's
    :class:`~cg_pipelines.core.errors.PartitionRunError` (or, when the engine never started,
    that nothing was leased). Its metadata is those facts, once, as fields."""
    pre = PartitionRunError.of(error)
    md: dict[str, Any] = {"partition": partition, "cause_type": type(error).__name__,
                          "cause": cause_text(error)}
    if pre is None:
        return Failure(f"{cause_text(error)}\npartition {partition} of {spec.stream}."
                       f"{spec.group}: the run failed before it leased anything; nothing was "
                       "committed or acknowledged", metadata=md)
    if pre.inflight is not None:
        md["inflight_first_seq"], md["inflight_last_seq"] = pre.inflight
    if pre.committed_through is not None:
        md["committed_through"] = pre.committed_through
    md["acknowledged_through"] = pre.acknowledged_through
    return Failure(pre.description(), metadata=md)


_PLUMBING = tuple(str(Path(m.__file__).parent) + os.sep for m in (asyncio, concurrent.futures)) + (
    threading.__file__, str(Path(__file__).parents[1]) + os.sep)


def trim_traceback(error: BaseException) -> BaseException:
    """``error`` with its traceback cut to the frames outside ``asyncio``,
    ``concurrent.futures``, ``threading`` and this library (the transform's own frames), so a
    run log shows the user's code, not the event loop. When every frame is such plumbing (the
    error is the library's or NATS'), the frames outside ``asyncio``/``concurrent``/
    ``threading`` are kept. Returns ``error``."""
    frames: list[types.TracebackType] = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    keep = [f for f in frames if not f.tb_frame.f_code.co_filename.startswith(_PLUMBING)]
    if not keep:
        keep = [f for f in frames
                if not f.tb_frame.f_code.co_filename.startswith(_PLUMBING[:-1])] or frames
    if len(keep) == len(frames):
        return error
    trimmed: types.TracebackType | None = None
    for f in reversed(keep):
        trimmed = types.TracebackType(trimmed, f.tb_frame, f.tb_lasti, f.tb_lineno)
    return error.with_traceback(trimmed)
