"""A failed partition run gives its partition back on the way out (issue 19, point 2).

With the default ack wait and pin timeout (30 s each), a run that failed and kept its pin and
lease would leave an immediate retry ``held`` for half a minute. Here the retry starts at once
and drains, the error names what was in flight and what was committed, and the table equals
the reference.
"""

from __future__ import annotations

import asyncio

import pyarrow as pa
import pytest
from nats.js.api import StreamConfig

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.core.errors import PartitionRunError
from cg_pipelines.engine.options import EngineOptions
from cg_pipelines.engine.processing import ArrowProcessor
from cg_pipelines.engine.processor import BatchContext
from cg_pipelines.engine.runner import run_partition
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.sinks.delta import DeltaSink
from tests.support import keyed

# Production defaults for the lease: a pin or lease kept after a failure would hold the
# partition for 30 s, far longer than the retry below waits.
DEFAULTS = dict(ack_wait_s=30.0, priority_timeout_s=30.0, hold_wait_s=2.0)


class Boom(RuntimeError):
    pass


def failing_processor(fail_after_batches: int) -> ArrowProcessor:
    """The keyed pipeline whose transform raises in its ``fail_after_batches + 1``-th batch."""
    calls = {"n": 0}

    def transform(table: pa.Table, ctx: BatchContext) -> pa.Table:
        calls["n"] += 1
        if calls["n"] > fail_after_batches:
            raise Boom(f"transform failed on {ctx.first_seq}..{ctx.last_seq}")
        return keyed.transform(table, ctx)

    return ArrowProcessor(keyed.DECODER, transform, state=keyed.STATE)


async def _setup(js, stream: str, evs: list[tuple[str, int]]) -> JetStreamAPI:
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    await admin.create_elastic(js, stream, "g", ElasticConfig(
        1, (PartitioningFilter(f"{stream}.*", (1,)),), members=("m1",)))
    await keyed.publish(js, stream, evs)
    api = JetStreamAPI.from_js(js)
    for _ in range(200):
        if (await api.stream_info(f"{stream}-g"))["state"]["messages"] >= len(evs):
            return api
        await asyncio.sleep(0.05)
    raise AssertionError("work queue not filled")


@pytest.mark.parametrize("fail_after_batches", [0, 2])
async def test_failed_run_gives_partition_back(nc, js, unique_name, tmp_path,
                                               fail_after_batches: int) -> None:
    stream = unique_name
    evs = keyed.events(n_keys=11, n_events=400)
    api = await _setup(js, stream, evs)
    sink = DeltaSink(str(tmp_path / "t"))
    opts = EngineOptions(batch_max_msgs=50, **DEFAULTS)

    with pytest.raises(Boom) as failed:
        await run_partition(nc, stream, "g", 0, failing_processor(fail_after_batches), sink,
                            opts)
    # The original exception, unchanged, with the run's facts attached as a typed error.
    err = PartitionRunError.of(failed.value)
    assert err is not None and err.cause is failed.value and err.__cause__ is failed.value
    assert err.partition == 0 and err.read_stream == f"{stream}-g"
    committed = sink.watermark(f"{stream}/g/0") if sink.exists() else 0
    assert err.committed_through == committed and err.acknowledged_through <= committed
    assert (err.commits > 0) == (committed > 0)
    assert err.inflight is not None and err.inflight[0] > committed
    assert (committed > 0) == (fail_after_batches > 0)
    cause, facts = str(err).split("\n")
    assert cause == f"Boom: {failed.value}"  # the cause first
    assert facts.startswith(f"partition 0 of {stream}-g: run failed with sequences "
                            f"{err.inflight[0]}..{err.inflight[1]} in flight; committed "
                            f"through sequence {committed}, acknowledged through "), facts
    assert "nothing later was committed or acknowledged" in facts
    assert not getattr(failed.value, "__notes__", None)  # no text note to parse any more

    # Nobody pinned (the lease was nak'ed: the server delivers it again to the next pull).
    info = await api.consumer_info(f"{stream}-g", "partition-0")
    assert not any(g.get("pinned_client_id") for g in info.get("priority_groups") or []), info

    # At once: a kept pin or lease would make this run "held" (it waits only hold_wait_s).
    retry = await run_partition(nc, stream, "g", 0, keyed.processor(), sink, opts)
    assert retry.status == "drained", (retry.status, retry.detail)
    # One partition: work-queue sequences are 1..len(evs), so the retry processes exactly
    # the messages the failed run did not commit.
    assert retry.processed == len(evs) - committed
    assert keyed.mismatches(sink.read(), evs) is None
    assert (await api.stream_info(f"{stream}-g"))["state"]["messages"] == 0


async def test_held_names_the_holder(nc, js, unique_name, tmp_path) -> None:
    """A run that finds a live holder reports ``held`` and names it; it processes nothing."""
    stream = unique_name
    evs = keyed.events(n_keys=3, n_events=20)
    api = await _setup(js, stream, evs)
    sink = DeltaSink(str(tmp_path / "t"))
    opts = EngineOptions(**DEFAULTS)
    started = asyncio.Event()
    release = asyncio.Event()

    def slow(table: pa.Table, ctx: BatchContext) -> pa.Table:
        loop.call_soon_threadsafe(started.set)
        asyncio.run_coroutine_threadsafe(release.wait(), loop).result(timeout=60)
        return keyed.transform(table, ctx)

    loop = asyncio.get_running_loop()
    holder = asyncio.create_task(run_partition(
        nc, stream, "g", 0, ArrowProcessor(keyed.DECODER, slow, state=keyed.STATE), sink, opts))
    await asyncio.wait_for(started.wait(), 30)
    second = await run_partition(nc, stream, "g", 0, keyed.processor(), sink, opts)
    release.set()
    first = await holder
    assert second.status == "held" and second.processed == 0
    assert "held by another instance (pinned client " in second.detail
    assert "nothing processed" in second.detail
    assert first.status == "drained" and first.processed == len(evs)
    assert keyed.mismatches(sink.read(), evs) is None
    assert (await api.stream_info(f"{stream}-g"))["state"]["messages"] == 0
