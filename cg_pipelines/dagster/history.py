"""What the Dagster instance knows of an asset's partition runs, for the triggers: run history
and retries (:func:`partition_runs`), lost runs (:func:`fail_lost_runs`: a run's worker gone
from this host, or no heartbeat and no pinned lease from any host, by
:func:`cg_pipelines.core.liveness.judge_run`), and the partitioned checks' states
(:func:`check_states`, :func:`record_first_checks`). Public Dagster APIs only."""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dagster import (
    AssetCheckEvaluation,
    AssetCheckKey,
    AssetKey,
    DagsterEventType,
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    Failure,
    RunRecord,
    RunsFilter,
)

from cg_pipelines.core.errors import one_line
from cg_pipelines.core.liveness import LOST_RUN_GRACE_S, RunSighting, judge_run
from cg_pipelines.core.triggers import PartitionRuns, RetryPolicy, RunFact, runs_from_facts

__all__ = ["CHECK_MODE", "CODE_TAG", "HEARTBEAT_TAG", "MODE_TAG", "RANGED_TAG", "RANGE_TAG",
           "WORKER_TAG", "CheckState",
           "Probe", "Suspect", "check_states", "fail_lost_runs", "finished_runs",
           "PARTITION_TAG", "partition_runs", "partition_runs_of", "partitions_of", "range_tags",
           "record_first_checks", "run_worker_tags"]

CODE_TAG = "cg/code_version"
"""Run tag: the code version (:func:`~cg_pipelines.core.fingerprint.code_version` or the
asset's declared one) a partition run was made with."""


MODE_TAG = "cg/mode"
"""Run tag that fixes a run's mode whatever its run config says: the ``<asset>_rebuild`` job
carries ``cg/mode=rebuild`` (a run config given at launch replaces a job's config, so the
job's default ``mode: rebuild`` alone would be lost to, say, a logger config)."""

WORKER_TAG = "cg/run_worker"
"""Run tag: ``<host> <pid> <process start ticks>`` of the process executing the run."""

HEARTBEAT_TAG = "cg/heartbeat_ttl_s"
"""Run tag: the run keeps a heartbeat in NATS living this many seconds
(:class:`~cg_pipelines.jetstream.liveness.RunHeartbeat`); set once its first beat was
stored, so a run without it is never judged lost from another host."""

PARTITION_TAG = "dagster/partition"

RANGE_TAG = "cg/partitions"
"""Run tag of a run over several partitions (the run parallelism D of ``notes/RANGE_RUNS.md``
§7): ``<first>-<last>``, partition numbers, both included. Dagster's own range tags name
partition keys; this one is what the history reads (with :data:`RANGED_TAG`)."""

RANGED_TAG = "cg/ranged"
"""Run tag ``"true"`` on every run over several partitions: the one value the history's run
query filters range runs by (Dagster filters tags by value, not by presence)."""


def range_tags(first: int, last: int) -> dict[str, str]:
    """The cg tags of a run over partitions ``first .. last``."""
    return {RANGE_TAG: f"{first}-{last}", RANGED_TAG: "true"}


def partitions_of(tags: Mapping[str, str]) -> range | None:
    """The partitions a run's :data:`RANGE_TAG` names, or ``None`` (no tag, or unreadable)."""
    try:
        first, last = (int(x) for x in tags[RANGE_TAG].split("-"))
    except (KeyError, ValueError):
        return None
    return range(first, last + 1) if 0 <= first <= last else None

_QUEUED = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING,
           DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING]
_FAILED = {DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED}
_FAILURE_PREFIX = f"{Failure.__module__}.{Failure.__qualname__}: "
"""How Dagster's error text of a raised ``Failure`` starts (its qualified class name)."""


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


def worker_gone(tag: str) -> bool | None:
    """Whether the worker of a :data:`WORKER_TAG` value is gone from this host (its pid gone or
    another process now); ``None`` when it cannot be told (another host, no ``/proc``)."""
    try:
        host, pid_s, ticks_s = tag.split(" ")
        pid, ticks = int(pid_s), int(ticks_s)
    except ValueError:
        return None
    if host != socket.gethostname() or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return None
    now = _start_ticks(pid)
    if not ticks or now is None:
        return None
    return now != ticks


@dataclass(frozen=True, slots=True)
class Suspect:
    """An in-progress partition run whose worker this host cannot see, old enough to be
    judged by NATS: its ``run_id`` and Dagster ``partition_key`` (a range run: ``<first
    key>..<last key>``, its ``partitions`` the partition numbers; ``None`` for one)."""

    run_id: str
    partition_key: str
    partitions: tuple[int, ...] | None = None


Probe = Callable[[Sequence[Suspect]], Mapping[str, tuple[bool | None, bool | None]]]
"""Reads NATS for suspects: ``{run id: (heartbeat present, a lease of its partition
pinned)}`` (``None`` where unknown; a run left out is unknown)."""


def fail_lost_runs(instance: DagsterInstance, partition_keys: Iterable[str],
                   probe: Probe | None = None, *, grace_s: float = LOST_RUN_GRACE_S,
                   now: float | None = None, key_of: Callable[[int], str] | None = None
                   ) -> list[tuple[str, str]]:
    """Mark failed every in-progress run of these partition keys that
    :func:`~cg_pipelines.core.liveness.judge_run` finds lost: its worker (:data:`WORKER_TAG`)
    gone from this host, or, on any host, no heartbeat and no pinned lease (``probe``, asked
    once for the runs older than ``grace_s`` seconds this host cannot see). With ``key_of``
    (partition number -> key), range runs (:data:`RANGE_TAG`) over one of the keys too (a
    range run is alive while a lease of any of its partitions is pinned). Returns ``(run id,
    reason)`` pairs; a wrong verdict loses nothing (leases and fence). One run-records query
    (two with ``key_of``); runs without a worker tag are left alone, runs without
    :data:`HEARTBEAT_TAG` judged only on this host. ``now``: Unix seconds."""
    keys = list(partition_keys)
    if not keys:
        return []
    now = time.time() if now is None else now
    wanted = set(keys)
    records = list(instance.get_run_records(RunsFilter(
        tags={PARTITION_TAG: keys}, statuses=[DagsterRunStatus.STARTED])))
    if key_of is not None:
        records += [rec for rec in instance.get_run_records(RunsFilter(
            tags={RANGED_TAG: "true"}, statuses=[DagsterRunStatus.STARTED]))
            if any(key_of(p) in wanted for p in partitions_of(rec.dagster_run.tags) or ())]
    seen: list[tuple[DagsterRun, RunSighting, str]] = []
    suspects: list[Suspect] = []
    for rec in records:
        run = rec.dagster_run
        tag = run.tags.get(WORKER_TAG)
        if not tag:
            continue
        parts = partitions_of(run.tags)
        label = run.tags.get(PARTITION_TAG, "?") if parts is None or key_of is None else \
            f"{key_of(parts[0])}..{key_of(parts[-1])}"
        started = rec.start_time or rec.create_timestamp.timestamp()
        sighting = RunSighting(run.run_id, now - started, process_gone=worker_gone(tag))
        seen.append((run, sighting, label))
        if sighting.process_gone is None and sighting.age_s >= grace_s and \
                HEARTBEAT_TAG in run.tags:
            suspects.append(Suspect(run.run_id, label,
                                    tuple(parts) if parts is not None else None))
    facts = probe(suspects) if probe is not None and suspects else {}
    lost = []
    for run, sighting, label in seen:
        heartbeat, pinned = facts.get(run.run_id, (None, None))
        verdict = judge_run(dataclasses.replace(sighting, heartbeat=heartbeat, pinned=pinned),
                            grace_s)
        if verdict.lost:
            instance.report_run_failed(
                run, f"run of partition {label} is lost: {verdict.reason}; marked failed so "
                "the partition can run again")
            lost.append((run.run_id, verdict.reason))
    return lost


RUNS_WINDOW = 2000
"""Newest unsuccessful (queued, in progress, failed, canceled) runs a tick reads for all the
partitions it asks about together; a partition whose unsuccessful runs are all older than that
window counts as having none."""


def partition_runs(instance: DagsterInstance, partition_keys: dict[int, str], code: str,
                   policy: RetryPolicy, *,
                   exclude_tag: tuple[str, str | Collection[str]] | None = None,
                   errors: dict[str, str] | None = None) -> dict[int, PartitionRuns]:
    """The run history of each partition (``{partition: its Dagster partition key}``), in at
    most four run-records queries whatever their number (the newest :data:`RUNS_WINDOW`
    unsuccessful runs of one partition, and of ranges (:data:`RANGED_TAG`); the successes of
    the failing keys since, and of ranges). A run over a range counts for every partition of
    it (:data:`RANGE_TAG`). A newest failure's error is
    read from at most 4 of its events, only when ``errors`` (``{run_id: error}``, updated and
    pruned in place: keep it from tick to tick) lacks it. Runs carrying ``exclude_tag``
    (``(tag, value or values)``) are ignored; a failure counts only under ``code``
    (:data:`CODE_TAG`); counting stops at the newest success and at another code's failure.
    """
    keys = {key: p for p, key in partition_keys.items()}
    if not keys:
        return {}

    excluded: tuple[str, Collection[str]] | None = None
    if exclude_tag is not None:
        tag, values = exclude_tag
        excluded = (tag, {values} if isinstance(values, str) else set(values))

    def kept(run: DagsterRun) -> bool:
        return excluded is None or run.tags.get(excluded[0]) not in excluded[1]

    def keys_of(run: DagsterRun) -> list[str]:
        """The asked-about keys a run is a run of (one key, or those of its range)."""
        parts = partitions_of(run.tags)
        if parts is None:
            key = run.tags.get(PARTITION_TAG, "")
            return [key] if key in keys else []
        return [partition_keys[p] for p in parts if p in partition_keys]

    unsuccessful = [r for f in ({PARTITION_TAG: list(keys)}, {RANGED_TAG: "true"})
                    for r in instance.get_run_records(
                        RunsFilter(tags=f, statuses=[*_QUEUED, *_FAILED]), limit=RUNS_WINDOW)
                    if kept(r.dagster_run)]
    by_key: dict[str, list[RunRecord]] = {}
    for rec in sorted(unsuccessful, key=lambda r: r.create_timestamp, reverse=True):
        for key in keys_of(rec.dagster_run):
            by_key.setdefault(key, []).append(rec)  # newest first
    failing = [k for k, recs in by_key.items()
               if any(r.dagster_run.status in _FAILED for r in recs)]
    succeeded_at: dict[str, float] = {}
    if failing:
        oldest = min(r.create_timestamp for k in failing for r in by_key[k]
                     if r.dagster_run.status in _FAILED)
        for f in ({PARTITION_TAG: failing}, {RANGED_TAG: "true"}):
            for rec in instance.get_run_records(
                    RunsFilter(tags=f, statuses=[DagsterRunStatus.SUCCESS],
                               created_after=oldest), limit=RUNS_WINDOW):
                if not kept(rec.dagster_run):
                    continue
                for key in keys_of(rec.dagster_run):
                    succeeded_at[key] = max(succeeded_at.get(key, 0.0),
                                            rec.create_timestamp.timestamp())
    cache = errors if errors is not None else {}
    used: set[str] = set()

    def error_of(fact: RunFact) -> str:
        used.add(fact.run_id)
        if fact.run_id not in cache:
            cache[fact.run_id] = _error_of(instance, fact.run_id)
        return cache[fact.run_id]

    out: dict[int, PartitionRuns] = {}
    for key, p in keys.items():
        out[p] = runs_from_facts((_fact(rec) for rec in by_key.get(key, [])), code,
                                 succeeded_at=succeeded_at.get(key, 0.0), error_of=error_of)
    for run_id in [r for r in cache if r not in used]:
        del cache[run_id]
    return out


def _fact(rec: RunRecord) -> RunFact:
    """A run record as :class:`~cg_pipelines.core.triggers.RunFact` (unsuccessful runs only)."""
    run = rec.dagster_run
    return RunFact(run.run_id, "in_progress" if run.status in _QUEUED else "failed",
                   rec.create_timestamp.timestamp(),
                   rec.end_time or rec.update_timestamp.timestamp(), run.tags.get(CODE_TAG))


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

CHECK_MODE = "check"
""":data:`MODE_TAG` value of the ``<asset>_checks`` job's runs (check-only runs that record a
partition's operational checks again): not partition runs, so :func:`partition_runs` leaves
them out as it leaves out rebuilds."""


@dataclass(frozen=True)
class CheckState:
    """The latest execution of one check on one partition, as Dagster shows it.

    Attributes:
        passed: its outcome; ``None`` while only planned.
        current: whether it targets the partition's latest materialization (Dagster shows
            its status only then).
        run_id: its run (``""``: run-less).
        storage_id: the storage id of its latest event (grows with anything recorded).
    """

    passed: bool | None
    current: bool
    run_id: str
    storage_id: int


def check_states(instance: DagsterInstance, asset_key: AssetKey, names: Iterable[str]
                 ) -> dict[tuple[str, str], CheckState]:
    """The latest execution of each check ``names`` of ``asset_key`` per partition:
    ``{(check name, partition key): CheckState}`` (partitions never evaluated are missing).

    One call of the public ``EventLogStorage.get_asset_check_partition_info`` (what the UI
    reads; no ``DagsterInstance`` method does), the status read by its enum value.
    """
    keys = [AssetCheckKey(asset_key, n) for n in names]
    if not keys:
        return {}
    out = {}
    for i in instance.event_log_storage.get_asset_check_partition_info(keys):
        if i.partition_key is None:
            continue
        status = i.latest_execution_status.value
        passed = None if status == "PLANNED" else status == "SUCCEEDED"
        out[(i.check_key.name, i.partition_key)] = CheckState(
            passed, i.is_current, i.latest_planned_run_id or "", i.latest_check_event_storage_id)
    return out


def finished_runs(instance: DagsterInstance, run_ids: Iterable[str]) -> set[str]:
    """Those of ``run_ids`` whose run has ended (succeeded, failed or canceled) or does not
    exist (any more): one run-records query, none for no ids."""
    ids = {r for r in run_ids if r}
    if not ids:
        return set()
    alive = {rec.dagster_run.run_id for rec in instance.get_run_records(
        RunsFilter(run_ids=list(ids), statuses=_QUEUED))}
    return ids - alive


def partition_runs_of(instance: DagsterInstance, run_ids: Iterable[str]) -> set[str]:
    """Those of ``run_ids`` that are partition runs (drain or rebuild), not check-only runs
    (:data:`CHECK_MODE`): one run-records query, none for no ids; a run that no longer exists
    is neither."""
    ids = [r for r in run_ids if r]
    if not ids:
        return set()
    return {rec.dagster_run.run_id for rec in instance.get_run_records(RunsFilter(run_ids=ids))
            if rec.dagster_run.tags.get(MODE_TAG) != CHECK_MODE}


def record_first_checks(instance: DagsterInstance, evaluations: Sequence[AssetCheckEvaluation],
                        log: Any) -> list[AssetCheckEvaluation]:
    """Record each of ``evaluations`` run-less (``report_runless_asset_event``); returns those
    recorded. Only for a check and partition with no execution yet (Dagster refuses a second
    run-less one); a refused one is logged, not raised (the next tick requests a run)."""
    done = []
    for ev in evaluations:
        try:
            instance.report_runless_asset_event(ev)
            done.append(ev)
        except Exception as e:  # one refused result must not fail the tick
            log.warning(f"check {ev.check_name} of {ev.partition} not recorded: "
                        f"{type(e).__name__}: {one_line(str(e))[:300]}")
    return done
