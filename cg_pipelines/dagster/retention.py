"""Run retention (issue 40): the ``<asset>_run_retention`` sensor (running by default) deletes,
a bounded number per evaluation, the asset's finished runs older than ``run_retention_hours``
that nothing reads any more: not the newest ``run_retention_keep_runs``, nor per partition its
newest materializing and partition runs and the failures since, nor the runs of its latest
check results (:func:`retain_runs`). Public Dagster APIs only."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from dagster import (
    AssetKey,
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    DefaultSensorStatus,
    RunRecord,
    RunsFilter,
    SensorDefinition,
    SensorEvaluationContext,
    SkipReason,
    sensor,
)

from cg_pipelines.dagster.history import CHECK_MODE, MODE_TAG, PARTITION_TAG, check_states

__all__ = ["RETENTION_INTERVAL_S", "RetentionResult", "build_run_retention_sensor",
           "retain_runs", "retention_bound"]

RETENTION_INTERVAL_S = 60
"""Seconds between two evaluations of a run retention sensor (at least)."""

SUCCESS_LOOKBACK = 20
"""Newest successful runs read per partition to find its newest materializing run and its
newest partition run (check-only runs in between are skipped). A partition where they are not
both among them keeps all its runs in that evaluation (nothing deleted on a guess)."""

PAGE = 500
"""Run records read per query while looking for runs to delete."""

_FINISHED = [DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED]
_FAILED = {DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED}


@dataclass
class RetentionResult:
    """What one evaluation did: ``deleted`` (run ids, oldest first), ``scanned`` (finished
    runs older than the retention looked at), ``kept`` (of those, kept for a reason above),
    ``more`` (it stopped at its delete limit: there may be more to delete)."""

    deleted: list[str] = field(default_factory=list)
    scanned: int = 0
    kept: int = 0
    more: bool = False

    def summary(self, hours: float) -> str:
        more = "; more next time (the per-evaluation limit)" if self.more else ""
        return (f"deleted {len(self.deleted)} run(s) finished and created more than "
                f"{hours:g} h ago; kept {self.kept} older one(s) still read (the newest "
                f"runs, each partition's last success and failures since, its latest check "
                f"results){more}")


def _ts(rec: RunRecord) -> float:
    return rec.create_timestamp.timestamp()


def _mode(run: DagsterRun) -> str:
    return run.tags.get(MODE_TAG, "drain")


@dataclass
class _Newest:
    """A partition's newest successful runs: any materializing one, and a partition run;
    ``known``: both were found, or the partition has fewer successful runs than were read."""

    materialized: str | None = None
    partition_run: str | None = None
    partition_run_at: float = float("-inf")
    known: bool = False


def _newest_successes(instance: DagsterInstance, key: str) -> _Newest:
    out = _Newest()
    records = instance.get_run_records(RunsFilter(tags={PARTITION_TAG: key},
                                                  statuses=[DagsterRunStatus.SUCCESS]),
                                       limit=SUCCESS_LOOKBACK)
    for rec in records:
        mode = _mode(rec.dagster_run)
        if mode == CHECK_MODE:
            continue
        if out.materialized is None:
            out.materialized = rec.dagster_run.run_id
        if mode != "rebuild" and out.partition_run is None:
            out.partition_run, out.partition_run_at = rec.dagster_run.run_id, _ts(rec)
        if out.materialized is not None and out.partition_run is not None:
            break
    out.known = (out.materialized is not None and out.partition_run is not None) or \
        len(records) < SUCCESS_LOOKBACK
    return out


def retain_runs(instance: DagsterInstance, asset_key: AssetKey, partition_keys: Sequence[str],
                job_names: Iterable[str], check_names: Iterable[str], *,
                keep_hours: float, keep_runs: int, max_deletes: int,
                now: float | None = None) -> RetentionResult:
    """Delete up to ``max_deletes`` finished runs of the asset's partitions (the module
    docstring says which), oldest first: runs newer than ``keep_hours`` before ``now`` (Unix
    seconds) and the newest ``keep_runs`` stay; ``job_names``: the asset's jobs;
    ``check_names``: its partitioned checks. Work: 2 queries, pages of :data:`PAGE` older
    runs, one query per partition met, at most ``max_deletes`` ``delete_run`` calls.
    """
    now = time.time() if now is None else now
    keys = list(partition_keys)
    jobs = set(job_names)
    out = RetentionResult()
    if not keys or max_deletes < 1:
        return out
    keep = {r.dagster_run.run_id for r in instance.get_run_records(
        RunsFilter(tags={PARTITION_TAG: keys}), limit=keep_runs)} if keep_runs > 0 else set()
    keep |= {st.run_id for st in check_states(instance, asset_key, check_names).values()
             if st.run_id}
    cutoff = datetime.fromtimestamp(now - keep_hours * 3600.0, tz=UTC)
    newest: dict[str, _Newest] = {}
    cursor: str | None = None
    while len(out.deleted) < max_deletes:
        page = instance.get_run_records(
            RunsFilter(tags={PARTITION_TAG: keys}, statuses=_FINISHED, created_before=cutoff),
            limit=PAGE, ascending=True, cursor=cursor)
        for rec in page:
            run = rec.dagster_run
            out.scanned += 1
            if run.job_name not in jobs and asset_key not in (run.asset_selection or ()):
                continue  # another job's run of a partition key like ours: not ours
            key = run.tags.get(PARTITION_TAG, "")
            if key not in newest:
                newest[key] = _newest_successes(instance, key)
            last = newest[key]
            if not last.known or run.run_id in keep or \
                    run.run_id in (last.materialized, last.partition_run) or (
                    run.status in _FAILED and _ts(rec) > last.partition_run_at):
                out.kept += 1
                continue
            instance.delete_run(run.run_id)
            out.deleted.append(run.run_id)
            if len(out.deleted) >= max_deletes:
                out.more = True
                break
        if len(page) < PAGE:
            break
        cursor = page[-1].dagster_run.run_id
    return out


def retention_bound(runs_per_hour: float, partitions: int, *, keep_hours: float,
                    keep_runs: int, checks: int, failures: int) -> int:
    """The most finished runs :func:`retain_runs` leaves when each evaluation deletes what
    became deletable: ``keep_hours`` (plus one interval) of runs at ``runs_per_hour``,
    ``keep_runs``, and per partition 2 successes, ``checks`` check runs and ``failures``
    failed runs. Queued and in-progress runs come on top."""
    return int(runs_per_hour * (keep_hours + RETENTION_INTERVAL_S / 3600.0)) + keep_runs + \
        partitions * (2 + checks + failures)


def build_run_retention_sensor(name: str, asset_key: AssetKey, partition_keys: Sequence[str],
                               job_names: Iterable[str], check_names: Iterable[str],
                               runs_resource_key: str) -> SensorDefinition:
    """``<name>_run_retention``: :func:`retain_runs` every :data:`RETENTION_INTERVAL_S` s
    with the ``run_retention_*`` settings of the ``runs_resource_key`` resource (hours
    ``None``: off). Running by default; its tick's reason says what it deleted and kept."""
    keys, jobs, checks = list(partition_keys), list(job_names), list(check_names)

    @sensor(name=f"{name}_run_retention", minimum_interval_seconds=RETENTION_INTERVAL_S,
            default_status=DefaultSensorStatus.RUNNING, required_resource_keys={runs_resource_key},
            description="Deletes finished runs of this asset created more than "
            "run_retention_hours ago (PartitionRunsResource; None: off), at most "
            "run_retention_max_deletes per tick, keeping the newest run_retention_keep_runs, "
            "each partition's last successful run and the failures since, and the runs of its "
            "latest check results.")
    def _retention(context: SensorEvaluationContext) -> SkipReason:
        runs: Any = getattr(context.resources, runs_resource_key)
        hours = runs.run_retention_hours
        if hours is None:
            return SkipReason("run retention is off (run_retention_hours=None)")
        got = retain_runs(context.instance, asset_key, keys, jobs, checks, keep_hours=hours,
                          keep_runs=runs.run_retention_keep_runs,
                          max_deletes=runs.run_retention_max_deletes)
        return SkipReason(got.summary(hours))

    return _retention
