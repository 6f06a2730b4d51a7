"""Shared helpers of the Dagster tests: group setup on the session's nats-server, keyed events
on chosen partitions, Delta reads, sensor/schedule evaluation outside the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence

import pandas as pd
import pyarrow.compute as pc
from dagster import (
    DagsterInstance,
    Definitions,
    RunRequest,
    build_schedule_context,
    build_sensor_context,
)
from dagster._core.definitions.schedule_definition import ScheduleExecutionData
from dagster._core.definitions.sensor_definition import SensorExecutionData
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter, work_queue_stream_name
from cg_pipelines.core.subjects import partition_for
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.kv import Versioned
from cg_pipelines.sinks.delta import DeltaSink
from tests.dagster.defs_keyed import ASSET, GROUP, PARTITIONS
from tests.support import keyed

Event = tuple[str, int]


async def create_group(js: JetStreamContext, stream: str, members: Sequence[str] = ("m1",),
                       max_members: int = PARTITIONS) -> Versioned[ElasticConfig]:
    """Origin stream ``<stream>`` (subjects ``<stream>.>``) and elastic group ``g``
    partitioned on the key token."""
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    return await admin.create_elastic(js, stream, GROUP, ElasticConfig(
        max_members, (PartitioningFilter(f"{stream}.*", (1,)),), members=tuple(members)))


def partition_of(key: str) -> int:
    return partition_for([key], PARTITIONS)


def events_on(partitions: Collection[int], n_keys: int = 40, n_events: int = 400,
              prefix: str = "") -> list[Event]:
    """keyed.events restricted to keys of the given partitions (every event of a kept key is
    kept, so per-key sequences stay whole). ``prefix`` renames keys (fresh keys)."""
    evs = [(prefix + k, n) for k, n in keyed.events(n_keys, n_events)]
    out = [(k, n) for k, n in evs if partition_of(k) in partitions]
    assert {partition_of(k) for k, _ in out} == set(partitions), "widen n_keys"
    return out


def first_index(evs: Sequence[Event], partition: int) -> int:
    """0-based index of the first event of ``partition`` in ``evs``."""
    return next(i for i, (k, _) in enumerate(evs) if partition_of(k) == partition)


async def wait_sourced(js: JetStreamContext, stream: str, total: int) -> None:
    """Wait until the work-queue stream has received ``total`` messages since creation."""
    api = JetStreamAPI.from_js(js)
    wq = work_queue_stream_name(stream, GROUP)
    for _ in range(400):
        state = (await api.stream_info(wq))["state"]
        if int(state["last_seq"]) >= total:
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"{wq} did not receive {total} messages")


async def publish(js: JetStreamContext, stream: str, evs: list[Event], total: int) -> None:
    """Publish and wait until the work queue has ``total`` messages in all."""
    await keyed.publish(js, stream, evs)
    await wait_sourced(js, stream, total)


def table(warehouse_root: str, keys: Collection[str] | None = None) -> pd.DataFrame:
    """The asset's Delta table (rows of ``keys`` only if given), as keyed.table_frame; no
    rows if the table does not exist."""
    sink = DeltaSink(f"{warehouse_root}/{ASSET}", schema=keyed.OUT_SCHEMA)
    flt = None if keys is None else pc.field("key").isin(sorted(keys))
    return keyed.table_frame(sink.read(filter=flt))


def assert_table_equals_reference(warehouse_root: str, evs: list[Event]) -> None:
    keys = {k for k, _ in evs}
    got = table(warehouse_root, keys)
    want = keyed.reference(evs)
    pd.testing.assert_frame_equal(got, want, check_dtype=False)


def tick(defs: Definitions, sensor_name: str, instance: DagsterInstance, *,
         cursor: str | None = None, resources: dict[str, object] | None = None
         ) -> SensorExecutionData:
    """One sensor tick as the daemon evaluates it (sync: resources call asyncio.run).
    ``resources`` default to the definitions' own."""
    with build_sensor_context(instance=instance, cursor=cursor, definitions=defs,
                              resources=dict(defs.resources or {}) if resources is None
                              else resources) as ctx:
        return defs.resolve_sensor_def(sensor_name).evaluate_tick(ctx)


def schedule_tick(defs: Definitions, schedule_name: str, instance: DagsterInstance
                  ) -> ScheduleExecutionData:
    """One schedule evaluation with the definitions' resources (sync, like :func:`tick`)."""
    with build_schedule_context(instance=instance, resources=dict(defs.resources or {}),
                                repository_def=defs.get_repository_def()) as ctx:
        return defs.resolve_schedule_def(schedule_name).evaluate_tick(ctx)


def partitions_of(requests: Sequence[RunRequest]) -> list[str]:
    return [r.partition_key for r in requests if r.partition_key is not None]


async def work_queue_messages(js: JetStreamContext, stream: str) -> int:
    info = await JetStreamAPI.from_js(js).stream_info(work_queue_stream_name(stream, GROUP))
    return int(info["state"]["messages"])


async def assert_work_queue_empty(js: JetStreamContext, stream: str) -> None:
    assert await work_queue_messages(js, stream) == 0
