"""Runs over ranges of partitions under a real Dagster daemon (issue 51): the backlog sensor
launches one run per block of D partitions (``PartitionRunsResource(partitions_per_run=D)``),
each a queued run in its own process selecting the asset without its run checks; D changes
from 4 to 2 between deployments with a backlog waiting, and the table equals the pandas
reference (exactly once, per-key order) with every partition materialized by its own event."""

from __future__ import annotations

from pathlib import Path

from dagster import AssetKey, AssetRecordsFilter, DagsterInstance, DagsterRunStatus, RunsFilter
from nats.js.api import StreamConfig

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.core.subjects import partition_for
from cg_pipelines.dagster.history import RANGE_TAG, RANGED_TAG
from cg_pipelines.jetstream import admin
from cg_pipelines.sinks.delta import DeltaSink
from tests.support import keyed
from tests.support.daemon import daemon, make_home, start_sensor, wait_until

PARTITIONS = 8

LOCATION = '''\
import os

from cg_pipelines.dagster import (ConsumerGroupAsset, DeltaWarehouseResource, NatsResource,
                                  PartitionRunsResource, build_definitions)
from tests.support import keyed

devices = ConsumerGroupAsset(
    name="devices", stream=os.environ["CG_TEST_STREAM"], group="g", partitions=8,
    processor=keyed.processor(), sensor_interval_s=1, schedule_cron=None,
    lag_objective_s=3600.0)

defs = build_definitions([devices], resources={
    "nats": NatsResource(servers=os.environ["CG_TEST_NATS"]),
    "warehouse": DeltaWarehouseResource(root=os.environ["CG_TEST_WAREHOUSE"]),
    "partition_runs": PartitionRunsResource(hold_wait_s=2.0, partitions_per_run=__D__),
})
'''


def _ranges(instance: DagsterInstance) -> list[tuple[str, DagsterRunStatus]]:
    return [(r.tags[RANGE_TAG], r.status)
            for r in instance.get_runs(RunsFilter(tags={RANGED_TAG: "true"}))]


def _table_exact(warehouse: Path, evs: list[tuple[str, int]]) -> bool:
    sink = DeltaSink(str(warehouse / "devices"), schema=keyed.OUT_SCHEMA)
    if not sink.exists():
        return False
    return keyed.mismatches(sink.read(), evs) is None


async def test_range_runs_under_the_daemon_and_a_change_of_d(js, nats_server, unique_name,
                                                             tmp_path) -> None:
    stream = unique_name
    evs = keyed.events(n_keys=48, n_events=800)
    assert {partition_for([k], PARTITIONS) for k, _ in evs} == set(range(PARTITIONS))
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    await admin.create_elastic(js, stream, "g", ElasticConfig(
        PARTITIONS, (PartitioningFilter(f"{stream}.*", (1,)),), members=("m1",)))
    await keyed.publish(js, stream, evs)

    home = make_home(tmp_path / "home")
    location, warehouse = tmp_path / "location.py", tmp_path / "warehouse"
    env = {"CG_TEST_STREAM": stream, "CG_TEST_NATS": nats_server.url,
           "CG_TEST_WAREHOUSE": str(warehouse)}
    location.write_text(LOCATION.replace("__D__", "4"))
    start_sensor(home, location, env, "devices_backlog")
    instance = DagsterInstance.from_config(str(home))

    with daemon(home, location, env):
        wait_until("the table equals the reference", lambda: _table_exact(warehouse, evs),
                   240, home)
        first = wait_until("every run ended", lambda: _all_ended(instance), 60, home)
    # the work queue fills while the group sources the stream: a tick may see part of the
    # backlog, so the runs are any ranges of blocks of 4 (one partition: an ordinary run)
    ranged = [rng for rng, _ in _ranges(instance)]
    assert ranged and all(_in_block(rng, 4) for rng in ranged), ranged

    # every partition has its own materialization with its own figures
    for p in range(PARTITIONS):
        recs = instance.fetch_materializations(AssetRecordsFilter(
            asset_key=AssetKey("devices"), asset_partitions=[f"g-{p}"]), limit=5).records
        assert len(recs) == 1, (p, len(recs))
        md = recs[0].asset_materialization.metadata  # type: ignore[union-attr]
        mine = sum(1 for k, _ in evs if partition_for([k], PARTITIONS) == p)
        assert md["messages"].value == mine, (p, md["messages"].value, mine)

    # D = 2 from the next deployment on: the new backlog runs in blocks of 2
    more = keyed.events(n_keys=48, n_events=400)  # the same keys: their state goes on
    await keyed.publish(js, stream, more)
    location.write_text(LOCATION.replace("__D__", "2"))
    with daemon(home, location, env):
        wait_until("the table equals the reference again",
                   lambda: _table_exact(warehouse, [*evs, *more]), 240, home)
        wait_until("every run ended", lambda: _all_ended(instance), 60, home)
    later = [rng for rng, _ in _ranges(instance)][:len(_ranges(instance)) - len(ranged)]
    assert all(_in_block(rng, 2) for rng in later), later  # newest first: the D = 2 runs
    assert first


def _in_block(rng: str, d: int) -> bool:
    a, b = (int(x) for x in rng.split("-"))
    return a < b and a // d == b // d


def _all_ended(instance: DagsterInstance) -> bool:
    """Every run ended, and every partition run succeeded (check-only runs too)."""
    runs = instance.get_runs()
    return bool(runs) and all(r.status == DagsterRunStatus.SUCCESS for r in runs)
