"""Merge mode through Dagster: ``ConsumerGroupAsset(write=Merge(...))`` materialized partition
by partition (real nats-server, real Delta), the materialization names the Delta versions it
wrote and each of them carries the run's lineage; a downstream asset gets the current table
in merge mode and the history in append mode."""

from __future__ import annotations

import asyncio

import pandas as pd
import pyarrow as pa
import pytest
from dagster import AssetIn, DagsterInstance, asset, materialize
from deltalake import DeltaTable
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from cg_pipelines import __version__
from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.core.errors import ConfigError
from cg_pipelines.core.subjects import partition_for
from cg_pipelines.core.write import Append, Merge
from cg_pipelines.dagster import ConsumerGroupAsset, build_group_definitions
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.local.nats_server import NatsServer
from tests.dagster.defs_keyed import make_resources
from tests.support import devices, keyed

PARTS = 2


def _spec(stream: str, name: str, group: str, merge: bool) -> ConsumerGroupAsset:
    return ConsumerGroupAsset(name=name, stream=stream, group=group, partitions=PARTS,
                              processor=devices.processor(),
                              write=devices.MERGE if merge else Append())


async def test_merge_asset_lineage_and_downstream_current_table(
        js: JetStreamContext, nats_server: NatsServer, unique_name: str, warehouse: str,
        instance: DagsterInstance) -> None:
    stream = unique_name
    evs = devices.events(400, 20, seed=31)
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    for group in ("m", "a"):
        await admin.create_elastic(js, stream, group, ElasticConfig(
            PARTS, (PartitioningFilter(f"{stream}.*", (1,)),), members=("m1",)))
    await devices.publish(js, stream, evs)
    api = JetStreamAPI.from_js(js)
    for _ in range(400):
        if min([int((await api.stream_info(f"{stream}-{g}"))["state"]["last_seq"])
                for g in ("m", "a")]) >= len(evs):
            break
        await asyncio.sleep(0.05)
    current = build_group_definitions(_spec(stream, "devices_now", "m", True)).asset
    history = build_group_definitions(_spec(stream, "devices_log", "a", False)).asset
    resources = make_resources(nats_server.url, warehouse)
    for p in range(PARTS):
        for group_asset, g in ((current, "m"), (history, "a")):
            res = await asyncio.to_thread(materialize, [group_asset], partition_key=f"{g}-{p}",
                                          instance=instance, resources=resources)
            assert res.success
            (mat,) = res.asset_materializations_for_node(group_asset.op.name)
            md = mat.metadata
            versions = md["table_versions"].value
            assert versions, md
            assert md["write_mode"].value == ("merge" if g == "m" else "append")
            table_uri = f"{warehouse}/{'devices_now' if g == 'm' else 'devices_log'}"
            hist = {h["version"]: h for h in DeltaTable(table_uri).history()}
            for v in versions:
                h = hist[v]
                assert h["cg.dagster_run_id"] == res.run_id
                assert (h["cg.stream"], h["cg.group"], h["cg.partition"]) == (stream, g, str(p))
                assert int(h["cg.first_seq"]) <= int(h["cg.last_seq"])
                assert h["cg.library_version"] == __version__
            assert int(hist[versions[-1]]["cg.last_seq"]) == md["watermark"].value
    seen: dict[str, object] = {}

    @asset(ins={"devices_now": AssetIn(key="devices_now")})
    def now(devices_now: pd.DataFrame) -> None:
        seen["now"] = devices_now

    @asset(ins={"devices_log": AssetIn(key="devices_log")})
    def log(devices_log: pa.Table) -> None:
        seen["log"] = devices_log

    for group_asset, target in ((current, now), (history, log)):
        res = await asyncio.to_thread(materialize, [group_asset, target], selection=[target],
                                      instance=instance, resources=resources)
        assert res.success
    assert devices.mismatches(pa.Table.from_pandas(seen["now"]), evs) is None
    log_table = seen["log"]
    assert isinstance(log_table, pa.Table) and log_table.num_rows == len(evs)  # the history
    assert {partition_for([d], PARTS) for d, _, _ in evs} == set(range(PARTS))


def test_merge_config_errors_name_the_reason() -> None:
    with pytest.raises(ConfigError, match="must be Append"):
        ConsumerGroupAsset(name="x", stream="s", group="g", partitions=2,
                           processor=devices.processor(), write="merge")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="KeyedState key 'key' must be the merge key"):
        ConsumerGroupAsset(name="x", stream="s", group="g", partitions=2,
                           processor=keyed.processor(), write=Merge(key="device"))
