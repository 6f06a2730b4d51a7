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
from cg_pipelines.engine.options import EngineOptions
from cg_pipelines.engine.processing import ArrowProcessor
from cg_pipelines.engine.processor import BatchContext
from cg_pipelines.engine.runner import run_partition
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


def _fail_long(table: pa.Table, ctx: BatchContext) -> pa.Table:
    raise ValueError("amount feed under investigation: " + "x" * 3000)


async def test_dagster_failure_starts_with_the_cause(js: JetStreamContext, nats_url: str,
                                                     unique_name: str, tmp_path: Path) -> None:
    """The run's Failure: the cause first (type and message, cut at CAUSE_CHARS), then the
    partition facts once; metadata holds the facts as fields; the cause's traceback is the
    transform's own frames (no event loop, no engine)."""
    from dagster import DagsterEventType, DagsterInstance, materialize

    from cg_pipelines.core.errors import CAUSE_CHARS
    from cg_pipelines.dagster import (
        ConsumerGroupAsset,
        DeltaTableIOManager,
        DeltaWarehouseResource,
        PartitionRunsResource,
        build_group_definitions,
    )

    stream = unique_name
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    await admin.create_elastic(js, stream, "g", ElasticConfig(
        1, (PartitioningFilter(f"{stream}.*", (1,)),), members=("m1",)))
    await keyed.publish(js, stream, keyed.events(4, 40))
    for _ in range(200):  # sourcing into the work queue is asynchronous: the run must find them
        if (await js.stream_info(f"{stream}-g")).state.messages == 40:
            break
        await asyncio.sleep(0.05)
    spec = ConsumerGroupAsset(name="orders", stream=stream, group="g", partitions=1,
                              processor=ArrowProcessor(keyed.DECODER, _fail_long,
                                                       state=keyed.STATE))
    asset = build_group_definitions(spec).asset
    warehouse = DeltaWarehouseResource(root=str(tmp_path / "wh"))
    resources = {"nats": NatsResource(servers=nats_url), "warehouse": warehouse,
                 "cg_io_manager": DeltaTableIOManager(warehouse=warehouse),
                 "partition_runs": PartitionRunsResource(ack_wait_s=1.5, priority_timeout_s=1.5,
                                                         hold_wait_s=3)}
    with DagsterInstance.ephemeral() as instance:
        res = await asyncio.to_thread(lambda: materialize(
            [asset], partition_key="g-0", instance=instance, resources=resources,
            raise_on_error=False))
        assert not res.success
        failure = res.failure_data_for_node("orders")
        assert failure is not None and failure.user_failure_data is not None
        description = failure.user_failure_data.description or ""
        cause, facts = description.split("\n")
        assert cause.startswith("ValueError: amount feed under investigation: xxx"), cause
        assert len(cause) == CAUSE_CHARS and cause.endswith("…"), len(cause)
        assert facts.startswith(f"partition 0 of {stream}-g: run failed with sequences "
                                "1..40 in flight; committed through sequence 0, acknowledged "
                                "through none (0 commit(s) by this run)"), facts
        md = {k: v.value for k, v in failure.user_failure_data.metadata.items()}
        assert md["partition"] == 0 and md["cause_type"] == "ValueError"
        assert md["inflight_first_seq"] == 1 and md["inflight_last_seq"] == 40
        assert md["committed_through"] == 0 and md["acknowledged_through"] == 0
        # The cause's stack is the transform alone.
        err = failure.error
        assert err is not None and err.cause is not None
        frames = [ln for ln in err.cause.stack if ln.lstrip().startswith("File ")]
        assert len(frames) == 1 and "test_engine_errors.py" in frames[0], err.cause.stack
        # The partition facts appear once per failure event, not again in a note.
        logs = instance.all_logs(res.run_id, of_type=DagsterEventType.STEP_FAILURE)
        text = logs[0].dagster_event.event_specific_data.error.to_string()
        assert text.count("in flight") == 1, text
