"""The Dagster integration on Iceberg: a group asset whose warehouse is an
:class:`IcebergWarehouseResource` commits its partitions to an Iceberg table (table metadata in
the materialization), and ``build_definitions`` gives downstream assets the Iceberg IO
manager: the history in append mode, each key's current row in merge mode, only the loaded
partitions' rows for a downstream asset partitioned alike. Compared with the pandas
references."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pandas as pd
import pyarrow as pa
import pytest
from dagster import AssetIn, DagsterInstance, asset, materialize
from nats.js import JetStreamContext

from cg_pipelines.dagster import (
    ConsumerGroupAsset,
    NatsResource,
    build_definitions,
    build_group_definitions,
)
from cg_pipelines.dagster.iceberg import IcebergTableIOManager, IcebergWarehouseResource
from cg_pipelines.local.nats_server import NatsServer
from tests.dagster import helpers as h
from tests.dagster.defs_keyed import ASSET, GROUP, PARTITIONS, partition_runs, pkey
from tests.support import devices, keyed


@pytest.fixture
def instance() -> Iterator[DagsterInstance]:
    with DagsterInstance.ephemeral() as inst:
        yield inst


def _defs(spec: ConsumerGroupAsset, url: str, warehouse: IcebergWarehouseResource):
    return build_definitions([spec], resources={
        "nats": NatsResource(servers=url), "warehouse": warehouse,
        "partition_runs": partition_runs()})


async def test_append_group_on_iceberg_and_downstream_reads(
        js: JetStreamContext, nats_server: NatsServer, unique_name: str, tmp_path,
        instance: DagsterInstance) -> None:
    stream = unique_name
    await h.create_group(js, stream)
    evs = h.events_on({0, 3}, n_keys=40, n_events=200)
    await h.publish(js, stream, evs, len(evs))
    wh = IcebergWarehouseResource(warehouse=str(tmp_path / "lake"))
    spec = ConsumerGroupAsset(name=ASSET, stream=stream, group=GROUP, partitions=PARTITIONS,
                              processor=keyed.processor())
    defs = _defs(spec, nats_server.url, wh)
    resources = defs.resources
    assert isinstance(resources["cg_io_manager"], IcebergTableIOManager)
    (asset_spec,) = [a for a in defs.resolve_all_asset_specs() if a.key.to_user_string() == ASSET]
    assert asset_spec.kinds == {"nats", "iceberg"}  # the asset's kind names no Delta either
    group = build_group_definitions(spec).asset
    written: dict[int, list[int]] = {}
    for p in (0, 3):
        res = await asyncio.to_thread(materialize, [group], partition_key=pkey(p),
                                      instance=instance, resources=resources)
        assert res.success
        md = res.asset_materializations_for_node(ASSET)[0].metadata
        assert md["dagster/uri"].value.startswith("file://")
        assert md["dagster/partition_row_count"].value == sum(
            1 for k, _ in evs if h.partition_of(k) == p)
        # The asset op speaks the table contract: no key names Delta on an Iceberg path.
        assert not [k for k in md if "delta" in k.lower()], sorted(md)
        assert md["dagster/storage_kind"].value == "iceberg"
        assert md["table_version"].value >= 1
        written[p] = list(md["table_versions"].value)
        assert written[p]
    snapshots = {s["snapshot_id"] for s in wh.sink(ASSET).history()}
    assert {v for vs in written.values() for v in vs} <= snapshots
    seen: dict[str, object] = {}

    @asset(ins={"keyed_events": AssetIn(key=ASSET)})
    def whole(keyed_events: pd.DataFrame) -> None:
        seen["whole"] = keyed_events

    @asset(ins={"keyed_events": AssetIn(key=ASSET)}, partitions_def=group.partitions_def)
    def per_partition(keyed_events: pa.Table) -> None:
        seen["partition"] = keyed_events

    for target, key in ((whole, None), (per_partition, pkey(3))):
        res = await asyncio.to_thread(materialize, [group, target], selection=[target],
                                      partition_key=key, instance=instance,
                                      resources=resources)
        assert res.success
    frame = seen["whole"]
    assert isinstance(frame, pd.DataFrame)
    assert keyed.mismatches(pa.Table.from_pandas(frame), evs) is None
    part = seen["partition"]
    assert isinstance(part, pa.Table) and set(part["_partition"].to_pylist()) == {3}
    sink = wh.sink(ASSET)
    assert sink.history()[-1]["cg.dagster_run_id"]


async def test_merge_group_on_iceberg_downstream_gets_current_rows(
        js: JetStreamContext, nats_server: NatsServer, unique_name: str, tmp_path,
        instance: DagsterInstance) -> None:
    stream = unique_name
    await h.create_group(js, stream)
    evs = devices.events(300, 30, seed=3, p_del=0.25)
    await devices.publish(js, stream, evs)
    await h.wait_sourced(js, stream, len(evs))  # else a run may find its partition empty
    wh = IcebergWarehouseResource(warehouse=str(tmp_path / "lake"), namespace="ops")
    spec = ConsumerGroupAsset(name="devices", stream=stream, group=GROUP,
                              partitions=PARTITIONS, processor=devices.processor(),
                              write=devices.MERGE)
    defs = _defs(spec, nats_server.url, wh)
    group = build_group_definitions(spec).asset
    for p in range(PARTITIONS):
        res = await asyncio.to_thread(materialize, [group], partition_key=pkey(p),
                                      instance=instance, resources=defs.resources)
        assert res.success
        md = res.asset_materializations_for_node("devices")[0].metadata
        assert md["status"].value == "drained", md["status"]
    await h.assert_work_queue_empty(js, stream)
    seen: dict[str, object] = {}

    @asset(ins={"devices": AssetIn(key="devices")})
    def current(devices: pa.Table) -> None:
        seen["t"] = devices

    res = await asyncio.to_thread(materialize, [group, current], selection=[current],
                                  instance=instance, resources=defs.resources)
    assert res.success
    history = [(h["operation"], h.get("cg.partition"), h.get("cg.operation"),
                h.get("added-records"), h.get("deleted-records"), h.get("total-records"))
               for h in wh.sink("devices").history()]
    assert devices.mismatches(seen["t"], evs) is None, history
    assert wh.sink("devices").identifier == "ops.devices"


def test_resource_configuration_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="catalog_uri is required"):
        IcebergWarehouseResource(warehouse="s3://b/p").catalog_properties()
    with pytest.raises(ValueError, match="catalog_type"):
        IcebergWarehouseResource(warehouse=str(tmp_path), catalog_type="hive").catalog()
    rest = IcebergWarehouseResource(warehouse="s3://b/p", catalog_type="rest",
                                    catalog_uri="http://127.0.0.1:1", rest_token="t0k",
                                    s3_endpoint="http://127.0.0.1:2", aws_access_key_id="a",
                                    aws_secret_access_key="s3cret", allow_http=True)
    props = rest.catalog_properties()
    assert props["type"] == "rest" and props["token"] == "t0k"
    assert props["s3.endpoint"] == "http://127.0.0.1:2" and props["s3.secret-access-key"]
