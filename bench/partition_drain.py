"""Benchmark: draining one partition, the engine against what a user would otherwise write,
interleaved in rounds on one nats-server, medians printed.

Contenders (each round, each on its own fresh elastic group of one stream, so every contender
reads the same kind of work queue: sourced messages, one partition):

(a) the idiomatic nats-py loop: ``pull_subscribe`` + ``fetch(1)`` + ``json.loads`` + ``ack``
    with ``max_ack_pending=1`` (per-key order, the seed's consume model) on the partition's
    work-queue subjects — ``--loop-messages`` of them (its rate does not depend on the count);
(b) the engine: lease-and-range, a trivial Arrow processor (bulk JSON decode + one derived
    column), the fenced Delta commit, purge and ack, ``--messages`` of them in batches of
    ``--batch``;
(c) the range read alone (``cg_pipelines.jetstream.rangeread.read_range``), as a reference: the
    engine's read of this partition (it holds the whole work queue, so unfiltered, ``>``);
(d) raw range reads, the fastest reading of the partition a PyPI client gives on this machine
    (issue 42's same-run baseline): a pull consumer (explicit ack, no ack pending limit, never
    acked: reading only) on the work queue (unfiltered like the engine's read: see
    :data:`RAW_FILTER`), fetched in batches of
    ``--fetch-batch`` (the last batch cut to what is left, so no fetch waits to expire):
    ``nats-py batch fetch`` (``pull_subscribe`` + ``fetch(batch)``) and, when the ``natsrpy``
    package (a Rust client on PyPI; not a project dependency: ``pip install natsrpy``) is
    importable, ``natsrpy pull batches`` (``PullConsumer.fetch(max_messages=batch)``).
    Each reads the message payloads (their bytes summed), nothing more.

Per contender: msg/s (median over ``--rounds``), this process's CPU and the server's CPU
(µs per message, from ``/proc``), then ``ratio engine/idiomatic loop: <x>`` and ``engine /
fastest raw reader: <x>% (...)``: the engine's median msg/s as a share of the fastest raw
reader's (of (d)), and the load average before and after.

Run: ``.venv/bin/python bench/partition_drain.py [--messages 200000] [--rounds 3]
[--fetch-batch 10000]``; ``--smoke``: 2,000 messages in batches of 1,000 (the loop 200), one
round (checks the script runs, in seconds; figures meaningless).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import nats
import pyarrow as pa
import pyarrow.compute as pc
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.core.decode import JsonDecoder, JsonField
from cg_pipelines.engine import ArrowProcessor, EngineOptions, run_partition
from cg_pipelines.engine.processor import BatchContext
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.publish import publish_many
from cg_pipelines.jetstream.rangeread import read_range
from cg_pipelines.local.nats_server import NatsServer
from cg_pipelines.sinks.delta import DeltaSink

DECODER = JsonDecoder([JsonField("key", "string"), JsonField("n", "int"), JsonField("v", "float")])
TICK = os.sysconf("SC_CLK_TCK")


def arrow_transform(table: pa.Table, ctx: BatchContext) -> pa.Table:
    """The decoded rows with one derived column."""
    return table.select(["key", "n", "v", "_seq"]).append_column(
        "v2", pc.multiply(table.column("v"), 2.0))


def cpu_s(pid: int) -> float:
    """utime + stime of a process, seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


class Meter:
    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid

    def __enter__(self) -> Meter:
        self.t, self.c, self.s = (time.perf_counter(), cpu_s(os.getpid()),
                                  cpu_s(self.server_pid))
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t
        self.client = cpu_s(os.getpid()) - self.c
        self.server = cpu_s(self.server_pid) - self.s


async def make_group(nc: nats.NATS, stream: str, group: str, n: int) -> None:
    """A new stream and a group of one partition on it holding ``n`` messages."""
    js = nc.jetstream(timeout=30)
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    await admin.create_elastic(js, stream, group, ElasticConfig(
        1, (PartitioningFilter(f"{stream}.*", (1,)),), members=("m1",)))
    info = await js.stream_info(stream)
    base = info.state.last_seq
    subjects = [f"{stream}.k{(base + i) % 1000}" for i in range(n)]
    payloads = [json.dumps({"key": f"k{(base + i) % 1000}", "n": base + i, "v": i * 0.5})
                .encode() for i in range(n)]
    await publish_many(nc, subjects, payloads, stream=stream)
    api = JetStreamAPI(nc)
    wq = f"{stream}-{group}"
    while int((await api.stream_info(wq))["state"]["messages"]) < n:
        await asyncio.sleep(0.1)
    await api.close()


async def idiomatic_loop(nc: nats.NATS, stream: str, group: str, n: int) -> int:
    """What a user writes with nats-py: an ordered pull consumer, one message at a time."""
    js = nc.jetstream(timeout=30)
    sub = await js.pull_subscribe("0.>", durable="loop", stream=f"{stream}-{group}",
                                  config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT,
                                                        max_ack_pending=1))
    done = 0
    rows = []
    while done < n:
        for msg in await sub.fetch(1, timeout=5):
            rows.append(json.loads(msg.data))
            await msg.ack()
            done += 1
    await sub.unsubscribe()
    return done


async def engine(nc: nats.NATS, stream: str, group: str, uri: str, batch: int) -> int:
    opts = EngineOptions(batch_max_msgs=batch)
    res = await run_partition(nc, stream, group, 0, ArrowProcessor(DECODER, arrow_transform),
                              DeltaSink(uri), opts)
    assert res.status == "drained", res
    return res.processed


async def range_read(nc: nats.NATS, stream: str, group: str, n: int) -> int:
    seq, got = 1, 0
    while got < n:
        r = await read_range(nc, f"{stream}-{group}", seq, filter_subject=">", prefix="0.",
                             max_msgs=20_000)
        got += r.num_rows
        if r.ended or not r.num_rows:
            break
        seq = r.next_seq
    return got


def natsrpy_available() -> bool:
    """Whether the ``natsrpy`` package (PyPI; optional, not a project dependency) imports."""
    try:
        import natsrpy  # noqa: F401
    except ImportError:
        return False
    return True


async def nats_py_fetch(nc: nats.NATS, stream: str, group: str, n: int, batch: int) -> int:
    """Raw range read with nats-py: a pull consumer on the partition's subjects, ``fetch`` in
    batches of ``batch``, never acked; returns the messages read."""
    js = nc.jetstream(timeout=30)
    sub = await js.pull_subscribe(RAW_FILTER, durable="rawpy", stream=f"{stream}-{group}",
                                  config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT,
                                                        max_ack_pending=-1))
    got = size = 0
    while got < n:
        msgs = await sub.fetch(min(batch, n - got), timeout=10)
        got += len(msgs)
        size += sum(len(m.data) for m in msgs)
    await sub.unsubscribe()
    assert size > 0
    return got


async def natsrpy_fetch(url: str, stream: str, group: str, n: int, batch: int) -> int:
    """Raw range read with natsrpy (Rust client): a pull consumer on the partition's subjects,
    ``fetch(max_messages=batch)`` in a loop, never acked (its connect and consumer creation
    included, as for nats-py's consumer); returns the messages read."""
    import natsrpy
    from natsrpy.js import AckPolicy as RsAckPolicy
    from natsrpy.js import PullConsumerConfig

    rs = natsrpy.Nats(addrs=[url])
    await rs.startup()
    try:
        js = await rs.jetstream()
        st = await js.streams.get(f"{stream}-{group}")
        cons = await st.consumers.create(PullConsumerConfig(
            durable_name="rawrs", ack_policy=RsAckPolicy.EXPLICIT, filter_subject=RAW_FILTER,
            max_ack_pending=-1))
        got = size = 0
        while got < n:
            msgs = await cons.fetch(max_messages=min(batch, n - got), expires=10.0)
            got += len(msgs)
            size += sum(len(m.payload) for m in msgs)
        assert size > 0
        return got
    finally:
        await rs.shutdown()


RAW_FILTER = ">"
"""The raw readers' consumer filter: none, like the engine's read of a partition that holds
90 % of its work queue or more (here: the group's only partition, so the same messages; a
filtered consumer, ``0.>``, costs the server about 3x per message on a sourced work queue:
measured 45-50k msg/s against 120k+ here)."""

RAW = ("nats-py batch fetch", "natsrpy pull batches")
"""The raw range readers (contenders (d))."""


async def main(args: argparse.Namespace) -> None:
    before = _load()
    with tempfile.TemporaryDirectory() as tmp, NatsServer(Path(tmp) / "nats", port=0) as srv:
        nc = await nats.connect(srv.url)
        js = nc.jetstream(timeout=30)
        rates: dict[str, list[float]] = {}
        client: dict[str, list[float]] = {}
        server: dict[str, list[float]] = {}
        names = ["idiomatic loop", "engine", "range read", RAW[0]]
        if natsrpy_available():
            names.append(RAW[1])
        else:
            print("natsrpy: not importable (pip install natsrpy): not measured", flush=True)
        for rnd in range(args.rounds):
            for i, name in enumerate(names):
                stream, group = f"bench{rnd}c{i}", "g"
                n = args.loop_messages if name == "idiomatic loop" else args.messages
                await make_group(nc, stream, group, n)
                with Meter(srv.pid or 0) as m:
                    if name == "idiomatic loop":
                        done = await idiomatic_loop(nc, stream, group, n)
                    elif name == "engine":
                        done = await engine(nc, stream, group, f"{tmp}/t{rnd}", args.batch)
                    elif name == "range read":
                        done = await range_read(nc, stream, group, n)
                    elif name == RAW[0]:
                        done = await nats_py_fetch(nc, stream, group, n, args.fetch_batch)
                    else:
                        done = await natsrpy_fetch(srv.url, stream, group, n,
                                                   args.fetch_batch)
                assert done == n, (name, done, n)
                rates.setdefault(name, []).append(n / m.seconds)
                client.setdefault(name, []).append(m.client / n * 1e6)
                server.setdefault(name, []).append(m.server / n * 1e6)
                print(f"  round {rnd + 1} {name}: {n / m.seconds:,.0f} msg/s", flush=True)
                await js.delete_stream(f"{stream}-{group}")
                await js.delete_stream(stream)
        await nc.close()
    print(f"drain one partition ({args.messages:,} messages, batch {args.batch:,}; the loop "
          f"{args.loop_messages:,}), medians of {args.rounds} interleaved rounds:")
    for name in rates:
        print(f"  {name}: {statistics.median(rates[name]):,.0f} msg/s; client "
              f"{statistics.median(client[name]):.1f} µs/msg, nats-server "
              f"{statistics.median(server[name]):.1f} µs/msg")
    ratio = statistics.median(rates["engine"]) / statistics.median(rates["idiomatic loop"])
    print(f"ratio engine/idiomatic loop: {ratio:.1f}")
    fastest = max((n for n in RAW if n in rates), key=lambda n: statistics.median(rates[n]))
    eng, raw = statistics.median(rates["engine"]), statistics.median(rates[fastest])
    print(f"engine / fastest raw reader: {100 * eng / raw:.0f}% (engine {eng:,.0f} msg/s, "
          f"{fastest} {raw:,.0f} msg/s; fetch batch {args.fetch_batch:,})")
    print(f"load average before {before}, after {_load()}")


def _load() -> str:
    """The 1, 5 and 15 minute load averages."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--loop-messages", type=int, default=10_000)
    ap.add_argument("--batch", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fetch-batch", type=int, default=10_000,
                    help="Messages per fetch of the raw readers.")
    ap.add_argument("--smoke", action="store_true", help="2,000 messages, one round")
    args = ap.parse_args()
    if args.smoke:
        args.messages, args.loop_messages, args.batch, args.rounds = 2_000, 200, 1_000, 1
        args.fetch_batch = 1_000
    asyncio.run(main(args))
