"""``cg demo``: a local nats-server and a consumer-group admin round trip, printed step by step.

Starts nats-server on a free port with a temporary store, creates stream ``demo`` and elastic
group ``keys`` (4 partitions on the second subject token), publishes keyed events, adds members,
shows the assignment and the per-partition backlog the server computed, checks every subject's
partition against :func:`cg_pipelines.core.subjects.partition_for`, then cleans up.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import click
import nats
from nats.js.api import StreamConfig

from cg_pipelines.core.assignment import assignment, moved_partitions
from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.core.subjects import partition_of_subject, strip_partition
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.local.nats_server import NatsServer


async def _round_trip(url: str, n_events: int) -> int:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name="demo", subjects=["demo.>"]))
        cfg = ElasticConfig(4, (PartitioningFilter("demo.*", (1,)),))
        await admin.create_elastic(js, "demo", "keys", cfg)
        click.echo("created stream demo and elastic group keys (4 partitions on demo.<key>)")
        acks = [await js.publish_async(f"demo.key{i % 50}", str(i).encode())
                for i in range(n_events)]
        await asyncio.gather(*acks)
        click.echo(f"published {n_events} events over 50 keys")
        before = assignment((await admin.add_members(js, "demo", "keys", ["m1", "m2"])).config)
        click.echo(f"members m1,m2 -> {before}")
        after = assignment((await admin.add_members(js, "demo", "keys", ["m3"])).config)
        click.echo(f"member m3 joins -> {after}; moved {moved_partitions(before, after)}")
        api = JetStreamAPI(nc)
        for _ in range(100):
            info = await api.stream_info("demo-keys", subjects_filter=">")
            if info["state"]["messages"] >= n_events:
                break
            await asyncio.sleep(0.05)
        counts = [0, 0, 0, 0]
        bad = 0
        for subject, count in info["state"]["subjects"].items():
            p, original = strip_partition(subject)
            counts[p] += count
            bad += partition_of_subject(original, "demo.*", (1,), 4) != p
        click.echo(f"work-queue backlog per partition: {counts} "
                   f"({bad} subjects where our hash disagrees with the server)")
        for s in await admin.member_status(js, "elastic", "demo", "keys"):
            click.echo(f"  {s.member}: partitions {list(s.partitions)}, "
                       f"{'active' if s.active else 'no instance joined yet'}")
        await admin.delete_elastic(js, "demo", "keys")
        click.echo("deleted group keys and its work-queue stream")
        return bad
    finally:
        await nc.close()


def run_demo(n_events: int = 1000) -> int:
    """Run the demo; returns the number of hash mismatches (0 when all is well)."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cg-demo-") as tmp, \
            NatsServer(Path(tmp), port=0) as server:
        click.echo(f"nats-server {server.url} (JetStream, temporary store)")
        bad = asyncio.run(_round_trip(server.url, n_events))
    click.echo(f"demo done in {time.monotonic() - t0:.1f} s: {bad} mismatches")
    return bad
