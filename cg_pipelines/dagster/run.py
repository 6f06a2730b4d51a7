"""A partition run, one input or a set alike: resolve it, run it (:func:`engine_run`, the ONE
call into the engine), report it. One run per partition at a time however it was launched: it
waits for earlier in-progress runs of its ``dagster/partition`` key (and with a tag concurrency
limit on that key in ``dagster.yaml`` launched runs wait in the queue); leases and the fence
stay the last line. It keeps a heartbeat in NATS and tags its worker (:func:`run_alive`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from dagster import (
    AssetCheckResult,
    AssetExecutionContext,
    AssetKey,
    Config,
    DagsterRun,
    DagsterRunStatus,
    Failure,
    MaterializeResult,
    MetadataValue,
    RunsFilter,
    TableColumn,
    TableColumnConstraints,
    TableSchema,
)
from pydantic import Field as PydanticField

from cg_pipelines.core.assignment import assignment, owners
from cg_pipelines.core.errors import failure_report, trim_traceback
from cg_pipelines.dagster.checks import failed_run_checks, run_check_results
from cg_pipelines.dagster.history import CODE_TAG, HEARTBEAT_TAG, MODE_TAG, run_worker_tags
from cg_pipelines.dagster.resources import (
    NatsResource,
    PartitionRunsResource,
    run_spark_session,
    stopping_foreign_spark,
)
from cg_pipelines.dagster.spec import TICK_ERRORS, StreamAsset, load_configs
from cg_pipelines.dagster.warehouse import Warehouse
from cg_pipelines.engine.inputs import run_inputs, sides_by_input
from cg_pipelines.engine.result import SideResult
from cg_pipelines.sinks.base import TableSink, TableStats

__all__ = ["PROGRESS_EVERY_S", "Outcome", "PartitionRunConfig", "Resolved", "RunProgress",
           "engine_run", "materialize", "run_alive", "run_failure", "run_mode",
           "table_metadata", "trim_traceback", "wait_for_earlier_runs"]

PROGRESS_EVERY_S = 10.0
"""A run logs its progress at most once per this many seconds (and once at the end)."""


class PartitionRunConfig(Config):
    """Run config of a partition run (Launchpad: ``ops.<asset>.config``)."""

    mode: Literal["drain", "rebuild"] = PydanticField(
        "drain", description="drain: process the partition's backlog (the default). rebuild: "
        "recompute the partition from the origin streams' history with today's code and "
        "replace its rows atomically.")
    allow_partial: bool = PydanticField(
        False, description="rebuild only: go on when retention trimmed an origin stream's "
        "first messages (their effects are then missing).")


def run_mode(tags: Mapping[str, str], config: PartitionRunConfig) -> str:
    """The ``cg/mode`` tag, else the run config's ``mode``; ``Failure`` for another tag."""
    tag = tags.get(MODE_TAG)
    if tag is None:
        return config.mode
    if tag not in ("drain", "rebuild"):
        raise Failure(f"run tag {MODE_TAG}={tag!r}: expected 'drain' or 'rebuild'")
    return tag


@contextlib.contextmanager
def run_alive(context: AssetExecutionContext, spec: StreamAsset) -> Iterator[None]:
    """Keep the run's heartbeat in NATS while the block runs (TTL ``heartbeat_ttl_s``; the
    first beat tried for ``nats_retry_max_s``), and tag the run with its worker process
    (:data:`~cg_pipelines.dagster.history.WORKER_TAG`) and, once a beat was stored,
    :data:`~cg_pipelines.dagster.history.HEARTBEAT_TAG`. A heartbeat NATS does not take is a
    warning, never a failure: the run is then judged lost only on its own host."""
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


_ACTIVE = [DagsterRunStatus.STARTING, DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING]


def _targets(run: DagsterRun, key: AssetKey) -> bool:
    """Whether ``run`` materializes asset ``key`` (or selects no asset: all of its job's)."""
    return not run.asset_selection or key in run.asset_selection


def wait_for_earlier_runs(context: AssetExecutionContext, timeout_s: float,
                          poll_s: float = 1.0) -> list[str]:
    """Wait until no run of this asset partition that started earlier is in progress; returns
    the ids of the runs waited for.

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


class RunProgress:
    """The engine hook of a run: after a commit, at most every :data:`PROGRESS_EVERY_S`
    seconds, one progress line."""

    def __init__(self, log: Any, partition: int, every_s: float = PROGRESS_EVERY_S) -> None:
        self.log, self.partition, self.every_s = log, partition, every_s
        self._last = time.monotonic()

    def __call__(self, step: str, info: dict[str, Any]) -> None:
        now = time.monotonic()
        if step != "committed" or now - self._last < self.every_s:
            return
        self._last = now
        seconds = float(info.get("seconds") or 0.0)
        if "processed" not in info:
            self.log.info(f"partition {self.partition}: {info.get('commits', 0):,} joint "
                          f"commit(s) in {seconds:.1f} s")
            return
        rate = info["processed"] / seconds if seconds > 0 else 0.0
        self.log.info(
            f"partition {self.partition}: {info['processed']:,} messages committed through "
            f"sequence {info['last_seq']}, {info.get('left', 0):,} left, "
            f"{info.get('dead_lettered', 0):,} dead-lettered, {rate:,.0f} msg/s")


@dataclass(frozen=True)
class Resolved:
    """What a run works with, resolved before it touches the partition (the processor bound
    to the run's Spark session if it uses Spark)."""

    partition: int
    owner: str
    revision: int
    mode: str
    waited: list[str]
    sink: TableSink
    processor: Any
    nats: NatsResource
    runs: PartitionRunsResource


@dataclass
class Outcome:
    """A run that ended, as this layer reports it; ``sides``: each input's
    :class:`~cg_pipelines.engine.result.SideResult` by input name; ``rows_replaced``: a
    rebuild's rows replaced in the partition."""

    status: str
    detail: str
    commits: int
    fence_conflicts: int
    seconds: float
    rows_written: int
    rows_replaced: int
    sides: dict[str, SideResult]
    timings: dict[str, float] = field(default_factory=dict)
    maintenance: dict[str, int | float | str] = field(default_factory=dict)

    def total(self, name: str) -> int:
        """The sum of the inputs' ``name`` figure (e.g. ``processed``)."""
        return sum(int(getattr(r, name)) for r in self.sides.values())


def engine_run(spec: StreamAsset, run: Resolved, allow_partial: bool, hook: RunProgress
               ) -> Outcome:
    """Drain (or rebuild) the partition: the only call into the engine of the Dagster layer,
    :func:`~cg_pipelines.engine.inputs.run_inputs` (the Airflow layer's too).

    Raises:
        What the engine raises (:class:`~cg_pipelines.core.errors.PartitionRunError` ...).
    """
    r = run.nats.run(lambda nc: run_inputs(
        nc, spec.inputs, run.partition, run.processor, run.sink, run.runs.engine_options(),
        rebuild=run.mode == "rebuild", allow_partial=allow_partial, hook=hook),
        timeout_s=run.runs.run_timeout_s)
    return Outcome(r.status, r.detail, r.commits, r.fence_conflicts, r.seconds, r.rows_written,
                   r.rows_replaced, sides_by_input(spec.inputs, r), r.timings, r.maintenance)


def materialize(context: AssetExecutionContext, spec: StreamAsset, config: PartitionRunConfig
                ) -> Iterator[MaterializeResult | AssetCheckResult]:
    """The asset op's body: resolve, run, report (a failed run: its check results, raised)."""
    try:
        with run_alive(context, spec), (
                stopping_foreign_spark(context, spec.spark_resource_key) if spec.uses_spark
                else contextlib.nullcontext()):
            run = _resolve(context, spec, config)
            progress = RunProgress(context.log, run.partition)
            try:
                outcome = engine_run(spec, run, config.allow_partial, progress)
            except Exception as e:
                raise run_failure(e, spec, run.partition) from trim_traceback(e)
            context.log.info(_summary(run.partition, outcome))
            result = _report(spec, run, outcome)
    except Exception as e:
        yield from failed_run_checks(spec, e)
        raise
    yield result


def _resolve(context: AssetExecutionContext, spec: StreamAsset, config: PartitionRunConfig
             ) -> Resolved:
    """Tag the run, wait for earlier runs, read the configs, check the owner is served here,
    make the sink and the processor.

    Raises:
        Failure: an earlier run still in progress after ``run_timeout_s``, the configs cannot
            be read or the set is not co-partitioned, or another deployment serves the owner.
    """
    res = context.resources
    nats_res: NatsResource = getattr(res, spec.nats_resource_key)
    warehouse: Warehouse = getattr(res, spec.warehouse_resource_key)
    runs: PartitionRunsResource = getattr(res, spec.runs_resource_key)
    p = spec.partition_of(context.partition_key)
    context.instance.add_run_tags(context.run.run_id, {CODE_TAG: spec.current_code_version()})
    waited = wait_for_earlier_runs(context, runs.run_timeout_s)
    try:
        configs = load_configs(nats_res, spec)
    except TICK_ERRORS as e:
        raise Failure(f"cannot read {spec.title}: {e}") from e
    owner = owners(assignment(configs[0].config)).get(p)
    served = runs.served()
    if owner is None or (served is not None and owner not in served):
        raise Failure(
            f"partition {p} of {spec.title} is owned by {owner or 'no member'}; this "
            f"deployment serves {', '.join(served) if served else 'every member'}")
    sink = warehouse.sink(spec.table_name, write=spec.write,
                          commit_metadata={"dagster_run_id": context.run.run_id},
                          maintenance=spec.maintenance)
    processor = spec.processor
    if spec.uses_spark:
        processor = processor.bind(run_spark_session(getattr(res, spec.spark_resource_key)))
    return Resolved(p, owner, max(c.revision for c in configs),
                    run_mode(context.run.tags, config), waited, sink, processor, nats_res, runs)


def _summary(p: int, o: Outcome) -> str:
    """The run's last log line: status, messages per input, every message counted, time."""
    handled = o.total("processed") + o.total("dead_lettered") + o.total("duplicates_skipped")
    per = f" ({', '.join(f'{n} {r.processed:,}' for n, r in o.sides.items())})" \
        if len(o.sides) > 1 else ""
    rate = o.total("processed") / o.seconds if o.seconds > 0 else 0.0
    line = (f"partition {p}: {o.status}, {o.total('processed'):,} messages committed{per} of "
            f"{handled:,} handled ({o.total('dead_lettered'):,} dead-lettered, "
            f"{o.total('duplicates_skipped'):,} already committed and skipped) in "
            f"{o.commits} commit(s), {o.seconds:.1f} s ({rate:,.0f}/s)")
    return f"{line}; {o.detail}" if o.detail else line


def _report(spec: StreamAsset, run: Resolved, o: Outcome) -> MaterializeResult:
    """The materialization: the run's figures, each input's (``<input>/...`` on a set; all in
    ``lineage``), the table's (:func:`table_metadata`) and the check results.

    Raises:
        Failure: the run halted at a message (``dead_letter_policy='halt'``) or processed
            nothing because another holder has the partition (``held``); with the metadata.
    """
    p, processed = run.partition, o.total("processed")
    md: dict[str, Any] = {
        "status": o.status, "mode": run.mode, "write_mode": spec.write.name,
        "messages": processed, "dead_lettered": o.total("dead_lettered"),
        "duplicates_skipped": o.total("duplicates_skipped"), "commits": o.commits,
        "fence_conflicts": o.fence_conflicts, "rows_written": o.rows_written,
        "seconds": MetadataValue.float(round(o.seconds, 3)),
        "messages_per_second": MetadataValue.float(
            round(processed / o.seconds, 1) if o.seconds > 0 else 0.0),
        "owner_member": run.owner, "config_revision": run.revision, "detail": o.detail or "",
        "timings": MetadataValue.json({k: round(v, 3) for k, v in o.timings.items()}),
        "table_versions": MetadataValue.json(run.sink.versions_written),
        "waited_for_runs": ", ".join(run.waited)}
    lineage = []
    for inp in spec.inputs:
        row = o.sides[inp.name].lineage(rebuild=run.mode == "rebuild",
                                        rows_replaced=o.rows_replaced)
        lineage.append({"input": inp.name, **row})
        md.update({f"{spec.md_prefix(inp)}{k}": v for k, v in row.items()})
    md["lineage"] = MetadataValue.json(lineage)
    if run.mode == "rebuild":
        md["rebuilt"] = o.status == "rebuilt"
    if o.maintenance:
        md["maintenance"] = MetadataValue.json(o.maintenance)
    if o.status == "halted":
        inp = spec.inputs[0]
        where = f"{inp.stream} {inp.group} {p}"
        raise Failure(f"{o.detail}\npartition {p} of {inp.stream}.{inp.group} halted there "
                      f"(dead_letter_policy='halt'): see it with `cg halt show {where}`, move "
                      f"it to the dead letters with `cg halt skip {where} --reason TEXT`",
                      metadata=md)
    if o.status == "held":
        # Not a materialization: nothing was processed. Failing makes the sensor retry it
        # after its backoff (the holder's lease returns within the ack wait).
        raise Failure(f"partition {p} was not processed: {o.detail}; it is retried when the "
                      "holder lets go", metadata=md)
    md.update(table_metadata(run.sink, p, spec.table_name))
    return MaterializeResult(metadata=md, check_results=run_check_results(
        spec, o.status, o.detail, o.fence_conflicts,
        {n: r.dead_lettered for n, r in o.sides.items()}))


def table_metadata(sink: TableSink, partition: int, table: str) -> dict[str, Any]:
    """The table's metadata after a run: ``dagster/table_name``, ``dagster/uri``,
    ``dagster/storage_kind``, once it exists ``dagster/row_count``,
    ``dagster/partition_row_count``, ``dagster/column_schema`` and ``table_version``.

    Raises:
        Storage errors of the sink's reads.
    """
    md: dict[str, Any] = {"dagster/table_name": table, "dagster/uri": sink.uri,
                          "dagster/storage_kind": sink.table_format}
    stats: TableStats | None = sink.stats(partition) if sink.exists() else None
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


def run_failure(error: Exception, spec: StreamAsset, partition: int) -> Failure:
    """The ``Failure`` of a failed run: the cause first (``<type>: <message>``), then the
    partition facts of the engine's :class:`~cg_pipelines.core.errors.PartitionRunError` (or
    that nothing was leased), also as metadata fields
    (:func:`~cg_pipelines.core.errors.failure_report`)."""
    text, md = failure_report(error, ", ".join(f"{i.stream}.{i.group}" for i in spec.inputs),
                              partition)
    return Failure(text, metadata=md)
