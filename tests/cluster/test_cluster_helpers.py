"""NatsCluster's own behaviour (what users' tests rely on): three named nodes with their own
stores and ports, kill -9 and restart on the same store, step-downs that move leadership, and a
stop that ends every process by PID even when one does not react to SIGTERM."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import nats
from nats.js.api import StreamConfig

from cg_pipelines.testing.cluster import NatsCluster


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes
        return f.read().split(") ")[1][0] != "Z"


async def test_nodes_kill_restart_step_down_and_stop(tmp_path: Path) -> None:
    cluster = NatsCluster(tmp_path / "c", stop_timeout_s=0.5)
    with cluster:
        assert len(set(cluster.urls)) == 3 and cluster.url == ",".join(cluster.urls)
        assert {n.store_dir.name for n in cluster.nodes} == {"n1", "n2", "n3"}
        assert cluster.meta_leader() is not None
        nc = await nats.connect(servers=cluster.urls, max_reconnect_attempts=-1,
                                reconnect_time_wait=0.1)
        js = nc.jetstream(timeout=5)
        await js.add_stream(StreamConfig(name="H", subjects=["h.>"], num_replicas=3))
        for i in range(20):
            await js.publish("h.x", str(i).encode())
        leader = await cluster.stream_leader("H")
        assert await cluster.step_down_stream("H") != leader
        meta = cluster.meta_leader()
        assert await cluster.step_down_meta() != meta
        killed = await cluster.kill_stream_leader("H")
        assert cluster.nodes[killed].pid is None and len(cluster.running()) == 2
        port = cluster.nodes[killed].port
        cluster.restart(killed)
        assert cluster.nodes[killed].port == port  # same address, same store
        await cluster.wait_healthy(60)
        info = await cluster.stream_info("H")
        assert info["state"]["messages"] == 20 and info["config"]["num_replicas"] == 3
        await nc.close()
        pids = [p for p in cluster.pids if p is not None]
        assert len(pids) == 3
        os.kill(pids[0], signal.SIGSTOP)  # deaf to SIGTERM until continued
        t0 = time.monotonic()
    # __exit__ stopped the cluster: SIGTERM, then SIGKILL by PID after stop_timeout_s
    assert not any(_alive(p) for p in pids)
    assert time.monotonic() - t0 < 30
    assert cluster.running() == []
