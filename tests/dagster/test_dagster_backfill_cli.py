"""A real backfill through the ``dagster job backfill`` CLI: one run per selected partition,
launched by the DefaultRunCoordinator (no daemon) in run-worker subprocesses against the
session's nats-server; the Delta table then equals the pandas reference for every event."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from dagster import DagsterRunStatus
from nats.js import JetStreamContext

from cg_pipelines.local.nats_server import NatsServer
from tests.dagster import helpers as h
from tests.dagster.defs_keyed import JOB, PARTITIONS, pkey
from tests.support import keyed
from tests.support.dagster_cli import backfill, dagster_home


async def test_cli_backfill_runs_every_partition(js: JetStreamContext, nats_server: NatsServer,
                                                 unique_name: str, warehouse: str,
                                                 tmp_path: Path) -> None:
    stream = unique_name
    await h.create_group(js, stream, members=("m1", "m2"))
    evs = keyed.events(n_keys=30, n_events=600)
    assert {h.partition_of(k) for k, _ in evs} == set(range(PARTITIONS))
    await h.publish(js, stream, evs, len(evs))

    home = dagster_home(tmp_path / "dagster_home")
    env = {**os.environ, "DAGSTER_HOME": str(home), "CG_TEST_STREAM": stream,
           "NATS_URL": nats_server.url, "CG_WAREHOUSE": warehouse}
    env.pop("CG_MEMBERS", None)

    t0 = time.perf_counter()
    runs = await asyncio.to_thread(backfill, home, env, JOB,
                                   [pkey(p) for p in range(PARTITIONS)], PARTITIONS)
    print(f"backfill of {PARTITIONS} partitions: {time.perf_counter() - t0:.1f} s")

    assert len(runs) == PARTITIONS
    assert sorted(r.tags["dagster/partition"] for r in runs) == [pkey(p) for p in
                                                                  range(PARTITIONS)]
    for r in runs:
        assert r.job_name == JOB
        assert r.status == DagsterRunStatus.SUCCESS, r
        assert "dagster/backfill" in r.tags
    assert len({r.tags["dagster/backfill"] for r in runs}) == 1
    h.assert_table_equals_reference(warehouse, evs)
    await h.assert_work_queue_empty(js, stream)
