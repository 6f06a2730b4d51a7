"""Two Dagster deployments (two code locations, two instances) serve different members of one
elastic group: their sensors request disjoint partitions and their runs drain them into one
table. The membership changes while deployment A is still draining partition 1: B's membership
sensor asks for partition 1, B's run finds it held by A's run and commits nothing; once A's run
ends, B drains what arrived since. No range is committed twice (the table equals the
reference), and A never asks for partition 1 again."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pyarrow as pa
from dagster import DagsterInstance
from nats.js import JetStreamContext

from cg_pipelines.core.config import MemberMapping
from cg_pipelines.dagster import ConsumerGroupAsset, PartitionRunsResource, build_definitions
from cg_pipelines.engine.processing import ArrowProcessor
from cg_pipelines.engine.processor import BatchContext
from cg_pipelines.jetstream import admin
from cg_pipelines.local.nats_server import NatsServer
from tests.dagster import helpers as h
from tests.dagster.defs_keyed import (
    ASSET,
    BACKLOG_SENSOR,
    GROUP,
    JOB,
    MEMBERSHIP_SENSOR,
    PARTITIONS,
    make_resources,
    pkey,
)
from tests.support import keyed
from tests.support.wait import wait_for


def _deployment(stream: str, url: str, warehouse: str, member: str, slow: threading.Event,
                busy: threading.Event):
    def transform(table: pa.Table, ctx: BatchContext) -> pa.Table:
        if ctx.partition == 1 and slow.is_set():
            busy.set()  # this run holds partition 1's lease: it read a batch
            time.sleep(0.5)  # simulated work: A is still busy with partition 1 when the
            # membership changes (10 batches of 10 at 0.5 s each: ~5 s in all)
        return keyed.transform(table, ctx)

    spec = ConsumerGroupAsset(name=ASSET, stream=stream, group=GROUP, partitions=PARTITIONS,
                              processor=ArrowProcessor(keyed.DECODER, transform,
                                                       state=keyed.STATE))
    resources = make_resources(url, warehouse, members=[member])
    # (a new resource: model_copy of a Dagster resource keeps its original config)
    resources["partition_runs"] = PartitionRunsResource(
        members=[member], ack_wait_s=1.5, priority_timeout_s=1.5, hold_wait_s=1.0,
        batch_max_msgs=10, adaptive_max_msgs=None)
    return build_definitions([spec], resources=resources)


def _requested(data: h.SensorExecutionData) -> list[str]:
    return h.partitions_of(list(data.run_requests or []))


def _status(res) -> str:
    (mat,) = res.asset_materializations_for_node(ASSET)
    return mat.metadata["status"].value


async def test_two_deployments_one_group(js: JetStreamContext, nats_server: NatsServer,
                                         unique_name: str, tmp_path) -> None:
    stream, warehouse = unique_name, str(tmp_path / "wh")
    await h.create_group(js, stream, members=("m1", "m2"))  # m1: 0, 1; m2: 2, 3
    evs = h.events_on({0, 1, 2, 3}, n_keys=40, n_events=400)
    await h.publish(js, stream, evs, len(evs))
    slow, a_busy = threading.Event(), threading.Event()
    a = _deployment(stream, nats_server.url, warehouse, "m1", slow, a_busy)
    b = _deployment(stream, nats_server.url, warehouse, "m2", slow, threading.Event())
    with DagsterInstance.ephemeral() as ia, DagsterInstance.ephemeral() as ib:
        # disjoint: each deployment's sensors ask only for its member's partitions
        ta = await asyncio.to_thread(h.tick, a, MEMBERSHIP_SENSOR, ia)
        tb = await asyncio.to_thread(h.tick, b, MEMBERSHIP_SENSOR, ib)
        assert _requested(ta) == [pkey(0), pkey(1)] and _requested(tb) == [pkey(2), pkey(3)]
        ja, jb = a.resolve_job_def(JOB), b.resolve_job_def(JOB)
        for job, inst, p in ((ja, ia, 0), (jb, ib, 2), (jb, ib, 3)):
            res = await asyncio.to_thread(job.execute_in_process, partition_key=pkey(p),
                                          instance=inst)
            assert res.success and _status(res) == "drained"

        # A drains partition 1, slowly; meanwhile partition 1 moves to m2
        slow.set()
        run_a = asyncio.create_task(asyncio.to_thread(
            ja.execute_in_process, partition_key=pkey(1), instance=ia))
        # not a fixed delay: starting the run may take seconds on a loaded machine
        await wait_for(a_busy.is_set, 120, "A's run of partition 1 to lease it and process "
                       "its first batch", interval=0.05)
        await admin.set_member_mappings(js, stream, GROUP, (
            MemberMapping("m1", (0,)), MemberMapping("m2", (1, 2, 3))))
        tb2 = await asyncio.to_thread(h.tick, b, MEMBERSHIP_SENSOR, ib, cursor=tb.cursor)
        assert _requested(tb2) == [pkey(1)]
        held = await asyncio.to_thread(jb.execute_in_process, partition_key=pkey(1),
                                       instance=ib, raise_on_error=False)
        # A holds the lease: B's run processes nothing and is not a materialization (it
        # fails, naming the holder, and its sensor retries it after the backoff)
        assert not held.success
        assert not held.asset_materializations_for_node("keyed_events")
        failure = held.failure_data_for_node("keyed_events")
        assert failure is not None and failure.user_failure_data is not None
        assert "held by another instance (pinned client" in (
            failure.user_failure_data.description or "")
        assert not run_a.done()
        res_a = await run_a
        assert res_a.success and _status(res_a) == "drained"
        slow.clear()

        # new events of partition 1 arrive: B drains them; A no longer asks for partition 1
        more = [(k, n + 10_000) for k, n in evs if h.partition_of(k) == 1]
        await h.publish(js, stream, more, len(evs) + len(more))
        ta2 = await asyncio.to_thread(h.tick, a, BACKLOG_SENSOR, ia)
        assert pkey(1) not in _requested(ta2)
        tb3 = await asyncio.to_thread(h.tick, b, BACKLOG_SENSOR, ib)
        assert _requested(tb3) == [pkey(1)]
        res_b = await asyncio.to_thread(jb.execute_in_process, partition_key=pkey(1),
                                        instance=ib)
        assert res_b.success and _status(res_b) == "drained"

    h.assert_table_equals_reference(warehouse, evs + more)
    await h.assert_work_queue_empty(js, stream)
    # partition 1's commits, in log order, advance its watermark strictly: no range twice
    app_id = f"{stream}/{GROUP}/1"
    versions = []
    for path in sorted(Path(warehouse, ASSET, "_delta_log").glob("*.json")):
        for line in path.read_text().splitlines():
            txn = json.loads(line).get("txn")
            if txn and txn["appId"] == app_id:
                versions.append(txn["version"])
    assert versions == sorted(set(versions)) and len(versions) >= 2, versions
