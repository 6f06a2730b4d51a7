"""Runs over ranges of partitions from the backlog sensor (issue 51, ``notes/RANGE_RUNS.md``
§7): with ``PartitionRunsResource(partitions_per_run=D)`` a tick launches one run per aligned
block of D partitions with backlog (Dagster's range tags, no asset checks), each run drains its
partitions in one engine run, every partition gets its own materialization with its own
figures, and a block with a partition in a run waits."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from dagster import (
    AssetKey,
    AssetRecordsFilter,
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
)
from nats.js import JetStreamContext

from cg_pipelines.core.triggers import RetryPolicy
from cg_pipelines.dagster import PartitionRunsResource, build_definitions
from cg_pipelines.dagster.history import RANGE_TAG, partition_runs
from cg_pipelines.local.nats_server import NatsServer
from tests.dagster import helpers as h
from tests.dagster.defs_keyed import ASSET, BACKLOG_SENSOR, JOB, make_resources, pkey, spec

pytestmark = pytest.mark.integration

START, END = "dagster/asset_partition_range_start", "dagster/asset_partition_range_end"


def resources(url: str, warehouse: str, d: int) -> dict[str, Any]:
    res = make_resources(url, warehouse)
    res["partition_runs"] = PartitionRunsResource(
        ack_wait_s=1.5, priority_timeout_s=1.5, hold_wait_s=3, retry_backoff_s=1.0,
        retry_max_backoff_s=4.0, partitions_per_run=d)
    return res


def latest(instance: DagsterInstance, p: int) -> dict[str, Any]:
    recs = instance.fetch_materializations(
        AssetRecordsFilter(asset_key=AssetKey(ASSET), asset_partitions=[pkey(p)]), limit=1
    ).records
    assert len(recs) == 1 and recs[0].asset_materialization is not None
    return {k: v.value for k, v in recs[0].asset_materialization.metadata.items()}


async def test_the_sensor_launches_blocks_and_each_partition_keeps_its_figures(
        js: JetStreamContext, nats_server: NatsServer, unique_name: str, warehouse: str,
        instance: DagsterInstance) -> None:
    stream = unique_name
    await h.create_group(js, stream)
    defs = build_definitions([spec(stream)], resources=resources(nats_server.url, warehouse,
                                                                  4))
    evs = h.events_on({0, 1, 2, 3})
    await h.publish(js, stream, evs, len(evs))

    d1 = await asyncio.to_thread(h.tick, defs, BACKLOG_SENSOR, instance)
    (req,) = d1.run_requests
    assert (req.partition_key, req.tags[START], req.tags[END], req.tags[RANGE_TAG]) == \
        (None, "g-0", "g-3", "0-3")
    assert req.asset_check_keys == []  # a range run records no check (see the module doc)

    job = defs.resolve_job_def(JOB)
    # as the daemon launches the request: the job subset without checks (asset_check_keys=[])
    ranged = job.get_subset(asset_selection={AssetKey(ASSET)}, asset_check_selection=set())
    res = await asyncio.to_thread(ranged.execute_in_process, tags=req.tags, instance=instance)
    assert res.success
    h.assert_table_equals_reference(warehouse, evs)
    await h.assert_work_queue_empty(js, stream)
    for p in range(4):  # each partition's own figures on its own materialization
        md = latest(instance, p)
        mine = [e for e in evs if h.partition_of(e[0]) == p]
        assert (md["messages"], md["partition_status"]) == (len(mine), "drained"), md
        assert md["last_seq"] >= md["first_seq"] >= 1 and md["watermark"] == md["last_seq"]
        assert md["partitions"] == "0..3" and md["run_messages"] == len(evs)

    # the history counts the range run for each of its partitions
    hist = partition_runs(instance, {p: pkey(p) for p in range(4)}, "x", RetryPolicy())
    assert all(not r.in_progress and r.failures == 0 for r in hist.values())

    # new backlog on 1 and 2: one run over 1..2 (the block trimmed to its backlog)
    more = h.events_on({1, 2}, prefix="y")
    await h.publish(js, stream, more, len(evs) + len(more))
    d2 = await asyncio.to_thread(h.tick, defs, BACKLOG_SENSOR, instance, cursor=d1.cursor)
    (req,) = d2.run_requests
    assert (req.tags[START], req.tags[END]) == ("g-1", "g-2")

    # ... but while partition 3 is in another run, the block waits
    instance.add_run(DagsterRun(job_name=JOB, run_id="busy-3", status=DagsterRunStatus.STARTED,
                                tags={"dagster/partition": pkey(3)}))
    more3 = h.events_on({3}, prefix="z")
    await h.publish(js, stream, more3, len(evs) + len(more) + len(more3))
    d3 = await asyncio.to_thread(h.tick, defs, BACKLOG_SENSOR, instance)
    assert d3.run_requests == []
    # with D = 1 the same tick runs 1 and 2 alone (3 is in progress)
    one = await asyncio.to_thread(h.tick, defs, BACKLOG_SENSOR, instance,
                                  resources=resources(nats_server.url, warehouse, 1))
    assert sorted(r.partition_key for r in one.run_requests) == ["g-1", "g-2"]
    for r in one.run_requests:
        assert (await asyncio.to_thread(job.execute_in_process, partition_key=r.partition_key,
                                        tags=r.tags, instance=instance)).success
    h.assert_table_equals_reference(warehouse, [*evs, *more])  # 3's new backlog waits



def test_a_lost_range_run_is_failed_so_its_block_runs_again(instance: DagsterInstance) -> None:
    import socket

    from cg_pipelines.dagster.history import WORKER_TAG, fail_lost_runs, range_tags

    gone = f"{socket.gethostname()} 999999999 1"  # a pid that does not exist on this host
    instance.add_run(DagsterRun(job_name=JOB, run_id="lost-range", status=DagsterRunStatus.STARTED,
                                tags={**range_tags(0, 3), WORKER_TAG: gone}))
    instance.add_run(DagsterRun(job_name=JOB, run_id="other-range",
                                status=DagsterRunStatus.STARTED,
                                tags={**range_tags(4, 7), WORKER_TAG: gone}))
    # without key_of (the old call) range runs are not seen
    assert fail_lost_runs(instance, [pkey(2)]) == []
    lost = fail_lost_runs(instance, [pkey(2)], key_of=pkey)
    assert [run_id for run_id, _ in lost] == ["lost-range"]  # 4..7 does not hold g-2
    run = instance.get_run_by_id("lost-range")
    assert run is not None and run.status == DagsterRunStatus.FAILURE
    hist = partition_runs(instance, {p: pkey(p) for p in range(4)}, "x", RetryPolicy())
    assert all(not r.in_progress for r in hist.values())


async def test_the_sensor_picks_up_a_layout_set_in_nats(
        js: JetStreamContext, nats_server: NatsServer, unique_name: str, warehouse: str,
        instance: DagsterInstance) -> None:
    from cg_pipelines.jetstream.run_layout import RUNS_BUCKET, RunLayout, set_run_layout

    stream = unique_name
    await h.create_group(js, stream)
    evs = h.events_on({0, 1, 2, 3})
    await h.publish(js, stream, evs, len(evs))
    # the deployment says 1 (one run per partition) ...
    defs = build_definitions([spec(stream)], resources=make_resources(nats_server.url,
                                                                       warehouse))
    d1 = await asyncio.to_thread(h.tick, defs, BACKLOG_SENSOR, instance)
    assert sorted(r.partition_key for r in d1.run_requests) == ["g-0", "g-1", "g-2", "g-3"]
    # ... an operator sets 4 in NATS: the next tick launches one run over 0..3
    await set_run_layout(js, stream, "g", RunLayout(4))
    d2 = await asyncio.to_thread(h.tick, defs, BACKLOG_SENSOR, instance)
    (req,) = d2.run_requests
    assert req.tags["cg/partitions"] == "0-3"
    # a bad value stored by hand: the tick says why and launches nothing
    kv = await js.key_value(RUNS_BUCKET)
    await kv.put(f"{stream}.g", b'{"partitions_per_run": 0}')
    d3 = await asyncio.to_thread(h.tick, defs, BACKLOG_SENSOR, instance)
    assert d3.run_requests == [] and "partitions_per_run" in (d3.skip_message or "")
