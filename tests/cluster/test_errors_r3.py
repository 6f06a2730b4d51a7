"""Error text on a cluster: a partition run whose (R1) streams are offline because their only
server is down fails in one line naming the servers tried, the stream and the status it got,
and what to check — not "check that nats-server is running" while NATS is up."""

from __future__ import annotations

from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.engine.options import EngineOptions
from cg_pipelines.engine.retry import NatsUnavailableError
from cg_pipelines.engine.runner import run_partition
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.sinks.delta import DeltaSink
from cg_pipelines.testing.cluster import NatsCluster
from tests.cluster import checks
from tests.support import keyed


async def test_offline_stream_names_servers_stream_and_status(
        cnc: Client, cjs: JetStreamContext, nats_cluster: NatsCluster, tmp_path: Path) -> None:
    stream = "OffR1"
    await cjs.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"], num_replicas=1))
    await admin.create_elastic(cjs, stream, "g", ElasticConfig(
        1, (PartitioningFilter(f"{stream}.*", (1,)),), members=("m1",)))
    evs = keyed.events(3, 30)
    await keyed.publish(cjs, stream, evs)
    api = JetStreamAPI(cnc, timeout=2)
    await checks.wait_sourced(api, stream, len(evs))
    wq = f"{stream}-g"
    nats_cluster.kill(await nats_cluster.stream_leader(wq))  # its only replica
    with pytest.raises(NatsUnavailableError) as ei:
        await run_partition(cnc, stream, "g", 0, keyed.processor(),
                            DeltaSink(str(tmp_path / "t")),
                            EngineOptions(timeout_s=1.0, nats_retry_max_s=2.0, ack_wait_s=2.0,
                                          priority_timeout_s=2.0, hold_wait_s=2.0))
    msg = str(ei.value)
    assert "\n" not in msg, msg
    assert f"partition 0 of {wq}" in msg, msg
    assert f"but stream {wq} answered" in msg, msg
    assert "status 408" in msg or "status 503" in msg, msg
    for url in nats_cluster.urls:  # every server the client knows is named
        assert url.removeprefix("nats://") in msg, msg
    assert "the stream has no leader" in msg and f"nats stream info {wq}" in msg, msg
    assert "Check that nats-server is running" not in msg, msg
    assert "rerun the partition" in msg
    await api.close()
