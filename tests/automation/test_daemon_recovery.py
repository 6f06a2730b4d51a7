"""Unattended operation under a real Dagster daemon (issue 19's "done when" (a)-(c)).

One code location, one elastic group of 3 partitions, the backlog sensor on, nobody watching:

- partition 0 is healthy;
- partition 1's transform fails its first two runs (a flaky dependency), then works: it is
  retried by the sensor after a backoff (2 s, then 4 s) under new run keys, and each retry
  drains at once — not ``held``, although the lease's ack wait and pin timeout are the
  production 30 s (a failed run gives its partition back);
- partition 2's transform is broken (a bug): after 3 failed runs in a row it is no longer
  retried, the ``partition_runs_succeeding`` check fails naming it and its error, the tick's
  reason says so; then a fixed definition is deployed (the daemon restarted on new code) and
  the partition resumes by itself.

The table then equals the pandas reference (exactly once, per-key order).

The whole scenario runs twice: on a SQLite instance (Dagster's default) and on a
**PostgreSQL-backed** one (``storage: postgres:`` with dagster-postgres, the database from the
``postgres_database`` fixture), as production runs; on both, the flaky partition's stored
failure starts with its cause.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from dagster import (
    AssetCheckKey,
    AssetKey,
    DagsterEventType,
    DagsterInstance,
    DagsterRunStatus,
)
from dagster._core.event_api import PartitionKeyFilter
from dagster._core.scheduler.instigation import InstigatorType
from nats.js.api import StreamConfig

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.core.subjects import partition_for
from cg_pipelines.jetstream import admin
from cg_pipelines.sinks.delta import DeltaSink
from tests.support import keyed
from tests.support.daemon import daemon, make_home, partition_runs, start_sensor, wait_until

LOCATION = '''\
import os
from pathlib import Path

from cg_pipelines.dagster import (ConsumerGroupAsset, DeltaWarehouseResource, NatsResource,
                                  PartitionRunsResource, build_definitions)
from cg_pipelines.engine.processing import ArrowProcessor
from tests.support import keyed

FLAKY = Path(os.environ["CG_TEST_FLAKY"])  # failures the flaky partition has left


def transform(table, ctx):
    if ctx.partition == __FLAKY_P__:
        left = int(FLAKY.read_text() or 0)
        if left > 0:
            FLAKY.write_text(str(left - 1))
            raise ConnectionError(f"flaky dependency ({left - 1} failures left)")
    __BUG__
    return keyed.transform(table, ctx)


devices = ConsumerGroupAsset(
    name="devices", stream=os.environ["CG_TEST_STREAM"], group="g", partitions=__PARTITIONS__,
    processor=ArrowProcessor(keyed.DECODER, transform, state=keyed.STATE),
    sensor_interval_s=1, schedule_cron=None, lag_objective_s=3600.0)

defs = build_definitions([devices], resources={
    "nats": NatsResource(servers=os.environ["CG_TEST_NATS"]),
    "warehouse": DeltaWarehouseResource(root=os.environ["CG_TEST_WAREHOUSE"]),
    "partition_runs": PartitionRunsResource(hold_wait_s=2.0, retry_max_failures=__MAX_FAILURES__,
                                            retry_backoff_s=2.0, retry_max_backoff_s=4.0),
})
'''
BUG = 'if ctx.partition == __BUG_P__:\n        raise ValueError("bad transform: unit mix-up (v1)")'
FIXED = "pass  # v2: the unit mix-up is fixed"


def _write_location(path: Path, bug: str, partitions: int = 3, flaky: int = 1,
                    broken: int = 2, max_failures: int = 3) -> None:
    path.write_text(LOCATION.replace("__BUG__", bug).replace("__BUG_P__", str(broken))
                    .replace("__FLAKY_P__", str(flaky))
                    .replace("__PARTITIONS__", str(partitions))
                    .replace("__MAX_FAILURES__", str(max_failures)))


def _statuses(instance: DagsterInstance, key: str) -> list[DagsterRunStatus]:
    return [r.status for r in partition_runs(instance, key)]


def _check(instance: DagsterInstance, name: str, partition: str | None = None):
    """The check's latest evaluation (of ``partition``: the checks are partitioned)."""
    rec = instance.event_log_storage.get_latest_asset_check_execution_by_key(
        [AssetCheckKey(AssetKey("devices"), name)],
        partition_filter=None if partition is None else PartitionKeyFilter(key=partition),
    ).get(AssetCheckKey(AssetKey("devices"), name))
    data = None if rec is None or rec.event is None else rec.event.dagster_event \
        .event_specific_data
    return data if hasattr(data, "passed") else None  # not a mere "planned" record


def _skip_reasons(instance: DagsterInstance) -> list[str]:
    out = []
    for state in instance.all_instigator_state(instigator_type=InstigatorType.SENSOR):
        if state.instigator_name == "devices_backlog":
            out += [t.skip_reason or "" for t in instance.get_ticks(
                state.instigator_origin_id, state.selector_id, limit=30)]
    return out


async def _setup(js, stream: str, evs: list[tuple[str, int]], partitions: int = 3) -> None:
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    await admin.create_elastic(js, stream, "g", ElasticConfig(
        partitions, (PartitioningFilter(f"{stream}.*", (1,)),), members=("m1",)))
    await keyed.publish(js, stream, evs)


@pytest.mark.parametrize("storage", ["sqlite", "postgres"])
async def test_failed_partitions_recover_without_a_human(js, nats_server, unique_name,
                                                         tmp_path, storage: str,
                                                         request: pytest.FixtureRequest
                                                         ) -> None:
    stream = unique_name
    evs = keyed.events(n_keys=24, n_events=600)
    assert {partition_for([k], 3) for k, _ in evs} == {0, 1, 2}
    await _setup(js, stream, evs)
    url = None
    if storage == "postgres":
        # SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3; dagster-postgres brings
        # psycopg2.
        url = request.getfixturevalue("postgres_database").replace(
            "postgresql://", "postgresql+psycopg2://", 1)
    home = make_home(tmp_path / "home", postgres_url=url)
    location = tmp_path / "location.py"
    flaky = tmp_path / "flaky"
    flaky.write_text("2")
    warehouse = tmp_path / "warehouse"
    env = {"CG_TEST_STREAM": stream, "CG_TEST_NATS": nats_server.url,
           "CG_TEST_WAREHOUSE": str(warehouse), "CG_TEST_FLAKY": str(flaky)}
    _write_location(location, BUG)
    start_sensor(home, location, env, "devices_backlog")

    def run() -> None:
        instance = DagsterInstance.from_config(str(home))
        kind = "Postgres" if storage == "postgres" else "Sqlite"
        assert type(instance.run_storage).__name__ == f"{kind}RunStorage"
        assert type(instance.event_log_storage).__name__ == f"{kind}EventLogStorage"
        with daemon(home, location, env):
            # (a) + (b): partition 1 fails twice, is retried after its backoff, drains.
            wait_until("partition 1 succeeded", lambda: DagsterRunStatus.SUCCESS in _statuses(
                instance, "g-1"), 240, home)
            wait_until("partition 0 succeeded", lambda: DagsterRunStatus.SUCCESS in _statuses(
                instance, "g-0"), 60, home)
            runs1 = partition_runs(instance, "g-1")
            assert [r.status for r in runs1] == [DagsterRunStatus.FAILURE] * 2 + [
                DagsterRunStatus.SUCCESS], [(r.status, r.tags) for r in runs1]
            keys = [r.tags.get("dagster/run_key", "") for r in runs1]
            assert keys[0].count(":") == 2 and keys[1].endswith(":1") and \
                keys[2].endswith(":2"), keys
            assert flaky.read_text() == "0"
            # the failed run's error, as stored: the cause first
            (failed,) = instance.all_logs(runs1[0].run_id,
                                          of_type=DagsterEventType.STEP_FAILURE)
            err = failed.dagster_event.event_specific_data.error
            assert err.message.startswith("dagster._core.definitions.events.Failure: "
                                          "ConnectionError: flaky dependency (1 failures "
                                          "left)\npartition 1 of "), err.message
            # the retry that succeeded drained at once: it was not "held" by the failed run
            mat = instance.get_latest_materialization_event(AssetKey("devices"))
            assert mat is not None

            # (c): partition 2 fails 3 times in a row, then is reported and left alone.
            wait_until("partition 2 failed 3 times", lambda: _statuses(instance, "g-2") == [
                DagsterRunStatus.FAILURE] * 3, 240, home)
            failing = wait_until("partition_runs_succeeding failed", lambda: (
                (c := _check(instance, "partition_runs_succeeding", "g-2")) is not None
                and not c.passed and c), 60, home)
            assert "g-2 failed 3 runs in a row" in (failing.description or "")
            assert "bad transform: unit mix-up (v1)" in (failing.description or "")
            wait_until("the tick says why", lambda: any(
                "partition 2: failed 3 time(s) in a row" in r and "unit mix-up" in r
                for r in _skip_reasons(instance)), 60, home)
            time.sleep(10)  # more than the largest backoff (4 s): still no 4th run
            assert _statuses(instance, "g-2") == [DagsterRunStatus.FAILURE] * 3

        # A fixed definition is deployed: the partition resumes by itself.
        _write_location(location, FIXED)
        with daemon(home, location, env):
            wait_until("partition 2 succeeded after the fix", lambda: DagsterRunStatus.SUCCESS
                       in _statuses(instance, "g-2"), 240, home)
            wait_until("partition_runs_succeeding passes again", lambda: (
                (c := _check(instance, "partition_runs_succeeding", "g-2")) is not None
                and c.passed), 60, home)
        runs2 = partition_runs(instance, "g-2")
        assert [r.status for r in runs2] == [DagsterRunStatus.FAILURE] * 3 + [
            DagsterRunStatus.SUCCESS]
        assert len({r.tags["cg/code_version"] for r in runs2}) == 2  # v1 (failed), v2
        instance.dispose()

    await asyncio.to_thread(run)
    sink = DeltaSink(str(warehouse / "devices"))
    assert keyed.mismatches(sink.read(), evs) is None
