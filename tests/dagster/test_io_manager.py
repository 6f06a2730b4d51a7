"""Downstream assets take a consumer-group asset as an input: the IO manager hands them the
Delta table as an Arrow table or a pandas DataFrame, only the loaded partitions' rows when the
downstream asset is partitioned alike; a value returned to it is refused."""

from __future__ import annotations

import asyncio

import pandas as pd
import pyarrow as pa
import pytest
from dagster import AssetIn, DagsterInstance, asset, materialize
from nats.js import JetStreamContext

from cg_pipelines.dagster import DeltaTableIOManager, DeltaWarehouseResource
from cg_pipelines.local.nats_server import NatsServer
from tests.dagster import helpers as h
from tests.dagster.defs_keyed import ASSET, group_definitions, make_resources, pkey


async def test_downstream_assets_read_the_table(js: JetStreamContext, nats_server: NatsServer,
                                                unique_name: str, warehouse: str,
                                                instance: DagsterInstance) -> None:
    stream = unique_name
    await h.create_group(js, stream)
    evs = h.events_on({0, 3}, n_keys=40, n_events=200)
    await h.publish(js, stream, evs, len(evs))
    group = group_definitions(stream).asset
    resources = make_resources(nats_server.url, warehouse)
    for p in (0, 3):
        res = await asyncio.to_thread(materialize, [group], partition_key=pkey(p),
                                      instance=instance, resources=resources)
        assert res.success
    seen: dict[str, object] = {}

    @asset(ins={"keyed_events": AssetIn(key=ASSET)})
    def whole(keyed_events: pa.Table) -> None:
        seen["whole"] = keyed_events

    @asset(ins={"keyed_events": AssetIn(key=ASSET)})
    def as_pandas(keyed_events: pd.DataFrame) -> None:
        seen["pandas"] = keyed_events

    @asset(ins={"keyed_events": AssetIn(key=ASSET)}, partitions_def=group.partitions_def)
    def per_partition(keyed_events: pa.Table) -> None:
        seen["partition"] = keyed_events

    for target, key in ((whole, None), (as_pandas, None), (per_partition, pkey(3))):
        res = await asyncio.to_thread(materialize, [group, target], selection=[target],
                                      partition_key=key, instance=instance,
                                      resources=resources)
        assert res.success
    table = seen["whole"]
    assert isinstance(table, pa.Table) and table.num_rows == len(evs)
    assert sorted(set(table["_partition"].to_pylist())) == [0, 3]
    frame = seen["pandas"]
    assert isinstance(frame, pd.DataFrame) and len(frame) == len(evs)
    part = seen["partition"]
    assert isinstance(part, pa.Table)
    assert set(part["_partition"].to_pylist()) == {3}
    assert part.num_rows == sum(1 for k, _ in evs if h.partition_of(k) == 3)


def test_the_io_manager_stores_nothing(tmp_path) -> None:
    io = DeltaTableIOManager(warehouse=DeltaWarehouseResource(root=str(tmp_path)))

    @asset(io_manager_key="cg_io_manager")
    def returns_a_value() -> int:
        return 1

    with pytest.raises(Exception, match="only loads consumer-group tables"):
        materialize([returns_a_value], resources={"cg_io_manager": io})
