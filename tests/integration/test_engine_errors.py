"""Error lines a user meets: a transform whose output breaks the output contract (a missing
state key column, a mistyped state column) fails the run in one line naming the column, with
nothing committed or acknowledged; a NatsResource that reaches no server names the servers as
``cg`` does."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.core.contract import OutputContractError
from cg_pipelines.dagster.resources import NatsResource
from cg_pipelines.engine.model import BatchContext
from cg_pipelines.engine.processing import ArrowProcessor
from cg_pipelines.engine.runner import EngineOptions, run_partition
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.connect import NatsConnectError
from cg_pipelines.sinks.delta import DeltaSink
from tests.support import keyed

FAST = EngineOptions(ack_wait_s=1.5, priority_timeout_s=1.5, hold_wait_s=3.0)


def drop_key(table: pa.Table, ctx: BatchContext) -> pa.Table:
    return keyed.transform(table, ctx).drop_columns(["key"])


def count_as_text(table: pa.Table, ctx: BatchContext) -> pa.Table:
    out = keyed.transform(table, ctx)
    i = out.schema.get_field_index("count")
    return out.set_column(i, "count", pc.cast(out["count"], pa.string()))


@pytest.mark.parametrize(("transform", "text"), [
    (drop_key, "missing state key column 'key' (KeyedState.key)"),
    (count_as_text, "state column 'count' is string, expected int64 (KeyedState.schema)"),
], ids=["missing-key", "mistyped-state"])
async def test_output_contract_violation_is_one_line(nc: Client, js: JetStreamContext,
                                                     unique_name: str, tmp_path: Path,
                                                     transform: object, text: str) -> None:
    stream = unique_name
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    await admin.create_elastic(js, stream, "g", ElasticConfig(
        1, (PartitioningFilter(f"{stream}.*", (1,)),), members=("m1",)))
    evs = keyed.events(4, 40)
    await keyed.publish(js, stream, evs)
    api = JetStreamAPI.from_js(js)
    for _ in range(200):
        if (await api.stream_info(f"{stream}-g"))["state"]["messages"] >= len(evs):
            break
        await asyncio.sleep(0.05)
    sink = DeltaSink(str(tmp_path / "t"))
    proc = ArrowProcessor(keyed.DECODER, transform, state=keyed.STATE)
    with pytest.raises(OutputContractError) as ei:
        await run_partition(nc, stream, "g", 0, proc, sink, FAST)
    msg = str(ei.value)
    assert "\n" not in msg, msg
    assert msg.startswith(f"transform output of partition 0 of {stream}-g (sequences 1..40): "), msg
    assert text in msg, msg
    assert sink.watermark(f"{stream}/g/0") == 0  # nothing committed
    assert (await api.stream_info(f"{stream}-g"))["state"]["messages"] == len(evs)  # nor acked


def test_nats_resource_unreachable_names_the_servers() -> None:
    res = NatsResource(servers="nats://127.0.0.1:1,nats://127.0.0.1:2", connect_timeout_s=0.5,
                       call_timeout_s=30)

    async def nothing(nc: Client) -> None:
        return None

    t0 = time.monotonic()
    with pytest.raises(NatsConnectError) as ei:
        res.run(nothing)
    msg = str(ei.value)
    assert msg.startswith("cannot connect to nats://127.0.0.1:1,nats://127.0.0.1:2: "), msg
    assert "\n" not in msg
    assert isinstance(ei.value, OSError)  # sensors and runs report it (TICK_ERRORS)
    assert time.monotonic() - t0 < 30
