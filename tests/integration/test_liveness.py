"""Run heartbeats on a real nats-server (cg_pipelines.jetstream.liveness): a live run's beat
is found, a stopped one's expires by its TTL on the server's clock, the stream stays bounded,
and the lease read tells a pinned partition from a free one."""

from __future__ import annotations

import asyncio
import time

import nats
from nats.aio.client import Client

from cg_pipelines.core.config import work_queue_stream_name
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.liveness import (
    LIVENESS_STREAM,
    RunHeartbeat,
    ensure_liveness_stream,
    publish_heartbeat,
    read_heartbeats,
    read_pins,
)
from cg_pipelines.local.nats_server import NatsServer


async def _wait_for(what: str, cond, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while True:
        got = await cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not after {timeout_s:g} s"
        await asyncio.sleep(0.2)


async def test_heartbeat_lives_while_the_block_runs_and_expires_after(
        nc: Client, nats_server: NatsServer, unique_name: str) -> None:
    api = JetStreamAPI(nc)
    run_id = f"run-{unique_name}"[:100].replace(".", "-")

    async def connect() -> Client:
        return await nats.connect(nats_server.url)

    assert (await read_heartbeats(api, [run_id]))[run_id] is False
    hb = RunHeartbeat(connect, run_id, ttl_s=3.0)
    await asyncio.to_thread(hb.__enter__)
    try:
        assert (await read_heartbeats(api, [run_id]))[run_id] is True
        # beats every ttl/3 = 1 s: a second beat arrives while the block runs
        await _wait_for("a second beat", lambda: asyncio.sleep(0, hb.beats >= 2), 10.0)
        info = await api.stream_info(LIVENESS_STREAM, subjects_filter=f"cg.liveness.{run_id}")
        assert info["state"]["subjects"] == {f"cg.liveness.{run_id}": 1}  # one a subject
    finally:
        await asyncio.to_thread(hb.__exit__, None, None, None)
    beats = hb.beats

    async def expired() -> bool:
        return (await read_heartbeats(api, [run_id]))[run_id] is False

    # the server deletes the last beat ttl_s (3 s) after it was published
    await _wait_for("the beat expired", expired, 15.0)
    assert hb.beats == beats  # nothing beats after the block
    await api.close()


async def test_a_first_beat_nats_does_not_take_is_reported_not_raised() -> None:
    attempts = []

    async def unreachable() -> Client:
        attempts.append(time.monotonic())
        return await nats.connect("nats://127.0.0.1:1", connect_timeout=0.5,
                                  max_reconnect_attempts=0, allow_reconnect=False)

    hb = RunHeartbeat(unreachable, "r1", ttl_s=3.0, timeout_s=1.0, first_beat_s=1.5)
    await asyncio.to_thread(hb.__enter__)
    await asyncio.to_thread(hb.__exit__, None, None, None)
    assert not hb.started and hb.beats == 0
    assert hb.error  # why, for the run's warning
    assert len(attempts) >= 2  # tried again within first_beat_s


async def test_a_published_beat_has_a_ttl(nc: Client, unique_name: str) -> None:
    api = JetStreamAPI(nc)
    run_id = f"ttl-{unique_name}"[:100].replace(".", "-")
    await ensure_liveness_stream(api)
    seq = await publish_heartbeat(nc, run_id, ttl_s=1.0)
    msg = await api.msg_get(LIVENESS_STREAM, seq=seq)
    assert msg is not None and (msg.headers or {}).get("Nats-TTL") == "1s"
    await api.close()


async def test_read_pins_tells_pinned_from_free(js, nc: Client, unique_name: str) -> None:
    from nats.js.api import StreamConfig

    from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
    from cg_pipelines.engine.lease import ensure_lease_consumer, lease_consumer_name
    from cg_pipelines.engine.options import EngineOptions
    from cg_pipelines.jetstream import admin

    stream = unique_name
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    await admin.create_elastic(js, stream, "g", ElasticConfig(
        2, (PartitioningFilter(f"{stream}.*", (1,)),), members=("m1",)))
    wq = work_queue_stream_name(stream, "g")
    api = JetStreamAPI(nc)
    opts = EngineOptions()
    for p in (0, 1):
        await ensure_lease_consumer(api, wq, p, opts)
    leases = [(wq, lease_consumer_name(0)), (wq, lease_consumer_name(1)), (wq, "nope")]
    assert await read_pins(api, leases) == dict.fromkeys(leases, False)
    # a message of partition 0 pulled in the priority group pins its lease (one ack pending)
    await js.publish(f"{stream}.k0", b"x")
    async def sourced() -> dict[str, int]:  # the work queue sources it asynchronously
        return (await api.stream_info(wq, subjects_filter=">"))["state"]["subjects"]

    counts = await _wait_for("the message sourced into the work queue", sourced, 10.0)
    p0 = int(next(iter(counts)).split(".", 1)[0])
    got = await api.pull(wq, lease_consumer_name(p0), batch=1, expires_s=5.0)
    assert got.messages and got.pin_id
    pins = await read_pins(api, leases)
    assert pins[(wq, lease_consumer_name(p0))] is True
    assert pins[(wq, lease_consumer_name(1 - p0))] is False
    await api.close()
