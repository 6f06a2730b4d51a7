"""The bodies of the Dags' tasks, thin over the engine and core: :func:`dispatch` (backlog
events to partitioned asset events, minus the partitions :func:`held_back` keeps back: queued,
running, up for retry or given up on), :func:`route` (the run's key to its partition's task)
and :func:`drain` (one partition run through the engine, its figures as the asset event's
extra, one record per try in the table asset's state store).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from typing import Any

from airflow.sdk.exceptions import (
    AirflowException,
    AirflowFailException,
    AirflowSkipException,
)

from cg_pipelines.airflow.spec import StreamDag
from cg_pipelines.airflow.trigger import served_backlog
from cg_pipelines.core.assignment import assignment, owners
from cg_pipelines.core.errors import failure_report, one_line, trim_traceback
from cg_pipelines.core.triggers import PartitionBacklog, RetryWait, TickPlan
from cg_pipelines.engine.inputs import read_input_configs, run_inputs, sides_by_input
from cg_pipelines.engine.join_processor import JoinProcessor
from cg_pipelines.engine.processor import Processor
from cg_pipelines.engine.result import RunResult
from cg_pipelines.sinks.delta import DeltaSink

__all__ = ["DRAIN_TASK", "MODES", "backlog_now", "dispatch", "drain", "drain_task_id", "held_back",
           "partitions_of_events", "record_key", "route", "run_metadata", "run_mode",
           "summary_line"]

DRAIN_TASK = "drain_p{p}"
"""The task id of partition ``p``'s drain task."""

MODES = ("drain", "rebuild")
"""A worker run's ``mode`` (its Dag run conf or param): drain the backlog, or rebuild the
partition from the origin stream's history."""


def drain_task_id(partition: int) -> str:
    """``drain_p<partition>``."""
    return DRAIN_TASK.format(p=partition)


def partitions_of_events(extras: Iterable[Mapping[str, Any]], partitions: int) -> list[int]:
    """The partitions named by backlog trigger events (their extras' ``payload.partitions``),
    distinct, sorted, those outside ``0 .. partitions-1`` dropped. Pure."""
    found: set[int] = set()
    for extra in extras:
        payload = extra.get("payload") or {}
        for p in payload.get("partitions") or []:
            if isinstance(p, int) and 0 <= p < partitions:
                found.add(p)
    return sorted(found)


def held_back(spec: StreamDag, records: Mapping[int, Any], code: str, now: float
              ) -> tuple[list[int], list[str]]:
    """The partitions not to start a run of, and core's reason line for each
    (:meth:`~cg_pipelines.core.triggers.TickPlan.reason_lines`). ``records``: ``{partition: the
    drain task's record}`` (:func:`drain` writes one per try); ``now``: Unix seconds. Pure.

    - **given up on**: the last run's final try (``max_failures`` tries) failed under ``code``;
      no run starts until a run succeeds (one triggered by hand) or new code is loaded;
    - **in progress**: a run was dispatched (``queued``, written by :func:`dispatch`), a try
      is running, or a try failed with tries left (Airflow retries it), and the record is
      younger than ``run_timeout_s + max_backoff_s`` (an older one is a lost run: it is
      started again).
    """
    waits, busy = [], []
    fresh_s = spec.run_timeout_s + spec.retry.max_backoff_s
    for p, rec in sorted(records.items()):
        if not isinstance(rec, dict):
            continue
        state, at = rec.get("state"), float(rec.get("at") or 0.0)
        if state == "failed" and rec.get("final") and rec.get("code") == code:
            waits.append(RetryWait(p, int(rec.get("try") or 0), 0.0, str(rec.get("error", ""))))
        elif (state in ("queued", "running") or (state == "failed" and not rec.get("final"))
              ) and now - at < fresh_s:
            busy.append(p)
    plan = TickPlan(exhausted=waits, in_progress=busy)
    return [w.partition for w in waits] + busy, plan.reason_lines(spec.retry)


def dispatch(spec: StreamDag, backlog_asset: Any, table_asset: Any,
             context: Mapping[str, Any]) -> list[str]:
    """The dispatch task: one partitioned event on ``backlog_asset`` per partition the
    triggering events name, except those given up on or in progress (:func:`held_back`,
    from the drain tasks' records in ``table_asset``'s asset state store; the reasons go to
    the log), so
    the scheduler makes one worker Dag run per key. The event's extra shows the lag:
    ``backlog``: per key, ``pending`` messages, ``first_seq`` and ``oldest_age_s`` (seconds)
    at dispatch; ``held_back``: the reasons of partitions not run. Returns the keys.

    Raises:
        AirflowSkipException: no partition to run (a task that succeeds emits an unpartitioned
            event, which a partition-aware Dag refuses).
    """
    events = context["triggering_asset_events"]
    extras = [dict(ev.extra or {}) for evs in events.values() for ev in evs]
    parts = partitions_of_events(extras, spec.partitions)
    now_pending: dict[int, PartitionBacklog] = {}
    if parts:  # events are hints: only partitions with backlog now (a run may have drained it)
        now_pending = {b.partition: b for b in backlog_now(spec)}
        parts = [p for p in parts if p in now_pending]
    store = context["asset_state_store"][table_asset]
    code, now = spec.code_version(), time.time()
    gone, reasons = held_back(spec, {p: store.get(record_key(p)) for p in parts}, code, now)
    for line in reasons:
        print(line)  # the task log: why a partition with backlog is not run
    parts = [p for p in parts if p not in gone]
    if not parts:
        raise AirflowSkipException("no partition to run" + (f": {'; '.join(reasons)}"
                                                            if reasons else ""))
    for p in parts:  # in progress from now on: a repeated event does not start a second run
        store.set(record_key(p), {"state": "queued", "try": 0, "final": False, "code": code,
                                  "at": now})
    keys = [spec.partition_key(p) for p in parts]
    event = context["outlet_events"][backlog_asset]
    event.add_partitions(keys)
    # the lag, where an Airflow user looks: the backlog asset's event
    event.extra = {"backlog": {spec.partition_key(p): {
        "pending": now_pending[p].pending, "first_seq": now_pending[p].first_seq,
        "oldest_age_s": round(now_pending[p].age_s, 1)} for p in parts},
        "held_back": reasons}
    return keys


def backlog_now(spec: StreamDag) -> list[PartitionBacklog]:
    """The served partitions with at least ``min_pending`` pending messages now, with their
    backlog (one bounded NATS read, :func:`~cg_pipelines.airflow.trigger.served_backlog`),
    in partition order.

    Raises:
        GroupNotFoundError, ConfigError, JetStreamError, TimeoutError, OSError: as reading
            fails (the dispatch task fails; the next event tries again).
    """
    options = spec.connect_options()

    async def read() -> list[PartitionBacklog]:
        nc = await options.connect()
        try:
            backlog = await served_backlog(
                nc, spec.inputs, spec.partitions, name=spec.name,
                members=list(spec.members) if spec.members is not None else None)
            return [b for b in backlog if b.first_seq is not None
                    and b.pending >= spec.min_pending]
        finally:
            await nc.close()

    return asyncio.run(read())


def record_key(partition: int) -> str:
    """The asset state store key of partition ``partition``'s drain record (``p<partition>``)."""
    return f"p{partition}"


def route(spec: StreamDag, context: Mapping[str, Any]) -> str:
    """The branch: the task id of the run's partition (``drain_p<p>``).

    Raises:
        AirflowFailException: the run has no partition key or not one of this Dag's.
    """
    key = _partition_key(context)
    try:
        return drain_task_id(spec.partition_of(key))
    except ValueError as e:
        raise _no_retry(str(e)) from None


def _partition_key(context: Mapping[str, Any]) -> str:
    """The run's ``partition_key``; ``AirflowFailException`` when it has none."""
    key = context.get("partition_key") or getattr(context.get("dag_run"), "partition_key", None)
    if not key:
        raise _no_retry("this run has no partition_key: trigger it with one (REST "
                        "partition_key, or the trigger form), or let the dispatcher start it")
    return str(key)


def _no_retry(text: str) -> AirflowFailException:
    """A failure no retry fixes (Airflow fails the task at once)."""
    return AirflowFailException(text)


def run_mode(context: Mapping[str, Any]) -> str:
    """The run's mode: its Dag run conf ``mode``, else ``"drain"``.

    Raises:
        AirflowFailException: a mode other than :data:`MODES`.
    """
    dag_run = context.get("dag_run")
    conf = dict(getattr(dag_run, "conf", None) or {})
    mode = conf.get("mode", "drain")
    if mode not in MODES:
        raise _no_retry(f"conf mode={mode!r}: expected one of {', '.join(MODES)}")
    return str(mode)


def drain(spec: StreamDag, partition: int, table_asset: Any,
          context: Mapping[str, Any]) -> dict[str, Any]:
    """Partition ``partition``'s run: check the run's key and owner, run the engine (drain or
    rebuild), put :func:`run_metadata` on the ``table_asset`` event (which takes the run's
    key) and return it.

    Raises:
        AirflowFailException: the key is not this task's partition, or another deployment
            serves its owner (retrying does not help).
        AirflowException: the run failed: the cause first, then the partition's facts
            (:func:`~cg_pipelines.core.errors.failure_report`); or it ended ``halted`` or
            ``held`` (nothing processed). Retried by Airflow as the task's retries say.
    """
    key = _partition_key(context)
    if spec.partition_of(key) != partition:
        raise _no_retry(f"run key {key} is partition {spec.partition_of(key)}, not "
                        f"{partition}: this task drains {spec.partition_key(partition)}")
    mode = run_mode(context)
    run_id = str(getattr(context.get("dag_run"), "run_id", "") or "")
    sink = DeltaSink(spec.table_uri, storage_options=spec.storage_options, write=spec.write,
                     commit_metadata={"airflow_run_id": run_id})

    options = spec.connect_options()

    async def go(processor: Processor | JoinProcessor) -> tuple[str, int, RunResult]:
        nc = await options.connect()
        try:
            configs = await read_input_configs(nc, spec.inputs, spec.partitions,
                                               name=spec.name, timeout=5.0)
            owner = owners(assignment(configs[0].config)).get(partition)
            if owner is None or (spec.members is not None and owner not in spec.members):
                raise _no_retry(
                    f"partition {partition} of {spec.title} is owned by {owner or 'no member'};"
                    f" this deployment serves "
                    f"{', '.join(spec.members) if spec.members else 'every member'}")
            result = await run_inputs(nc, spec.inputs, partition, processor, sink, spec.engine,
                                      rebuild=mode == "rebuild")
            return owner, max(c.revision for c in configs), result
        finally:
            await nc.close()

    store = context["asset_state_store"][table_asset]
    ti = context.get("ti")
    tries = int(getattr(ti, "try_number", 1) or 1)
    base = {"run_id": run_id, "try": tries, "code": spec.code_version(), "mode": mode,
            "final": tries >= spec.retry.max_failures}
    store.set(record_key(partition), {**base, "state": "running", "at": time.time()})
    started = time.monotonic()
    session = None
    try:
        try:
            processor, session = _spark_bound(spec, key)
            owner, revision, result = asyncio.run(go(processor))
        except AirflowException:
            raise
        except Exception as e:
            text, _ = failure_report(e, spec.groups, partition)
            raise AirflowException(text) from trim_traceback(e)
        out = _finish(spec, partition, mode, owner, revision, result, sink, started)
    except AirflowException as e:
        store.set(record_key(partition), {
            **base, "state": "failed", "at": time.time(),
            "final": base["final"] or isinstance(e, AirflowFailException),
            "error": one_line(str(e).split("\n")[0], 500)})
        raise
    finally:
        if session is not None and spec.spark_remote is not None:
            from cg_pipelines.spark.session import stop_session

            stop_session(session)  # releases the server's session; a classic one ends with
            # the task's process
    store.set(record_key(partition), {**base, "state": "succeeded", "at": time.time()})
    context["outlet_events"][table_asset].extra = out
    print(summary_line(partition, out))  # the task log
    return out


def _spark_bound(spec: StreamDag, key: str) -> tuple[Processor | JoinProcessor, Any]:
    """``(processor, session)``: the spec's processor bound to the Spark session of its
    ``spark_*`` settings (app name ``"<name> <key>"``) when it runs on Spark, else
    ``(processor, None)`` and no session.

    Raises:
        cg_pipelines.spark.session.JavaNotFoundError: no Java 17+ for a classic session.
        ImportError: pyspark (or its Connect client packages) missing.
    """
    processor = spec.processor
    if not spec.uses_spark:
        return processor, None
    from cg_pipelines.spark.session import get_spark

    session = get_spark(spec.spark_master, app_name=f"{spec.name} {key}",
                        conf=dict(spec.spark_config or {}), remote=spec.spark_remote)
    return processor.bind(session), session


def _finish(spec: StreamDag, partition: int, mode: str, owner: str, revision: int,
            result: RunResult, sink: DeltaSink, started: float) -> dict[str, Any]:
    """The run's metadata with the table's figures.

    Raises:
        AirflowException: the run halted at a message, or was ``held`` (nothing processed).
    """
    md = run_metadata(spec, partition, mode, owner, revision, result, sink.versions_written)
    md["task_seconds"] = round(time.monotonic() - started, 3)
    if result.status == "halted":
        sides = sides_by_input(spec.inputs, result)
        inp = next((i for i in spec.inputs if sides[i.name].halted_at is not None),
                   spec.inputs[0])
        where = f"{inp.stream} {inp.group} {partition}"
        raise AirflowException(
            f"{result.detail}\npartition {partition} of {inp.stream}.{inp.group} halted there "
            f"(dead_letter_policy='halt'): see it with `cg halt show {where}`, move it to the "
            f"dead letters with `cg halt skip {where} --reason TEXT`")
    if result.status == "held":
        raise AirflowException(f"partition {partition} was not processed: {result.detail}; "
                               "it is retried when the holder lets go")
    if sink.exists():
        stats = sink.stats(partition)
        md.update({"table_rows": stats.rows, "partition_rows": stats.partition_rows,
                   "table_version": stats.version})
    return md


def run_metadata(spec: StreamDag, partition: int, mode: str, owner: str, revision: int,
                 result: RunResult, table_versions: Any) -> dict[str, Any]:
    """A run's figures as plain JSON (the Dagster materialization's fields, without Dagster's
    types): ``status``, ``mode``, ``partition``, ``messages``, ``dead_lettered``,
    ``duplicates_skipped`` (summed over the inputs), ``commits``, ``fence_conflicts``,
    ``rows_written``, ``seconds`` (engine time, float), ``owner_member``, ``config_revision``,
    ``detail``, ``timings`` (seconds), ``table_versions``, and ``lineage``: one row per input
    (``input``, ``stream``, ``group``, ``first_seq``/``last_seq`` (work-queue sequences, 0 for
    none), ``messages``, ``dead_lettered``, ``watermark``, plus the origin range on a rebuild).
    One input's ``first_seq``, ``last_seq`` and ``watermark`` are also top-level fields. Pure."""
    sides = sides_by_input(spec.inputs, result)
    lineage = [{"input": name, **side.lineage(rebuild=mode == "rebuild",
                                              rows_replaced=result.rows_replaced)}
               for name, side in sides.items()]
    md: dict[str, Any] = {
        "status": result.status, "mode": mode, "partition": partition,
        "write_mode": type(spec.write).__name__.lower(),
        "messages": sum(s.processed for s in sides.values()),
        "dead_lettered": sum(s.dead_lettered for s in sides.values()),
        "duplicates_skipped": sum(s.duplicates_skipped for s in sides.values()),
        "commits": result.commits, "fence_conflicts": result.fence_conflicts,
        "rows_written": result.rows_written, "seconds": round(result.seconds, 3),
        "owner_member": owner, "config_revision": revision,
        "detail": one_line(result.detail or "", 1000),
        "timings": {k: round(v, 3) for k, v in result.timings.items()},
        "table_versions": table_versions, "lineage": lineage}
    if len(lineage) == 1:
        md.update({k: lineage[0][k] for k in ("first_seq", "last_seq", "watermark")})
    if mode == "rebuild":
        md["rebuilt"] = result.status == "rebuilt"
    return md


def summary_line(partition: int, md: Mapping[str, Any]) -> str:
    """The task's last log line: status, messages, dead letters, each input's sequence range,
    time."""
    ranges = "; ".join(f"{row['input']} sequences {row['first_seq']}..{row['last_seq']}, "
                       f"watermark {row['watermark']}" for row in md["lineage"])
    return (f"partition {partition}: {md['status']} ({md['mode']}), {md['messages']:,} "
            f"messages committed ({ranges}), {md['dead_lettered']:,} dead-lettered, "
            f"{md['commits']} commit(s), {md['seconds']:.1f} s")
