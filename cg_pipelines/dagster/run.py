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
from cg_pipelines.dagster.history import (
    CODE_TAG,
    HEARTBEAT_TAG,
    MODE_TAG,
    PARTITION_TAG,
    RANGED_TAG,
    partitions_of,
    range_tags,
    run_worker_tags,
)
from cg_pipelines.dagster.resources import (
    NatsResource,
    PartitionRunsResource,
    run_spark_session,
    stopping_foreign_spark,
)
from cg_pipelines.dagster.spec import TICK_ERRORS, StreamAsset, load_configs
from cg_pipelines.dagster.warehouse import Warehouse
from cg_pipelines.engine.inputs import run_inputs, sides_by_input, sides_by_partition
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
                          poll_s: float = 1.0, partitions: dict[int, str] | None = None
                          ) -> list[str]:
    """Wait until no run of this asset's partitions that started earlier is in progress (a
    run of one of them, or a range run over one of them: :data:`~cg_pipelines.dagster.history.
    RANGE_TAG`); returns the ids of the runs waited for. ``partitions``: ``{partition: key}``
    of this run (default: its one partition key, which range runs are not matched against).

    Raises:
        Failure: still waiting after ``timeout_s`` seconds (nothing was consumed).
    """
    instance, me = context.instance, context.run.run_id
    keys = list(partitions.values()) if partitions else [context.partition_key]
    mine = instance.get_run_record_by_id(me)
    my_order = ((mine.start_time or time.time()) if mine else time.time(), me)
    waited: list[str] = []
    deadline = time.monotonic() + timeout_s
    where = keys[0] if len(keys) == 1 else f"{keys[0]}..{keys[-1]}"

    def overlaps(run: DagsterRun) -> bool:
        parts = partitions_of(run.tags)
        if parts is None:
            return run.tags.get(PARTITION_TAG) in keys
        return partitions is not None and any(p in partitions for p in parts)

    while True:
        records = [r for f in ({PARTITION_TAG: keys}, {RANGED_TAG: "true"})
                   for r in instance.get_run_records(RunsFilter(tags=f, statuses=_ACTIVE))]
        earlier = list(dict.fromkeys(
            r.dagster_run.run_id for r in records
            if r.dagster_run.run_id != me and r.start_time is not None
            and (r.start_time, r.dagster_run.run_id) < my_order
            and _targets(r.dagster_run, context.asset_key) and overlaps(r.dagster_run)))
        if not earlier:
            return waited
        for run_id in earlier:
            if run_id not in waited:
                waited.append(run_id)
                context.log.info(f"partition {where}: waiting for run {run_id}, which started "
                                 "first, to finish")
        if time.monotonic() > deadline:
            raise Failure(f"partition {where} is still being processed by run(s) "
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

    partitions: tuple[int, ...]
    owners: dict[int, str]
    revision: int
    mode: str
    waited: list[str]
    sink: TableSink
    processor: Any
    nats: NatsResource
    runs: PartitionRunsResource

    @property
    def partition(self) -> int:
        """The run's first partition (its only one, except in a range run)."""
        return self.partitions[0]

    @property
    def owner(self) -> str:
        """The owning members, distinct, in partition order."""
        return ", ".join(dict.fromkeys(self.owners.values()))


@dataclass
class Outcome:
    """A run that ended, as this layer reports it; ``sides``: each input's
    :class:`~cg_pipelines.engine.result.SideResult` by input name (a range run: every
    partition's side, by app id); ``by_partition``: a range run's side of each partition;
    ``rows_replaced``: a rebuild's rows replaced in the partition."""

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
    by_partition: dict[int, SideResult] = field(default_factory=dict)

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
        nc, spec.inputs, list(run.partitions), run.processor, run.sink,
        run.runs.engine_options(), rebuild=run.mode == "rebuild", allow_partial=allow_partial,
        hook=hook), timeout_s=run.runs.run_timeout_s)
    ranged = len(run.partitions) > 1
    return Outcome(r.status, r.detail, r.commits, r.fence_conflicts, r.seconds, r.rows_written,
                   r.rows_replaced, dict(r.inputs) if ranged else sides_by_input(spec.inputs, r),
                   r.timings, r.maintenance, sides_by_partition(r) if ranged else {})


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
            context.log.info(_summary(_where(run), outcome))
            result = _report(context, spec, run, outcome)
    except Exception as e:
        yield from _selected(context, failed_run_checks(spec, e))
        raise
    yield result


def _selected(context: AssetExecutionContext, results: list[AssetCheckResult]
              ) -> list[AssetCheckResult]:
    """The results of the checks this run executes (a range run executes none: Dagster 1.13
    records a range run's check result without a partition)."""
    names = {k.name for k in context.selected_asset_check_keys}
    return [r for r in results if r.check_name in names]


def _where(run: Resolved) -> str:
    """``partition <p>`` or ``partitions <first>..<last>``."""
    ps = run.partitions
    return f"partition {ps[0]}" if len(ps) == 1 else f"partitions {ps[0]}..{ps[-1]}"


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
    keys = list(context.partition_keys)
    parts = tuple(spec.partition_of(k) for k in keys)
    mode = run_mode(context.run.tags, config)
    tags = {CODE_TAG: spec.current_code_version()}
    if len(parts) > 1:
        if spec.is_set or mode == "rebuild":
            raise Failure(f"{'a rebuild' if mode == 'rebuild' else 'a co-partitioned set'} "
                          f"runs one partition per run, this run has {len(parts)} "
                          f"({keys[0]}..{keys[-1]}): launch them one per run")
        tags.update(range_tags(min(parts), max(parts)))
    context.instance.add_run_tags(context.run.run_id, tags)
    waited = wait_for_earlier_runs(context, runs.run_timeout_s,
                                   partitions=dict(zip(parts, keys, strict=True)))
    try:
        configs = load_configs(nats_res, spec)
    except TICK_ERRORS as e:
        raise Failure(f"cannot read {spec.title}: {e}") from e
    owner_of = owners(assignment(configs[0].config))
    served = runs.served()
    for p in parts:
        owner = owner_of.get(p)
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
    return Resolved(parts, {p: owner_of[p] for p in parts}, max(c.revision for c in configs),
                    mode, waited, sink, processor, nats_res, runs)


def _summary(where: str, o: Outcome) -> str:
    """The run's last log line: status, messages per input, every message counted, time."""
    handled = o.total("processed") + o.total("dead_lettered") + o.total("duplicates_skipped")
    per = f" ({', '.join(f'{n} {r.processed:,}' for n, r in o.sides.items())})" \
        if len(o.sides) > 1 else ""
    rate = o.total("processed") / o.seconds if o.seconds > 0 else 0.0
    line = (f"{where}: {o.status}, {o.total('processed'):,} messages committed{per} of "
            f"{handled:,} handled ({o.total('dead_lettered'):,} dead-lettered, "
            f"{o.total('duplicates_skipped'):,} already committed and skipped) in "
            f"{o.commits} commit(s), {o.seconds:.1f} s ({rate:,.0f}/s)")
    return f"{line}; {o.detail}" if o.detail else line


def _report(context: AssetExecutionContext, spec: StreamAsset, run: Resolved, o: Outcome
            ) -> MaterializeResult:
    """The materialization: the run's figures, each input's (``<input>/...`` on a set; all in
    ``lineage``), the table's (:func:`table_metadata`) and the check results.

    Raises:
        Failure: the run halted at a message (``dead_letter_policy='halt'``) or processed
            nothing because another holder has the partition (``held``); with the metadata.
    """
    if o.by_partition:
        return _report_range(context, spec, run, o)
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
    return MaterializeResult(metadata=md, check_results=_selected(context, run_check_results(
        spec, o.status, o.detail, o.fence_conflicts,
        {n: r.dead_lettered for n, r in o.sides.items()})))


def _report_range(context: AssetExecutionContext, spec: StreamAsset, run: Resolved,
                  o: Outcome) -> MaterializeResult:
    """A range run's materializations: each partition's own figures (its side's status,
    messages, sequences, watermark, lineage, owner, the table's rows of it) on that
    partition's event (``add_asset_metadata(partition_key=...)``), the run's figures on all.

    Raises:
        Failure: the run halted at a message, or every partition was held by another run.
    """
    inp = spec.inputs[0]
    for p in run.partitions:
        side = o.by_partition[p]
        row = side.lineage()
        pmd: dict[str, Any] = {
            "partition_status": side.status or o.status, "partition_detail": side.detail or "",
            "messages": side.processed, "dead_lettered": side.dead_lettered,
            "duplicates_skipped": side.duplicates_skipped, "owner_member": run.owners[p],
            "lineage": MetadataValue.json([{"input": inp.name, **row}]), **row}
        pmd.update(table_metadata(run.sink, p, spec.table_name))
        context.add_asset_metadata(pmd, partition_key=spec.partition_key(p))
    processed = o.total("processed")
    md: dict[str, Any] = {
        "status": o.status, "mode": run.mode, "write_mode": spec.write.name,
        "partitions": f"{run.partitions[0]}..{run.partitions[-1]}",
        "run_messages": processed, "run_dead_lettered": o.total("dead_lettered"),
        "commits": o.commits, "fence_conflicts": o.fence_conflicts,
        "rows_written": o.rows_written, "seconds": MetadataValue.float(round(o.seconds, 3)),
        "messages_per_second": MetadataValue.float(
            round(processed / o.seconds, 1) if o.seconds > 0 else 0.0),
        "config_revision": run.revision, "detail": o.detail or "",
        "timings": MetadataValue.json({k: round(v, 3) for k, v in o.timings.items()}),
        "table_versions": MetadataValue.json(run.sink.versions_written),
        "waited_for_runs": ", ".join(run.waited)}
    if o.maintenance:
        md["maintenance"] = MetadataValue.json(o.maintenance)
    if o.status == "halted":
        side = next(s for s in o.by_partition.values() if s.halted_at is not None)
        where = f"{inp.stream} {inp.group} {side.partition}"
        raise Failure(f"{o.detail}\npartition {side.partition} of {inp.stream}.{inp.group} "
                      f"halted there (dead_letter_policy='halt'): see it with `cg halt show "
                      f"{where}`, move it to the dead letters with `cg halt skip {where} "
                      "--reason TEXT`", metadata=md)
    if o.status == "held":
        raise Failure(f"{_where(run)} were not processed: {o.detail}; they are retried when "
                      "the holders let go", metadata=md)
    return MaterializeResult(metadata=md)


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
