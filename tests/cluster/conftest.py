"""Fixtures of the cluster tests: the library's ``nats_cluster`` (3 JetStream nodes on
loopback, one per session) and connections to it that survive a node's loss."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio
from nats.aio.client import Client
from nats.js import JetStreamContext

from cg_pipelines.jetstream.connect import ConnectOptions, close_quietly
from cg_pipelines.testing.cluster import NatsCluster


@pytest_asyncio.fixture(loop_scope="session")
async def cnc(nats_cluster: NatsCluster) -> AsyncIterator[Client]:
    """A client of the whole cluster (every node's URL; reconnects without end), after the
    cluster is healthy; the cluster is healthy again when the test ends."""
    await nats_cluster.wait_healthy()
    nc = await ConnectOptions(nats_cluster.url, name="cluster-test").connect()
    try:
        yield nc
    finally:
        await close_quietly(nc)
        for i in range(nats_cluster.size):
            if not nats_cluster.nodes[i].running:
                nats_cluster.restart(i)
        await nats_cluster.wait_healthy()


@pytest_asyncio.fixture(loop_scope="session")
async def cjs(cnc: Client) -> JetStreamContext:
    """A JetStream context on :func:`cnc`."""
    return cnc.jetstream(timeout=5)
