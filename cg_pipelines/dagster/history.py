"""What the Dagster instance knows of a consumer-group partition's runs, for the triggers.

- :func:`partition_runs`: per partition, consecutive failed runs under the current code since
  the last success, when the newest ended and its error, and whether a run is queued or in
  progress (:class:`~cg_pipelines.core.triggers.PartitionRuns`).
- Lost run workers: a partition run records its process (:func:`run_worker_tags`); a run still
  marked in progress whose process is gone from this host (kill -9, OOM) is marked failed by
  :func:`fail_lost_runs`, so the per-partition run limit frees the partition at the next tick
  instead of after Dagster's ``max_runtime`` (the default run launcher has no run-worker health
  check of its own).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy
from dagster import (
    AssetCheckEvaluation,
    AssetCheckKey,
    AssetKey,
    AssetRecordsFilter,
    DagsterEvent,
    DagsterEventType,
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    RunRecord,
    RunsFilter,
)
from dagster._core.definitions.asset_checks.asset_check_evaluation import (
    AssetCheckEvaluationTargetMaterializationData,
)
from dagster._core.events.log import EventLogEntry
from dagster._core.storage.asset_check_execution_record import AssetCheckExecutionRecordStatus
from dagster._core.storage.event_log.schema import (
    AssetCheckExecutionsTable,
    SqlEventLogStorageTable,
)
from dagster._core.storage.event_log.sql_event_log import SqlEventLogStorage
from dagster._core.storage.event_log.sqlite.sqlite_event_log import SqliteEventLogStorage
from dagster._serdes import serialize_value

from cg_pipelines.core.errors import InvariantError, one_line
from cg_pipelines.core.triggers import PartitionRuns, RetryPolicy

__all__ = ["CODE_TAG", "SIGNALS_RUN_ID", "WORKER_TAG", "CheckState", "check_states",
           "fail_lost_runs", "partition_runs", "record_partition_checks", "run_worker_tags",
           "store_check_evaluations"]

CODE_TAG = "cg/code_version"
"""Run tag: the code version (:func:`~cg_pipelines.core.fingerprint.code_version` or the
asset's declared one) a partition run was made with."""


MODE_TAG = "cg/mode"
"""Run tag that fixes a run's mode whatever its run config says: the ``<asset>_rebuild`` job
carries ``cg/mode=rebuild`` (a run config given at launch replaces a job's config, so the
job's default ``mode: rebuild`` alone would be lost to, say, a logger config)."""

WORKER_TAG = "cg/run_worker"
"""Run tag: ``<host> <pid> <process start ticks>`` of the process executing the run."""

PARTITION_TAG = "dagster/partition"
_QUEUED = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING,
           DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING]
_FAILED = {DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED}
_FAILURE_PREFIX = "dagster._core.definitions.events.Failure: "


def run_worker_tags() -> dict[str, str]:
    """This process as a :data:`WORKER_TAG` value: host name, pid and (on Linux) the process
    start time in clock ticks, so a reused pid is not taken for the run's process."""
    pid = os.getpid()
    return {WORKER_TAG: f"{socket.gethostname()} {pid} {_start_ticks(pid) or 0}"}


def _start_ticks(pid: int) -> int | None:
    """The process' start time (field 22 of ``/proc/<pid>/stat``), or None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            tail = f.read().rsplit(")", 1)[1].split()
        return int(tail[19])
    except (OSError, IndexError, ValueError):
        return None


def worker_gone(tag: str) -> bool:
    """Whether the run worker named by a :data:`WORKER_TAG` value ran on this host and its
    process no longer exists (False when it cannot be told: another host, no ``/proc``)."""
    try:
        host, pid_s, ticks_s = tag.split(" ")
        pid, ticks = int(pid_s), int(ticks_s)
    except ValueError:
        return False
    if host != socket.gethostname() or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    now = _start_ticks(pid)
    return bool(ticks) and now is not None and now != ticks


def fail_lost_runs(instance: DagsterInstance, partition_keys: Iterable[str]) -> list[str]:
    """Mark failed every in-progress run of these partition keys whose recorded run worker
    (:data:`WORKER_TAG`) is gone from this host. Returns their run ids. Harmless if wrong:
    the engine's lease and fenced commit keep a live run from double-committing.

    One run-records query for all the keys (a tag filter with a list of values)."""
    keys = list(partition_keys)
    if not keys:
        return []
    lost = []
    for rec in instance.get_run_records(RunsFilter(
            tags={PARTITION_TAG: keys}, statuses=[DagsterRunStatus.STARTED])):
        run = rec.dagster_run
        tag = run.tags.get(WORKER_TAG)
        if tag and worker_gone(tag):
            key = run.tags.get(PARTITION_TAG, "?")
            instance.report_run_failed(
                run, f"run worker process of partition {key} is gone ({tag.split()[1]} "
                "no longer runs on this host: killed or out of memory); marked failed so "
                "the partition can run again")
            lost.append(run.run_id)
    return lost


RUNS_WINDOW = 2000
"""Newest unsuccessful (queued, in progress, failed, canceled) runs a tick reads for all the
partitions it asks about together; a partition whose unsuccessful runs are all older than that
window counts as having none."""


def partition_runs(instance: DagsterInstance, partition_keys: dict[int, str], code: str,
                   policy: RetryPolicy, *, exclude_tag: tuple[str, str] | None = None,
                   errors: dict[str, str] | None = None) -> dict[int, PartitionRuns]:
    """The run history of each partition (``{partition: its Dagster partition key}``).

    A constant number of run-records queries for all the partitions, whatever their number:
    the newest :data:`RUNS_WINDOW` unsuccessful runs of these keys (one query), then, only if
    some failed, the successful runs of the failing keys since the oldest of those failures
    (one query). The error of a partition's newest failed run is read from that run's
    failure events (one indexed query of at most 4 records, never its whole log), and only
    when ``errors`` (``{run_id: error}``, updated in place and pruned to the runs this call
    used, so it stays bounded by the partitions: pass the same dict from tick to tick, e.g.
    kept in a sensor cursor) does not hold it yet.

    Runs carrying ``exclude_tag`` (e.g. rebuild runs) are ignored; a failed run counts only
    when it was made with ``code`` (:data:`CODE_TAG`); counting stops at the newest successful
    run and at a failure under another code.
    """
    keys = {key: p for p, key in partition_keys.items()}
    if not keys:
        return {}

    def kept(run: DagsterRun) -> bool:
        return exclude_tag is None or run.tags.get(exclude_tag[0]) != exclude_tag[1]

    unsuccessful = [r for r in instance.get_run_records(
        RunsFilter(tags={PARTITION_TAG: list(keys)}, statuses=[*_QUEUED, *_FAILED]),
        limit=RUNS_WINDOW) if kept(r.dagster_run)]
    by_key: dict[str, list[RunRecord]] = {}
    for rec in unsuccessful:  # newest first
        by_key.setdefault(rec.dagster_run.tags.get(PARTITION_TAG, ""), []).append(rec)
    failing = [k for k, recs in by_key.items()
               if any(r.dagster_run.status in _FAILED for r in recs)]
    succeeded_at: dict[str, float] = {}
    if failing:
        oldest = min(r.create_timestamp for k in failing for r in by_key[k]
                     if r.dagster_run.status in _FAILED)
        for rec in instance.get_run_records(
                RunsFilter(tags={PARTITION_TAG: failing}, statuses=[DagsterRunStatus.SUCCESS],
                           created_after=oldest), limit=RUNS_WINDOW):
            if kept(rec.dagster_run):
                key = rec.dagster_run.tags.get(PARTITION_TAG, "")
                succeeded_at[key] = max(succeeded_at.get(key, 0.0),
                                        rec.create_timestamp.timestamp())
    cache = errors if errors is not None else {}
    used: set[str] = set()
    out: dict[int, PartitionRuns] = {}
    for key, p in keys.items():
        failures, newest = 0, None
        in_progress = failed_before = False
        counting = True
        since = succeeded_at.get(key, 0.0)
        for rec in by_key.get(key, []):  # newest first
            run = rec.dagster_run
            if run.status in _QUEUED:
                in_progress = True
                continue
            if rec.create_timestamp.timestamp() <= since:
                break
            failed_before = True
            if counting and run.tags.get(CODE_TAG) == code:
                failures += 1
                newest = newest or rec
            else:
                counting = False
        if failures == 0:
            out[p] = PartitionRuns(in_progress=in_progress, failed_before=failed_before)
            continue
        assert newest is not None
        run_id = newest.dagster_run.run_id
        used.add(run_id)
        if run_id not in cache:
            cache[run_id] = _error_of(instance, run_id)
        out[p] = PartitionRuns(
            failures=failures,
            last_failed_at=newest.end_time or newest.update_timestamp.timestamp(),
            last_error=cache[run_id], in_progress=in_progress, failed_before=True)
    for run_id in [r for r in cache if r not in used]:
        del cache[run_id]
    return out


def _error_of(instance: DagsterInstance, run_id: str) -> str:
    """The failed run's error as one line (its newest step failure, else its run failure),
    from at most 4 failure records of the run (an indexed query, not a read of its log)."""
    records = instance.get_records_for_run(
        run_id, of_type={DagsterEventType.STEP_FAILURE, DagsterEventType.RUN_FAILURE},
        limit=4, ascending=False).records
    order = {DagsterEventType.STEP_FAILURE: 0, DagsterEventType.RUN_FAILURE: 1}
    for rec in sorted(records, key=lambda r: order.get(
            r.event_log_entry.dagster_event_type, 2)):  # type: ignore[arg-type]
        entry = rec.event_log_entry
        event = entry.dagster_event
        data = getattr(event, "event_specific_data", None) if event else None
        err = getattr(data, "error", None)
        text = getattr(err, "message", None) or entry.message or ""
        if text:
            # Dagster's error text starts with the exception's qualified class name; a
            # Failure's description (the cause first) is what an operator needs.
            return one_line(text.removeprefix(_FAILURE_PREFIX))
    return ""


# --------------------------------------------------------------------------------------------
# Partitioned asset checks evaluated outside runs (by the backlog sensor)
# --------------------------------------------------------------------------------------------

SIGNALS_RUN_ID = "cg-signals"
"""The run id under which the backlog sensor records its partitioned check evaluations (no
such run exists: the check page's run link for them leads nowhere)."""


@dataclass(frozen=True)
class CheckState:
    """The latest recorded evaluation of one check on one partition: ``passed`` (``None``
    while only planned), whether it targets the partition's latest materialization
    (``current``), and the run id it was recorded under."""

    passed: bool | None
    current: bool
    run_id: str


def check_states(instance: DagsterInstance, asset_key: AssetKey, names: Iterable[str]
                 ) -> dict[tuple[str, str], CheckState]:
    """``{(check name, partition key): CheckState}`` of these partitioned checks of
    ``asset_key`` (partitions never evaluated are missing). One storage call (Dagster's
    per-partition check info, as the UI reads it)."""
    infos = instance.event_log_storage.get_asset_check_partition_info(
        [AssetCheckKey(asset_key, n) for n in names])
    out = {}
    for i in infos:
        if i.partition_key is None:
            continue
        status = i.latest_execution_status
        passed = None if status == AssetCheckExecutionRecordStatus.PLANNED else (
            status == AssetCheckExecutionRecordStatus.SUCCEEDED)
        out[(i.check_key.name, i.partition_key)] = CheckState(
            passed, i.is_current, i.latest_planned_run_id)
    return out


def record_partition_checks(instance: DagsterInstance, asset_key: AssetKey,
                            evaluations: Sequence[AssetCheckEvaluation],
                            states: Mapping[tuple[str, str], CheckState]) -> int:
    """Record partitioned check evaluations made outside a run. Returns how many.

    Why not ``SensorResult(asset_events=...)``: Dagster 1.13.27 stores a run-less evaluation
    under run id ``""``, and its unique index on (asset key, check name, run id, partition)
    refuses a second one for the same check and partition (``IntegrityError``, SQLite and
    Postgres alike). Stored under a run id instead, an evaluation updates the row of that
    run id, check and partition (Dagster's "planned, then evaluated" path), and inserts one when
    there is none. So each evaluation is written under the run id of the partition's latest
    row when that row is ours (:data:`SIGNALS_RUN_ID` or ``<it>-<n>``: updated in place, one
    row per check and partition), under :data:`SIGNALS_RUN_ID` when the partition has none,
    and under a new ``<SIGNALS_RUN_ID>-<ns>`` when a run's evaluation is the latest (a new row,
    newer than it: the latest row per partition is what Dagster shows).

    Each evaluation targets the partition's latest materialization (so the check page counts it
    as current): one query for the partitions' latest materialization ids and one for those
    materializations.
    """
    if not evaluations:
        return 0
    latest = instance.get_latest_storage_id_by_partition(
        asset_key, DagsterEventType.ASSET_MATERIALIZATION,
        {e.partition for e in evaluations if e.partition is not None})
    targets: dict[str, AssetCheckEvaluationTargetMaterializationData] = {}
    if latest:
        records = instance.fetch_materializations(
            AssetRecordsFilter(asset_key=asset_key, storage_ids=list(latest.values())),
            limit=len(latest)).records
        by_id = {r.storage_id: r for r in records}
        for part, sid in latest.items():
            if sid in by_id:
                targets[part] = AssetCheckEvaluationTargetMaterializationData(
                    storage_id=sid, run_id=by_id[sid].run_id, timestamp=by_id[sid].timestamp)
    fresh = f"{SIGNALS_RUN_ID}-{time.time_ns()}"
    now = time.time()
    entries = []
    for ev in evaluations:
        part = ev.partition or ""
        st = states.get((ev.check_name, part))
        run_id = SIGNALS_RUN_ID if st is None else (
            st.run_id if st.run_id.startswith(SIGNALS_RUN_ID) else fresh)
        stored = AssetCheckEvaluation(
            asset_key=ev.asset_key, check_name=ev.check_name, passed=ev.passed,
            metadata=ev.metadata, severity=ev.severity, description=ev.description,
            partition=ev.partition, target_materialization_data=targets.get(part))
        entries.append(EventLogEntry(
            user_message="", level=logging.INFO, job_name="", run_id=run_id, error_info=None,
            timestamp=now, step_key=None, dagster_event=DagsterEvent(
                event_type_value=DagsterEventType.ASSET_CHECK_EVALUATION.value, job_name="",
                event_specific_data=stored,
                message=f"Asset check '{ev.check_name}' on '{asset_key.to_user_string()}' "
                f"partition '{part}' {'passed' if ev.passed else 'failed'}.")))
    store_check_evaluations(instance, entries)
    return len(evaluations)


def store_check_evaluations(instance: DagsterInstance, entries: Sequence[EventLogEntry]) -> None:
    """Store asset check evaluation events (each under its run id) in one transaction per
    database instead of one per event.

    What ``instance.report_dagster_event`` does for one such event, done for all of them
    together (Dagster 1.13's SQL event log storages: SQLite, its per-run sharded variant,
    PostgreSQL): the event rows (in the run's shard too, for the sharded SQLite storage), then
    the check's execution row of each (asset, check, run id, partition) replaced (deleted and
    inserted where Dagster updates it in place or inserts it: still one row, now the newest),
    in a handful of statements whatever their number. Each ``report_dagster_event`` costs
    ~0.1 s (several connections and commits), so 100 of them were most of a 4096-partition
    tick. Another event log storage gets the events one by one
    (``instance.handle_new_event``).

    Raises:
        InvariantError: an entry is not an asset check evaluation (a bug of the caller).
    """
    if not entries:
        return
    for e in entries:
        if e.dagster_event_type != DagsterEventType.ASSET_CHECK_EVALUATION:
            raise InvariantError(
                f"store_check_evaluations: not an asset check evaluation: "
                f"{e.dagster_event_type}")
    storage = instance.event_log_storage
    if not isinstance(storage, SqlEventLogStorage) or not storage.supports_asset_checks:
        for e in entries:
            instance.handle_new_event(e)
        return
    rows = [_event_row(e) for e in entries]
    if isinstance(storage, SqliteEventLogStorage):  # sharded: the run's shard holds it too
        by_run: dict[str, list[dict[str, Any]]] = {}
        for row in rows:
            by_run.setdefault(row["run_id"], []).append(row)
        for run_id, run_rows in by_run.items():
            with storage.run_connection(run_id) as conn:
                conn.execute(SqlEventLogStorageTable.insert(), run_rows)
    table = AssetCheckExecutionsTable
    with storage.index_transaction() as conn:
        # All the events in one statement, their ids returned in the order given.
        ids = [int(r[0]) for r in conn.execute(SqlEventLogStorageTable.insert().returning(
            SqlEventLogStorageTable.c.id, sort_by_parameter_order=True), rows)]
        executions = [_execution_row(e, i) for e, i in zip(entries, ids, strict=True)]
        # The rows they replace: one delete per (asset, check, run id), then one insert.
        doomed: dict[tuple[str, str, str], list[str | None]] = {}
        for x in executions:
            doomed.setdefault((x["asset_key"], x["check_name"], x["run_id"]), []).append(
                x["partition"])
        for (asset, check, run_id), parts in doomed.items():
            named = [q for q in parts if q is not None]
            conn.execute(table.delete().where(
                table.c.asset_key == asset, table.c.check_name == check,
                table.c.run_id == run_id,
                sqlalchemy.or_(table.c.partition.in_(named), table.c.partition.is_(None))
                if None in parts else table.c.partition.in_(named)))
        conn.execute(table.insert(), executions)


def _event_row(entry: EventLogEntry) -> dict[str, Any]:
    """The ``event_logs`` row of an event (the columns ``SqlEventLogStorage`` writes)."""
    event = entry.get_dagster_event()
    return {"run_id": entry.run_id, "event": serialize_value(entry),
            "dagster_event_type": event.event_type_value,
            "timestamp": datetime.fromtimestamp(entry.timestamp, UTC).replace(tzinfo=None),
            "step_key": event.step_key,
            "asset_key": event.asset_key.to_string() if event.asset_key else None,
            "partition": event.partition or None}


def _execution_row(entry: EventLogEntry, event_id: int) -> dict[str, Any]:
    """The ``asset_check_executions`` row of a check evaluation stored as event ``event_id``
    (the values ``SqlEventLogStorage._update_asset_check_evaluation`` writes)."""
    ev = entry.get_dagster_event().event_specific_data
    assert isinstance(ev, AssetCheckEvaluation)
    target = ev.target_materialization_data
    return {"asset_key": ev.asset_key.to_string(), "check_name": ev.check_name,
            "run_id": entry.run_id, "partition": ev.partition,
            "execution_status": (AssetCheckExecutionRecordStatus.SUCCEEDED if ev.passed
                                 else AssetCheckExecutionRecordStatus.FAILED).value,
            "evaluation_event": serialize_value(entry),
            "evaluation_event_timestamp": datetime.fromtimestamp(entry.timestamp, UTC)
            .replace(tzinfo=None),
            "evaluation_event_storage_id": event_id,
            "materialization_event_storage_id": target.storage_id if target else None}
