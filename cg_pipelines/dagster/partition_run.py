"""What every partition run of a Dagster asset shares, a consumer group's
(:mod:`cg_pipelines.dagster.assets`) and a co-partitioned set's
(:mod:`cg_pipelines.dagster.joins`): the run config and mode, waiting for earlier runs of the
same partition, the run checks and what a failed run reports, and the table metadata."""

import asyncio
import concurrent.futures
import contextlib
import os
import threading
import time
import types
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetExecutionContext,
    AssetKey,
    Config,
    DagsterRun,
    DagsterRunStatus,
    Failure,
    MetadataValue,
    RunsFilter,
    TableColumn,
    TableColumnConstraints,
    TableSchema,
)
from pydantic import Field as PydanticField

from cg_pipelines.core.errors import (
    PartitionRunError,
    cause_text,
    exception_chain,
    one_line,
)
from cg_pipelines.dagster.history import HEARTBEAT_TAG, MODE_TAG, run_worker_tags
from cg_pipelines.sinks.base import FenceConflictError
from cg_pipelines.sinks.table import TableSink, TableStats

__all__ = [
    "DEAD_LETTER_CHECK",
    "DRAINED_CHECK",
    "FENCE_CHECK",
    "PartitionRunConfig",
    "failed_run_checks",
    "run_alive",
    "run_failure",
    "run_mode",
    "table_metadata",
    "table_stats",
    "trim_traceback",
    "wait_for_earlier_runs",
]


class GroupNamed(Protocol):
    """What a failed run is named by: the origin ``stream`` and ``group``."""

    @property
    def stream(self) -> str: ...

    @property
    def group(self) -> str: ...


class RunsOf(Protocol):
    """Where a partition run finds its NATS and runs resources (a group or a set asset)."""

    @property
    def nats_resource_key(self) -> str: ...

    @property
    def runs_resource_key(self) -> str: ...


@contextlib.contextmanager
def run_alive(context: AssetExecutionContext, spec: RunsOf) -> Iterator[None]:
    """Keep the run's heartbeat in NATS while the block runs
    (:meth:`~cg_pipelines.dagster.resources.NatsResource.heartbeat`, TTL
    ``heartbeat_ttl_s``) and tag the run with its worker process
    (:data:`~cg_pipelines.dagster.history.WORKER_TAG`) and, once its first beat is stored,
    :data:`~cg_pipelines.dagster.history.HEARTBEAT_TAG`: the backlog sensor judges a run lost
    from another host only by a heartbeat it knows was kept (:mod:`cg_pipelines.core.liveness`).
    A heartbeat NATS does not take within ``nats_retry_max_s`` is logged as a warning and the
    run goes on (it is then never judged lost from another host)."""
    res = context.resources
    runs = getattr(res, spec.runs_resource_key)
    heartbeat = getattr(res, spec.nats_resource_key).heartbeat(
        context.run.run_id, runs.heartbeat_ttl_s, first_beat_s=runs.nats_retry_max_s)
    heartbeat.__enter__()
    try:
        tags = run_worker_tags()
        if heartbeat.started:
            tags[HEARTBEAT_TAG] = f"{runs.heartbeat_ttl_s:g}"
        else:
            context.log.warning(f"run heartbeat not stored ({heartbeat.error}): this run "
                                "cannot be judged lost from another host")
        context.instance.add_run_tags(context.run.run_id, tags)
        yield
    finally:
        heartbeat.__exit__(None, None, None)


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


def table_metadata(sink: TableSink, partition: int, table: str) -> dict[str, Any]:
    """The table's metadata after a run: Dagster's standard keys (``dagster/table_name``,
    ``dagster/uri``, ``dagster/storage_kind`` = the sink's ``table_format``, and once the
    table exists ``dagster/row_count``, ``dagster/partition_row_count`` of ``partition``,
    ``dagster/column_schema``; the catalog shows them) plus ``table_version``: the table's
    version (a Delta version, an Iceberg table's last sequence number).

    Raises:
        Storage errors of the sink's reads.
    """
    md: dict[str, Any] = {"dagster/table_name": table, "dagster/uri": sink.uri,
                          "dagster/storage_kind": sink.table_format}
    stats = table_stats(sink, partition)
    if stats is None:
        return md
    md["dagster/row_count"] = MetadataValue.int(stats.rows)
    if stats.partition_rows is not None:
        md["dagster/partition_row_count"] = MetadataValue.int(stats.partition_rows)
    md["dagster/column_schema"] = MetadataValue.table_schema(TableSchema(columns=[
        TableColumn(f.name, str(f.type), constraints=TableColumnConstraints(nullable=f.nullable))
        for f in stats.schema]))
    md["table_version"] = stats.version
    return md


DRAINED_CHECK = "backlog_drained"
FENCE_CHECK = "no_unexplained_fence_conflicts"
DEAD_LETTER_CHECK = "no_new_dead_letters"


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


def table_stats(sink: TableSink, partition: int) -> TableStats | None:
    """The table's statistics (``partition``'s rows counted), or ``None`` when it does not
    exist (nothing committed yet).

    Raises:
        Storage errors of the sink's reads.
    """
    return sink.stats(partition) if sink.exists() else None


def run_failure(error: Exception, spec: GroupNamed, partition: int) -> Failure:
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


_PLUMBING = tuple(str(Path(str(m.__file__)).parent) + os.sep
                  for m in (asyncio, concurrent.futures)) + (
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
