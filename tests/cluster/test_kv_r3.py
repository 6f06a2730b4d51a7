"""Group configs on a cluster while the KV bucket's stream has no leader (a bucket just made,
whose replicas are still electing one; a killed leader being replaced): a create, read and
update wait for the new leader instead of failing with "no response from stream"; nothing is
written twice."""

from __future__ import annotations

import asyncio
import time

from nats.aio.client import Client
from nats.js import JetStreamContext

from cg_pipelines.core.config import (
    ELASTIC_BUCKET,
    ElasticConfig,
    PartitioningFilter,
    with_members,
)
from cg_pipelines.jetstream.kv import ConfigStore
from cg_pipelines.testing.cluster import NatsCluster
from tests.cluster import checks


async def test_config_writes_wait_for_a_new_kv_leader(
        cnc: Client, cjs: JetStreamContext, nats_cluster: NatsCluster) -> None:
    await checks.create_r3_group(cjs, "KvR3", 2)  # the bucket exists, R3
    kv_stream = f"KV_{ELASTIC_BUCKET}"
    leader = await nats_cluster.stream_leader(kv_stream)
    if nats_cluster.meta_leader() == leader:  # keep the API's meta leader out of it
        await nats_cluster.step_down_meta()
    cfg = ElasticConfig(2, (PartitioningFilter("KvR3.*", (1,)),), members=("m1",))
    store: ConfigStore[ElasticConfig] = ConfigStore(cjs, "elastic", timeout=2)

    nats_cluster.kill(leader)  # the other two elect a new leader after the raft timeout
    t = time.monotonic()
    created = await store.create("KvR3", "late", cfg, replicas=3)
    waited = time.monotonic() - t
    new_leader = await nats_cluster.stream_leader(kv_stream)
    assert new_leader != leader
    assert waited > 0.2, waited  # it did meet the leaderless window (not a no-op)
    got = await store.get("KvR3", "late")
    assert (got.config, got.revision) == (cfg, created.revision)
    moved = await store.update("KvR3", "late", lambda c: with_members(c, ("m1", "m2")))
    assert moved.revision > created.revision
    assert (await store.get("KvR3", "late")).config.members == ("m1", "m2")
    await asyncio.to_thread(nats_cluster.restart, leader)
