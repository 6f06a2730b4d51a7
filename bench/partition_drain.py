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
(c) the range read alone (``cg_pipelines.jetstream.rangeread.read_range``), as a reference.

Per contender: msg/s (median over ``--rounds``), this process's CPU and the server's CPU
(µs per message, from ``/proc``), then ``ratio engine/idiomatic loop: <x>``.

Run: ``.venv/bin/python bench/partition_drain.py [--messages 200000] [--rounds 3]``;
``--smoke``: 2,000 messages in batches of 1,000 (the loop 200), one round (checks the script
runs, in seconds; figures meaningless).
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

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter  # noqa: E402
from cg_pipelines.core.decode import JsonDecoder, JsonField  # noqa: E402
from cg_pipelines.engine import ArrowProcessor, EngineOptions, run_partition  # noqa: E402
from cg_pipelines.engine.processor import BatchContext  # noqa: E402
from cg_pipelines.jetstream import admin  # noqa: E402
from cg_pipelines.jetstream.api import JetStreamAPI  # noqa: E402
from cg_pipelines.jetstream.publish import publish_many  # noqa: E402
from cg_pipelines.jetstream.rangeread import read_range  # noqa: E402
from cg_pipelines.local.nats_server import NatsServer  # noqa: E402
from cg_pipelines.sinks.delta import DeltaSink  # noqa: E402

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
        r = await read_range(nc, f"{stream}-{group}", seq, filter_subject="0.>", prefix="0.",
                             max_msgs=20_000)
        got += r.num_rows
        if r.ended or not r.num_rows:
            break
        seq = r.next_seq
    return got


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp, NatsServer(Path(tmp) / "nats", port=0) as srv:
        nc = await nats.connect(srv.url)
        js = nc.jetstream(timeout=30)
        rates: dict[str, list[float]] = {}
        client: dict[str, list[float]] = {}
        server: dict[str, list[float]] = {}
        for rnd in range(args.rounds):
            for name in ("idiomatic loop", "engine", "range read"):
                stream, group = f"bench{rnd}{name[0]}", "g"
                n = args.loop_messages if name == "idiomatic loop" else args.messages
                await make_group(nc, stream, group, n)
                with Meter(srv.pid or 0) as m:
                    if name == "idiomatic loop":
                        done = await idiomatic_loop(nc, stream, group, n)
                    elif name == "engine":
                        done = await engine(nc, stream, group, f"{tmp}/t{rnd}", args.batch)
                    else:
                        done = await range_read(nc, stream, group, n)
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


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--loop-messages", type=int, default=10_000)
    ap.add_argument("--batch", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="2,000 messages, one round")
    args = ap.parse_args()
    if args.smoke:
        args.messages, args.loop_messages, args.batch, args.rounds = 2_000, 200, 1_000, 1
    asyncio.run(main(args))
