"""The ``origin_reconciled`` asset check (cg_pipelines.dagster.checks) against a real group:
passes when every origin message reached the work queue, fails naming the origin range, the
partitions and the rebuild job when messages were removed from the work queue unprocessed."""

from __future__ import annotations

import asyncio

from dagster import (
    AssetCheckSeverity,
    AssetSelection,
    DagsterInstance,
    Definitions,
    define_asset_job,
)
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.dagster import DeltaWarehouseResource, NatsResource
from cg_pipelines.dagster.checks import (
    RECONCILE_CHECK,
    build_reconcile_check,
    reconcile_evaluation,
)
from cg_pipelines.engine.options import EngineOptions
from cg_pipelines.engine.rebuild import rebuild_partition
from cg_pipelines.engine.runner import run_partition
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.local.nats_server import NatsServer
from tests.dagster import helpers as h
from tests.dagster.defs_keyed import (
    GROUP,
    PARTITIONS,
    group_definitions,
    make_resources,
    spec,
)
from tests.support import keyed

FAST = EngineOptions(ack_wait_s=1.5, priority_timeout_s=1.5, hold_wait_s=3.0)


async def test_reconcile_check_fails_on_a_gap_then_passes(
        nc: Client, js: JetStreamContext, nats_server: NatsServer, unique_name: str,
        warehouse: str, instance: DagsterInstance) -> None:
    stream = unique_name
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"], allow_direct=True))
    await admin.create_elastic(js, stream, GROUP, ElasticConfig(
        PARTITIONS, (PartitioningFilter(f"{stream}.*", (1,)),), members=("m1",)))
    evs = keyed.events(n_keys=20, n_events=200)
    await h.publish(js, stream, evs, len(evs))
    nats = NatsResource(servers=nats_server.url)
    wh = DeltaWarehouseResource(root=warehouse)
    group = spec(stream)
    sink = wh.sink(group.table_name)

    async def drain() -> None:
        for p in range(PARTITIONS):
            r = await run_partition(nc, stream, GROUP, p, keyed.processor(), sink, FAST)
            assert r.status in ("drained", "empty"), r

    check = build_reconcile_check(group, seq_column="seq")
    defs = Definitions(assets=[group_definitions(stream).asset], asset_checks=[check],
                       jobs=[define_asset_job("reconcile", AssetSelection.checks(check))],
                       resources={**make_resources(nats_server.url, warehouse), "nats": nats,
                                  "warehouse": wh})
    job = defs.resolve_job_def("reconcile")

    def evaluate() -> object:
        res = job.execute_in_process(instance=instance)
        assert res.success
        (ev,) = res.get_asset_check_evaluations()
        assert ev.check_name == RECONCILE_CHECK
        return ev

    await drain()
    ok = await asyncio.to_thread(evaluate)
    assert ok.passed, ok.description
    assert ok.metadata["in_table"].value == len(evs)

    # messages removed from the work queue unprocessed: origin sequences 201..205
    more = [(f"new{i}", i) for i in range(10)]
    await h.publish(js, stream, more, len(evs) + len(more))
    api = JetStreamAPI.from_js(js)
    for seq in range(201, 206):
        assert await api.delete_msg(f"{stream}-{GROUP}", seq)
    await drain()
    parts = sorted({h.partition_of(k) for k, _ in more[:5]})
    bad = await asyncio.to_thread(evaluate)
    assert not bad.passed and bad.severity == AssetCheckSeverity.ERROR
    assert "origin sequences 201..205 (5 messages, partition" in bad.description, bad.description
    assert f"run the keyed_events_rebuild job for partition(s) " \
           f"{', '.join(f'{GROUP}-{p}' for p in parts)}" in bad.description
    assert bad.metadata["missing"].value == 5
    # the same for a sensor: an evaluation to emit, a skip reason
    # (the cursor goes on after 210: the open gap is still reported, until repaired)
    ev = await asyncio.to_thread(reconcile_evaluation, group, nats, wh, seq_column="seq")
    assert not ev.passed and ev.severity == AssetCheckSeverity.ERROR
    assert "origin sequences 201..205 (5 messages, partition" in ev.description
    # inside a running event loop too (no asyncio.run there)
    again = reconcile_evaluation(group, nats, wh)
    assert again.description == ev.description
    # repaired: the rebuild's coverage closes the gap, the check passes again
    for p in parts:
        r = await rebuild_partition(nc, stream, GROUP, p, keyed.processor(), sink, FAST)
        assert r.status == "rebuilt", r
    fixed = await asyncio.to_thread(evaluate)
    assert fixed.passed, fixed.description
    # a stalled source is a warning with its own advice, never a gap, and clears by itself
    wq = f"{stream}-{GROUP}"
    config = (await api.stream_info(wq))["config"]
    await api.update_stream({**config, "sources": []})
    late = [(f"late{i}", i) for i in range(6)]
    await keyed.publish(js, stream, late)
    stalled = await asyncio.to_thread(evaluate)
    assert not stalled.passed and stalled.severity == AssetCheckSeverity.WARN
    assert "sourcing stopped since" in stalled.description, stalled.description
    assert "never reached" not in stalled.description
    assert stalled.metadata["missing"].value == 0
    await api.update_stream(config)
    for _ in range(200):
        if (await api.stream_info(wq))["state"]["last_seq"] >= len(evs) + len(more) + 6:
            break
        await asyncio.sleep(0.05)
    resumed = await asyncio.to_thread(evaluate)
    assert resumed.passed, resumed.description
