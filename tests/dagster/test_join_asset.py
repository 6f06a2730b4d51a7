"""A co-partitioned set as one partitioned Dagster asset (issue 39): the backlog sensor requests
a run for each partition where ANY input has a backlog, each run drains partition p of every
input and commits once; metadata names each input's sequence range; the table equals the
independent pandas join; a set whose partition counts differ is refused with its reason."""

from __future__ import annotations

import asyncio
import json

import pytest
from dagster import DagsterInstance
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.core.errors import ConfigError
from cg_pipelines.dagster import CoPartitionedAsset, DeltaWarehouseResource, build_definitions
from cg_pipelines.engine.join import JoinInput
from cg_pipelines.jetstream import admin
from cg_pipelines.local.nats_server import NatsServer
from tests.dagster import helpers as h
from tests.dagster.defs_keyed import make_resources
from tests.support import joined

N = 3
NAME = "auctions"


def _key(p: int) -> str:
    return _spec("s").partition_key(p)


def _spec(stream: str, partitions: int = N) -> CoPartitionedAsset:
    return CoPartitionedAsset(name=NAME, inputs=joined.inputs(stream), partitions=partitions,
                              processor=joined.processor(), write=joined.WRITE)


async def test_sensor_runs_and_metadata(js: JetStreamContext, nats_server: NatsServer,
                                        unique_name: str, warehouse: str,
                                        instance: DagsterInstance) -> None:
    evs = joined.events(150)
    api = await joined.setup(js, unique_name, evs, n_partitions=N)
    defs = build_definitions([], joins=[_spec(unique_name)],
                             resources=make_resources(nats_server.url, warehouse))
    tick = await asyncio.to_thread(h.tick, defs, f"{NAME}_backlog", instance)
    assert sorted(h.partitions_of(tick.run_requests or [])) == [_key(p) for p in range(N)]
    lag = [e for e in tick.asset_events if e.partition == _key(0)]
    assert lag and lag[0].metadata["impressions/pending"].value > 0
    job = defs.resolve_job_def(f"{NAME}_job")
    for p in range(N):
        res = await asyncio.to_thread(job.execute_in_process, partition_key=_key(p),
                                      instance=instance)
        assert res.success
        (mat,) = res.asset_materializations_for_node(NAME)
        md = {k: v.value for k, v in mat.metadata.items()}
        assert md["status"] == "drained", md["detail"]
        for name in (joined.IMP, joined.CLK):
            assert md[f"{name}/stream"] == f"{unique_name}_{name}"
            assert 0 < md[f"{name}/first_seq"] <= md[f"{name}/last_seq"] == md[f"{name}/watermark"]
        assert md["messages"] == md["impressions/messages"] + md["clicks/messages"] > 0
        assert [x["input"] for x in md["lineage"]] == [joined.IMP, joined.CLK]
        checks = {c.check_name: c.passed for c in res.get_asset_check_evaluations()}
        # the run checks, per input where they are about an input (and the lag, which each
        # drain run evaluates)
        assert checks == {"backlog_drained": True, "no_unexplained_fence_conflicts": True,
                          **{f"{c}__{n}": True for c in ("no_new_dead_letters",
                                                         "lag_within_objective")
                             for n in (joined.IMP, joined.CLK)}}
    table = DeltaWarehouseResource(root=warehouse).sink(NAME).read()
    assert joined.mismatches(table, evs) is None
    assert await joined.left(api, unique_name) == 0
    # the rebuild job replays every input's origin history of a partition; same table
    rebuild = defs.resolve_job_def(f"{NAME}_rebuild")
    res = await asyncio.to_thread(rebuild.execute_in_process, partition_key=_key(1),
                                  instance=instance)
    assert res.success
    (mat,) = res.asset_materializations_for_node(NAME)
    assert (mat.metadata["status"].value, mat.metadata["mode"].value) == ("rebuilt", "rebuild")
    table = DeltaWarehouseResource(root=warehouse).sink(NAME).read()
    assert joined.mismatches(table, evs) is None
    # drained: the next tick requests nothing and says why
    again = await asyncio.to_thread(h.tick, defs, f"{NAME}_backlog", instance,
                                    cursor=tick.cursor)
    assert not again.run_requests
    # new messages on ONE input only: a run of that partition only
    s = f"{unique_name}_{joined.CLK}"
    await js.publish(f"{s}.a7", json.dumps({"auction": "a7"}).encode())
    await joined.wait_sourced(api, f"{s}-g", 1)
    third = await asyncio.to_thread(h.tick, defs, f"{NAME}_backlog", instance,
                                    cursor=again.cursor)
    assert len(third.run_requests or []) == 1


async def test_mismatched_set_is_refused(js: JetStreamContext, nats_server: NatsServer,
                                         unique_name: str, warehouse: str,
                                         instance: DagsterInstance) -> None:
    for name, n in ((joined.IMP, 4), (joined.CLK, 3)):
        s = f"{unique_name}_{name}"
        await js.add_stream(StreamConfig(name=s, subjects=[f"{s}.>"]))
        await admin.create_elastic(js, s, "g", ElasticConfig(
            n, (PartitioningFilter(f"{s}.*", (1,)),), members=("m1",)))
    defs = build_definitions([], joins=[_spec(unique_name, 4)],
                             resources=make_resources(nats_server.url, warehouse))
    tick = await asyncio.to_thread(h.tick, defs, f"{NAME}_backlog", instance)
    assert not tick.run_requests
    assert "4 partitions" in tick.skip_message and "3" in tick.skip_message, tick.skip_message
    assert f"{unique_name}_{joined.CLK}/g" in tick.skip_message
    job = defs.resolve_job_def(f"{NAME}_job")
    res = await asyncio.to_thread(job.execute_in_process, partition_key=_key(0),
                                  instance=instance, raise_on_error=False)
    assert not res.success


def test_declaration_errors() -> None:
    with pytest.raises(ConfigError, match="two or more inputs"):
        CoPartitionedAsset(name="x", inputs=[JoinInput("impressions", "a", "g")], partitions=2,
                           processor=joined.processor())
    with pytest.raises(ConfigError, match="not the processor's inputs"):
        CoPartitionedAsset(name="x", inputs=[JoinInput("impressions", "a", "g"),
                                             JoinInput("views", "b", "g")], partitions=2,
                           processor=joined.processor())
