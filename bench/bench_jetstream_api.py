"""Throughput of the raw JetStream API paths (prints msg/s).

    .venv/bin/python bench/bench_jetstream_api.py [--pull N] [--direct N] [--batch B] [--smoke]

Starts its own nats-server (temp store, random port) and stops it at the end.
- pull: pinned consumer (priority group PCG), max_ack_pending=1, loop of pull(batch=1) + ack —
  the per-message ordered ceiling of DESIGN §7 (~10k msg/s there).
  Also the same loop through nats-py's fetch(1), as a same-machine baseline.
- direct: direct_get_batch over N small messages in batches of B.

``--smoke``: 300 pulls, 3,000 direct gets in batches of 500 (checks the script runs, in
seconds; figures meaningless).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import nats
from nats.js.api import ConsumerConfig, StreamConfig

from cg_pipelines.core.config import PRIORITY_GROUP
from cg_pipelines.jetstream.api import JetStreamAPI, consumer_config
from cg_pipelines.local.nats_server import NatsServer


async def publish(js, subject_fmt: str, n: int) -> None:
    futs = []
    for i in range(n):
        futs.append(await js.publish_async(subject_fmt.format(i=i), b"x" * 32))
        if len(futs) >= 1000:
            await asyncio.gather(*futs)
            futs.clear()
    await asyncio.gather(*futs)


async def bench_pull(api: JetStreamAPI, js, n: int) -> float:
    await api.create_stream({"name": "BP", "subjects": ["bp.>"]})
    await publish(js, "bp.{i}", n)
    cfg = consumer_config(
        "c",
        durable_name="c",
        filter_subjects=["bp.>"],
        ack_wait_s=30,
        max_ack_pending=1,
        priority_groups=[PRIORITY_GROUP],
        priority_policy="pinned_client",
        priority_timeout_s=5,
    )
    await api.create_consumer("BP", cfg)
    pin = None
    got = 0
    t0 = time.perf_counter()
    while got < n:
        r = await api.pull("BP", "c", batch=1, expires_s=2, pin_id=pin)
        pin = r.pin_id
        for m in r.messages:
            await m.ack()
            got += 1
    dt = time.perf_counter() - t0
    await api.delete_stream("BP")
    return n / dt


async def bench_fetch(js, n: int) -> float:
    """The same loop through nats-py's own pull subscription, for comparison."""
    await js.add_stream(StreamConfig(name="BF", subjects=["bf.>"]))
    await publish(js, "bf.{i}", n)
    await js.add_consumer(
        "BF", ConsumerConfig(durable_name="f", ack_policy="explicit", max_ack_pending=1)
    )
    sub = await js.pull_subscribe_bind("f", "BF")
    got = 0
    t0 = time.perf_counter()
    while got < n:
        for m in await sub.fetch(1, timeout=2):
            await m.ack()
            got += 1
    dt = time.perf_counter() - t0
    await sub.unsubscribe()
    await js.delete_stream("BF")
    return n / dt


async def bench_direct(api: JetStreamAPI, js, n: int, batch: int) -> float:
    await api.create_stream({"name": "BD", "subjects": ["bd.>"], "allow_direct": True})
    await publish(js, "bd.{i}", n)
    t0 = time.perf_counter()
    seq, got = 1, 0
    while True:
        msgs = await api.direct_get_batch("BD", seq, "bd.>", batch)
        if not msgs:
            break
        got += len(msgs)
        seq = msgs[-1].seq + 1
    dt = time.perf_counter() - t0
    assert got == n, (got, n)
    await api.delete_stream("BD")
    return n / dt


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pull", type=int, default=5000)
    ap.add_argument("--direct", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--smoke", action="store_true", help="300 pulls, 3,000 direct gets")
    a = ap.parse_args()
    if a.smoke:
        a.pull, a.direct, a.batch = 300, 3_000, 500
    with tempfile.TemporaryDirectory() as d, NatsServer(Path(d), die_with_parent=True) as srv:
        nc = await nats.connect(srv.url)
        js = nc.jetstream()
        async with JetStreamAPI(nc) as api:
            if a.pull:
                rate = await bench_pull(api, js, a.pull)
                print(f"pull(batch=1)+ack, max_ack_pending=1, pinned: {rate:,.0f} msg/s ({a.pull})")
                rate = await bench_fetch(js, a.pull)
                print(f"baseline nats-py fetch(1)+ack, max_ack_pending=1: {rate:,.0f} msg/s")
            if a.direct:
                rate = await bench_direct(api, js, a.direct, a.batch)
                print(f"direct_get_batch(batch={a.batch}): {rate:,.0f} msg/s ({a.direct} msgs)")
        await nc.close()


if __name__ == "__main__":
    asyncio.run(main())
