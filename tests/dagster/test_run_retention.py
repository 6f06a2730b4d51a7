"""Dagster run retention shipped with the group asset (issue 40): a week of runs in compressed
time (run creation times set in the past, ``now`` injected) stays under the stated bound, and
what the backlog sensor's retry rule and the UI read survives: each partition's last
successful run and the failures since, in-progress runs, the runs of the latest check
results. Then the same through the real ``<asset>_run_retention`` sensor."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from dagster import (
    AssetCheckKey,
    AssetCheckResult,
    AssetKey,
    AssetSelection,
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    DefaultSensorStatus,
    Definitions,
    RunsFilter,
    StaticPartitionsDefinition,
    asset,
    asset_check,
    define_asset_job,
    instance_for_test,
)

from cg_pipelines.core.triggers import PartitionRuns, RetryPolicy
from cg_pipelines.dagster import build_definitions
from cg_pipelines.dagster.checks import EXCLUDED_RUNS
from cg_pipelines.dagster.history import CHECK_MODE, CODE_TAG, MODE_TAG, partition_runs
from cg_pipelines.dagster.resources import (
    DeltaWarehouseResource,
    NatsResource,
    PartitionRunsResource,
)
from cg_pipelines.dagster.retention import retain_runs, retention_bound
from tests.dagster import helpers as th
from tests.dagster.defs_keyed import ASSET, JOB
from tests.dagster.defs_keyed import spec as make_spec

KEY = AssetKey("devices")
KEYS = [f"g-{p}" for p in range(8)]
JOBS = ["devices_job", "devices_rebuild", "devices_checks"]
CHECKS = ["backlog_drained", "lag_within_objective", "partition_runs_succeeding"]
POLICY = RetryPolicy(max_failures=5)
HOUR = 3600.0
PER_HOUR = 2  # runs per busy partition per simulated hour
KEEP_HOURS, KEEP_RUNS, MAX_DELETES = 24.0, 20, 200


@pytest.fixture
def sqlite_instance() -> Iterator[DagsterInstance]:
    """A persistent SQLite instance (run storage and per-run event logs, as `dagster dev`;
    a deletion costs ~0.1 s there, against ~1 ms in memory)."""
    with instance_for_test() as inst:
        yield inst


def _add(instance: DagsterInstance, at: datetime, key: str, status: DagsterRunStatus,
         job: str = "devices_job", mode: str | None = None) -> str:
    tags = {"dagster/partition": key, CODE_TAG: "v1"}
    if mode:
        tags[MODE_TAG] = mode
    run_id = str(uuid.uuid4())
    instance.run_storage.add_historical_run(  # a run created at `at` (test-only storage call)
        DagsterRun(job_name=job, run_id=run_id, status=status, tags=tags), at)
    return run_id


def _ours(instance: DagsterInstance) -> list:
    return [r for r in instance.get_run_records(RunsFilter(tags={"dagster/partition": KEYS}))
            if r.dagster_run.job_name in JOBS]


def _retry_view(instance: DagsterInstance) -> dict[int, PartitionRuns]:
    return partition_runs(instance, dict(enumerate(KEYS)), "v1", POLICY,
                          exclude_tag=EXCLUDED_RUNS)


def _last_successes(instance: DagsterInstance) -> dict[str, str]:
    """Each partition's newest successful partition run (drain job) id."""
    out: dict[str, str] = {}
    for rec in instance.get_run_records(RunsFilter(tags={"dagster/partition": KEYS},
                                                   statuses=[DagsterRunStatus.SUCCESS],
                                                   job_name="devices_job")):
        out.setdefault(rec.dagster_run.tags["dagster/partition"], rec.dagster_run.run_id)
    return out


def test_a_week_of_runs_stays_bounded(instance: DagsterInstance) -> None:
    """168 simulated hours, 2 runs an hour on each of 7 busy partitions (g-7 ran once, in the
    first hour, then idled all week); g-5 failed twice at hour 100 and recovered at 101;
    g-6 failed 5 times in a row at hour 120 (the retry limit: the sensor gives up) and has
    not run since; a rebuild and daily check-only runs; a run stuck in progress since hour
    10; another job's run on a key like ours. A retention pass after each hour (24 h, keep
    the newest 20, at most 200 deletes). After every pass: the asset's finished runs are
    within ``retention_bound``; each partition's last successful run is still there; the retry
    rule's view of every partition is what it was before the pass. At the end: g-7's run of
    hour 0, g-6's five failures (47 h old), the in-progress run and the other job's run are
    there; g-5's failures of hour 100 (older than its recovery and than 24 h) are gone.
    In memory (the same SQL storage as SQLite's, without its per-run files)."""
    inst = instance
    base = datetime.now(UTC) - timedelta(days=8)
    first_g7 = _add(inst, base, "g-7", DagsterRunStatus.SUCCESS)
    stuck = _add(inst, base + timedelta(hours=10), "g-4", DagsterRunStatus.STARTED)
    foreign = _add(inst, base + timedelta(hours=1), "g-1", DagsterRunStatus.SUCCESS,
                   job="someone_elses_job")
    g5_failures: list[str] = []
    g6_failures: list[str] = []
    bound = retention_bound(7 * PER_HOUR + 2, 8, keep_hours=KEEP_HOURS, keep_runs=KEEP_RUNS,
                            checks=len(CHECKS), failures=POLICY.max_failures)
    most = 0
    for h in range(168):
        for i in range(PER_HOUR):
            at = base + timedelta(hours=h, minutes=30 * i)
            for p in range(7):
                key = f"g-{p}"
                if p == 6 and h >= 120:
                    if h == 120 and i == 0:
                        g6_failures += [_add(inst, at + timedelta(minutes=j), key,
                                             DagsterRunStatus.FAILURE) for j in range(5)]
                    continue
                failing = p == 5 and h == 100
                run_id = _add(inst, at, key, DagsterRunStatus.FAILURE if failing
                              else DagsterRunStatus.SUCCESS)
                if failing:
                    g5_failures.append(run_id)
        if h % 24 == 12:
            _add(inst, base + timedelta(hours=h, minutes=50), "g-2", DagsterRunStatus.SUCCESS,
                 job="devices_checks", mode=CHECK_MODE)
        if h == 50:
            _add(inst, base + timedelta(hours=h, minutes=55), "g-3", DagsterRunStatus.SUCCESS,
                 job="devices_rebuild", mode="rebuild")
        before, lasts = _retry_view(inst), _last_successes(inst)
        got = retain_runs(inst, KEY, KEYS, JOBS, CHECKS, keep_hours=KEEP_HOURS,
                          keep_runs=KEEP_RUNS, max_deletes=MAX_DELETES,
                          now=(base + timedelta(hours=h + 1)).timestamp())
        assert not got.more  # 200 a pass keeps up with ~16 new runs an hour
        assert _retry_view(inst) == before, h
        assert _last_successes(inst) == lasts, h
        finished = [r for r in _ours(inst) if r.dagster_run.status != DagsterRunStatus.STARTED]
        assert len(finished) <= bound, (h, len(finished), bound)
        most = max(most, len(finished))
    runs = {r.dagster_run.run_id for r in inst.get_run_records()}
    assert {first_g7, stuck, foreign, *g6_failures} <= runs
    assert not set(g5_failures) & runs
    assert _retry_view(inst)[6].failures == 5  # still given up on: the limit was reached
    total = 168 * (7 * PER_HOUR) + 2
    print(f"a week: {total:,} runs created, at most {most} finished runs kept after a pass "
          f"(bound {bound}), {len(_ours(inst))} at the end")
    assert most < total / 5


def test_the_runs_of_the_latest_check_results_stay(sqlite_instance: DagsterInstance) -> None:
    """A check-only run whose result is a partition's latest stays, however old: its run
    holds what the check's partition state shows (keep_runs 0 here: nothing kept for being
    among the newest)."""
    parts = StaticPartitionsDefinition(KEYS)

    @asset(name="devices", partitions_def=parts)
    def devices() -> None:
        return None

    @asset_check(asset=devices, name="lag_within_objective", partitions_def=parts)
    def lag() -> AssetCheckResult:
        return AssetCheckResult(passed=True)

    job = define_asset_job("devices_checks", selection=AssetSelection.assets(devices))
    defs = Definitions(assets=[devices], asset_checks=[lag], jobs=[job])
    inst = sqlite_instance
    check_run = defs.resolve_job_def("devices_checks").get_subset(
        asset_selection=set(), asset_check_selection={AssetCheckKey(KEY, "lag_within_objective")}
    ).execute_in_process(partition_key="g-2", instance=inst, tags={MODE_TAG: CHECK_MODE}).run_id
    older = _add(inst, datetime.now(UTC) - timedelta(hours=1), "g-2", DagsterRunStatus.SUCCESS,
                 job="devices_checks", mode=CHECK_MODE)
    got = retain_runs(inst, KEY, KEYS, JOBS, CHECKS, keep_hours=KEEP_HOURS, keep_runs=0,
                      max_deletes=MAX_DELETES, now=datetime.now(UTC).timestamp() + 2 * 86400)
    assert got.deleted == [older]
    assert inst.get_run_by_id(check_run) is not None


def test_the_retention_sensor_deletes_a_week_old_backlog(
        tmp_path: Path, sqlite_instance: DagsterInstance) -> None:
    """The real ``keyed_events_run_retention`` sensor (running by default) on a week of runs
    created in the past: each tick deletes at most ``run_retention_max_deletes``; ticks go on
    until only the runs still read are left (each partition's last success, the newest
    ``run_retention_keep_runs``); its reason says so. Off with ``run_retention_hours=None``."""
    inst = sqlite_instance
    now = datetime.now(UTC)
    for h in range(7 * 24, 24, -6):  # a run of each partition every 6 h, a week to a day ago
        for p in range(4):
            _add(inst, now - timedelta(hours=h), f"g-{p}", DagsterRunStatus.SUCCESS, job=JOB)
    created = (7 * 24 - 24) // 6 * 4

    def defs_with(**retention: object) -> Definitions:
        return build_definitions([make_spec("S")], resources={
            "nats": NatsResource(servers="nats://127.0.0.1:1"),
            "warehouse": DeltaWarehouseResource(root=str(tmp_path / "wh")),
            "partition_runs": PartitionRunsResource(**retention)})  # type: ignore[arg-type]

    sensor_name = f"{ASSET}_run_retention"
    off = defs_with(run_retention_hours=None)
    assert off.resolve_sensor_def(sensor_name).default_status == DefaultSensorStatus.RUNNING
    data = th.tick(off, sensor_name, inst)
    assert "run retention is off" in (data.skip_message or "")
    assert len(inst.get_run_records()) == created

    defs = defs_with(run_retention_max_deletes=40, run_retention_keep_runs=10)
    left = []
    for _ in range(5):  # the ticks of 5 minutes
        data = th.tick(defs, sensor_name, inst)
        assert not data.run_requests
        left.append(len(inst.get_run_records()))
    assert left == [created - 40, created - 80, 10, 10, 10]  # at most 40 a tick, then
    # the newest 10 only (each partition's last success among them)
    assert "deleted 0 run(s)" in (data.skip_message or ""), data.skip_message
    keys = {r.dagster_run.tags["dagster/partition"] for r in inst.get_run_records()}
    assert keys == {"g-0", "g-1", "g-2", "g-3"}
