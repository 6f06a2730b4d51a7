"""Losing NATS mid-run: the engine retries with backoff, then fails with a clear error; it never
acknowledges what it did not commit, and a later run finishes the partition exactly once.

Each test runs its own nats-server (JetStream, temp store, loopback) so it can kill it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.js.api import StreamConfig

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.engine.options import EngineOptions
from cg_pipelines.engine.retry import NatsUnavailableError
from cg_pipelines.engine.runner import run_partition
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.connect import ConnectOptions, close_quietly
from cg_pipelines.local.nats_server import NatsServer
from cg_pipelines.sinks.delta import DeltaSink
from tests.support import keyed

OPTS = dict(batch_max_msgs=40, ack_wait_s=1.5, priority_timeout_s=1.5, hold_wait_s=6.0,
            timeout_s=1.0)


async def _connect(srv: NatsServer) -> Client:
    return await ConnectOptions(srv.url, reconnect_wait_s=0.2).connect()


async def _setup(srv: NatsServer, evs: list[tuple[str, int]]) -> None:
    nc = await _connect(srv)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="s", subjects=["s.>"]))
    await admin.create_elastic(js, "s", "g", ElasticConfig(
        1, (PartitioningFilter("s.*", (1,)),), members=("m1",)))
    await keyed.publish(js, "s", evs)
    api = JetStreamAPI.from_js(js)
    for _ in range(200):
        if (await api.stream_info("s-g"))["state"]["messages"] >= len(evs):
            break
        await asyncio.sleep(0.05)
    await api.close()
    await close_quietly(nc)


async def _wq_left(nc: Client) -> int:
    api = JetStreamAPI(nc)
    try:
        return int((await api.stream_info("s-g"))["state"]["messages"])
    finally:
        await api.close()


@pytest.fixture
def server(tmp_path: Path):
    srv = NatsServer(tmp_path / "store").start()
    yield srv
    srv.stop()


async def test_server_restart_mid_run_is_retried(server, tmp_path, report) -> None:
    """SIGKILL nats-server right after the second commit (before its purge and ack) and
    restart it on the same store 1 s later: the run retries, drains, and the table equals the
    reference with the work queue empty."""
    evs = keyed.events(7, 400)
    await _setup(server, evs)
    sink = DeltaSink(str(tmp_path / "t"))
    restarted = threading.Event()
    commits = {"n": 0}

    def hook(step: str, info: dict) -> None:
        if step == "committed":
            commits["n"] += 1
            if commits["n"] == 2:
                server.kill()
                threading.Thread(target=lambda: (time.sleep(1.0), server.start(),  # down 1 s
                                                 restarted.set())).start()

    nc = await _connect(server)
    try:
        r = await run_partition(nc, "s", "g", 0, keyed.processor(), sink,
                                EngineOptions(**OPTS), hook=hook)
        assert restarted.is_set()
        assert r.status == "drained", r
        assert r.nats_retries > 0
        assert keyed.mismatches(sink.read(), evs) is None
        assert await _wq_left(nc) == 0
    finally:
        await close_quietly(nc)
    report.append(f"engine, nats-server SIGKILLed after a commit and restarted: drained with "
           f"{r.nats_retries} NATS retries, 0 mismatches")


async def test_server_gone_fails_clearly_then_rerun_completes(server, tmp_path) -> None:
    """NATS killed at the second read and not back within ``nats_retry_max_s``: the run commits what
    it processed (local sink) but cannot purge or ack it, and fails with
    :class:`NatsUnavailableError` saying what to check, in bounded time. Nothing past the
    committed watermark left the work queue; after a restart the rerun skips the committed,
    unpurged batch and completes exactly once."""
    evs = keyed.events(5, 300)
    await _setup(server, evs)
    sink = DeltaSink(str(tmp_path / "t"))
    reads = {"n": 0}

    def hook(step: str, info: dict) -> None:
        if step == "read":
            reads["n"] += 1
            if reads["n"] == 2:
                server.kill()

    nc = await _connect(server)
    t0 = time.monotonic()
    try:
        with pytest.raises(NatsUnavailableError) as ei:
            await run_partition(nc, "s", "g", 0, keyed.processor(), sink,
                                EngineOptions(**OPTS, nats_retry_max_s=3.0), hook=hook)
    finally:
        await close_quietly(nc)  # closing while disconnected raises in nats-py
    elapsed = time.monotonic() - t0
    msg = str(ei.value)
    assert "partition 0 of s-g" in msg and f"127.0.0.1:{server.port}" in msg, msg
    assert "Check that nats-server is running" in msg and "rerun the partition" in msg, msg
    assert ei.value.attempts > 1
    assert elapsed < 20, elapsed  # bounded: nats_retry_max_s + one request timeout + backoff

    # The batches processed before the kill committed (the sink is local; the second one's
    # commit overlaps the first one's settle), but their purge and ack did not all happen.
    wm = sink.watermark("s/g/0")
    assert wm in (40, 80), wm
    server.start()
    nc = await _connect(server)
    try:
        left = await _wq_left(nc)
        assert len(evs) - wm <= left <= len(evs), (wm, left)  # nothing past the watermark gone
        r = await run_partition(nc, "s", "g", 0, keyed.processor(), sink, EngineOptions(**OPTS))
        assert r.status == "drained", r
        # a committed but unpurged batch is skipped, not processed again
        assert r.duplicates_skipped == (1 if left > len(evs) - wm else 0), (r, wm, left)
        assert keyed.mismatches(sink.read(), evs) is None
        assert await _wq_left(nc) == 0
    finally:
        await close_quietly(nc)


async def test_connected_client_outlives_a_long_outage(server) -> None:
    """A client from ConnectOptions (what `cg`, the Dagster resources and the engine use) keeps
    reconnecting through an outage longer than its first-connection attempts (which would
    close it after ~2 s at 0.5 s apart), and works again when the server is back."""
    nc = await ConnectOptions(servers=server.url).connect()
    try:
        server.kill()
        await asyncio.sleep(4.0)  # an outage longer than the first-connection attempts' ~2 s
        assert not nc.is_closed
        server.start()
        for _ in range(100):
            if nc.is_connected:
                break
            await asyncio.sleep(0.1)
        assert nc.is_connected
        api = JetStreamAPI(nc)
        try:
            info = await api.request("$JS.API.INFO", None)
            assert "streams" in info, info
        finally:
            await api.close()
    finally:
        await close_quietly(nc)


async def test_restart_that_needs_no_retry_is_not_a_handover(server, tmp_path) -> None:
    """Issue 16: the server restarts while a batch is processed and the client has reconnected
    before the run's next NATS step, so nothing is retried — but the restarted server forgot
    the pin. With no other instance holding the partition, the run re-pins and drains to the
    end (it used to stop early, reporting ``handed_over``)."""
    evs = keyed.events(7, 400)
    await _setup(server, evs)
    sink = DeltaSink(str(tmp_path / "t"))
    nc = await _connect(server)
    restarts = {"n": 0}

    def restart_once(table, ctx):
        if restarts["n"] == 0:
            restarts["n"] += 1
            before = nc.stats["reconnects"]
            server.kill()
            server.start()
            deadline = time.monotonic() + 20
            while nc.stats["reconnects"] == before or not nc.is_connected:
                assert time.monotonic() < deadline, "client did not reconnect"
                time.sleep(0.05)
        return keyed.transform(table, ctx)

    proc = keyed.processor()
    proc.transform = restart_once
    try:
        r = await run_partition(nc, "s", "g", 0, proc, sink, EngineOptions(**OPTS))
        assert restarts["n"] == 1
        assert r.status == "drained", r
        assert keyed.mismatches(sink.read(), evs) is None
        assert await _wq_left(nc) == 0
    finally:
        await close_quietly(nc)
