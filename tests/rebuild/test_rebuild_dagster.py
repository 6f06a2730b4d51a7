"""A rebuild is a Dagster backfill: ``<asset>_rebuild`` over every partition (the real
``dagster job backfill`` CLI, one run per partition) recomputes each from the origin stream;
the materializations say ``rebuilt`` with the origin range and the rows replaced and written.
Draining and rebuilding runs of one partition stay exclusive (same ``dagster/partition``)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from dagster import AssetKey, DagsterInstance, DagsterRunStatus
from deltalake import DeltaTable
from nats.js import JetStreamContext

from cg_pipelines.local.nats_server import NatsServer
from tests.dagster import helpers as h
from tests.dagster.defs_keyed import ASSET, JOB, PARTITIONS, pkey
from tests.support import keyed
from tests.support.dagster_cli import backfill, dagster_home


async def test_backfill_of_the_rebuild_job_rebuilds_every_partition(
        js: JetStreamContext, nats_server: NatsServer, unique_name: str,
        tmp_path: Path) -> None:
    stream, warehouse = unique_name, str(tmp_path / "wh")
    await h.create_group(js, stream, members=("m1",))
    evs = keyed.events(n_keys=30, n_events=400)
    await h.publish(js, stream, evs, len(evs))
    home = dagster_home(tmp_path / "home")
    env = {**os.environ, "DAGSTER_HOME": str(home), "CG_TEST_STREAM": stream,
           "NATS_URL": nats_server.url, "CG_WAREHOUSE": warehouse}
    env.pop("CG_MEMBERS", None)
    keys = [pkey(p) for p in range(PARTITIONS)]
    drained = await asyncio.to_thread(backfill, home, env, JOB, keys, PARTITIONS)
    assert all(r.status == DagsterRunStatus.SUCCESS for r in drained)
    h.assert_table_equals_reference(warehouse, evs)
    # the table goes bad (a bug, a bad deploy ...): every count is off
    DeltaTable(f"{warehouse}/{ASSET}").update({"count": "count + 100"})
    assert len(h.table(warehouse)) == len(evs)

    runs = await asyncio.to_thread(backfill, home, env, f"{ASSET}_rebuild", keys,
                                   2 * PARTITIONS)
    rebuilds = [r for r in runs if r.job_name == f"{ASSET}_rebuild"]
    assert sorted(r.tags["dagster/partition"] for r in rebuilds) == keys
    assert all(r.status == DagsterRunStatus.SUCCESS for r in rebuilds), rebuilds
    h.assert_table_equals_reference(warehouse, evs)
    with DagsterInstance.from_config(str(home)) as instance:
        records = instance.fetch_materializations(AssetKey(ASSET), limit=100).records
        mats = [r.asset_materialization for r in records
                if r.run_id in {x.run_id for x in rebuilds}]
    assert len(mats) == PARTITIONS
    for m in mats:
        md = {k: v.value for k, v in m.metadata.items()}
        p = int(m.partition.split("-")[1])
        mine = sum(1 for k, _ in evs if h.partition_of(k) == p)
        assert md["mode"] == "rebuild" and md["status"] == "rebuilt" and md["rebuilt"] is True
        assert (md["rows_replaced"], md["rows_written"]) == (mine, mine), md
        # the origin history was read through the last message sourcing has passed (the work
        # queue is drained, so the origin's last one): a gap at a partition's tail is repaired
        assert md["origin_first_seq"] == 1 and md["messages_read"] == md["origin_last_seq"]
        assert md["origin_last_seq"] == len(evs)
        assert md["dagster/partition_row_count"] == mine
    await h.assert_work_queue_empty(js, stream)
