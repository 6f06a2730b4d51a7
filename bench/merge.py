"""Benchmark: the two write modes of the Delta sink through the whole engine, interleaved in
rounds on one nats-server, medians printed.

Each round and mode gets its own stream and elastic group (one partition) holding
``--messages`` events over ``--keys`` keys (``{"device", "temp", "op"}``, about 5 % deletes),
drained by :func:`cg_pipelines.engine.run_partition` with the Arrow processor (bulk decode, the
decoded rows plus ``_seq``) into a fresh local Delta table:

- ``append``: every row appended (the default);
- ``merge``: ``Merge(key="device", delete_when=("op", "del"))``, a fenced MERGE per batch.

The rate is messages / wall seconds of the drain (lease, read, decode, transform, commit,
purge, ack). Modes alternate order from round to round. The merge table is checked against a
reference (row count = live keys) so a broken merge cannot look fast.

Prints ``append: <n> msg/s`` and ``merge: <n> msg/s`` (medians), and ``merge/append: <x>``.

Run: ``.venv/bin/python bench/merge.py [--messages 100000] [--keys 10000] [--rounds 3]
[--batch 20000]``; ``--smoke``: 2,000 messages over 200 keys, batches of 500, one round
(checks the script runs, in seconds; figures meaningless).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import nats
import pyarrow as pa
from nats.js.api import StreamConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.core.decode import JsonDecoder, JsonField
from cg_pipelines.core.write import Append, Merge
from cg_pipelines.engine import ArrowProcessor, EngineOptions, run_partition
from cg_pipelines.engine.processor import BatchContext
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.publish import publish_many
from cg_pipelines.local.nats_server import NatsServer
from cg_pipelines.sinks.delta import DeltaSink

DECODER = JsonDecoder([JsonField("device", "string", nullable=False),
                       JsonField("temp", "int", nullable=False),
                       JsonField("op", "string", nullable=False)])
MERGE = Merge(key="device", delete_when=("op", "del"))


def transform(table: pa.Table, ctx: BatchContext) -> pa.Table:
    """The decoded rows and their stream sequence."""
    return table.select(["device", "temp", "op", "_seq"])


def events(n: int, keys: int, seed: int) -> list[tuple[str, int, str]]:
    rnd = random.Random(seed)
    return [(f"d{rnd.randrange(keys)}", rnd.randrange(-40, 60),
             "del" if rnd.random() < 0.05 else "up") for _ in range(n)]


def live_keys(evs: list[tuple[str, int, str]]) -> int:
    alive: dict[str, bool] = {}
    for d, _, op in evs:
        alive[d] = op != "del"
    return sum(alive.values())


async def make_group(nc: nats.NATS, stream: str, evs: list[tuple[str, int, str]]) -> None:
    js = nc.jetstream(timeout=30)
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    await admin.create_elastic(js, stream, "g", ElasticConfig(
        1, (PartitioningFilter(f"{stream}.*", (1,)),), members=("m1",)))
    await publish_many(nc, [f"{stream}.{d}" for d, _, _ in evs],
                       [json.dumps({"device": d, "temp": t, "op": op}).encode()
                        for d, t, op in evs], stream=stream)
    api = JetStreamAPI(nc)
    while int((await api.stream_info(f"{stream}-g"))["state"]["messages"]) < len(evs):
        await asyncio.sleep(0.1)
    await api.close()


async def drain(nc: nats.NATS, stream: str, sink: DeltaSink, batch: int) -> float:
    t = time.perf_counter()
    res = await run_partition(nc, stream, "g", 0, ArrowProcessor(DECODER, transform), sink,
                              EngineOptions(batch_max_msgs=batch))
    seconds = time.perf_counter() - t
    assert res.status == "drained", res
    return res.processed / seconds


async def main(args: argparse.Namespace) -> None:
    rates: dict[str, list[float]] = {"append": [], "merge": []}
    with tempfile.TemporaryDirectory() as tmp, NatsServer(Path(tmp) / "nats", port=0) as srv:
        nc = await nats.connect(srv.url)
        try:
            for r in range(args.rounds):
                evs = events(args.messages, args.keys, seed=r)
                order = ["append", "merge"] if r % 2 == 0 else ["merge", "append"]
                for mode in order:
                    stream = f"M{r}{mode}"
                    await make_group(nc, stream, evs)
                    sink = DeltaSink(f"{tmp}/{stream}",
                                     write=MERGE if mode == "merge" else Append())
                    rate = await drain(nc, stream, sink, args.batch)
                    rows = sink.read(columns=["device"]).num_rows
                    want = live_keys(evs) if mode == "merge" else len(evs)
                    assert rows == want, f"{mode}: {rows} rows, expected {want}"
                    rates[mode].append(rate)
                    print(f"  round {r + 1} {mode}: {rate:,.0f} msg/s ({rows:,} rows)",
                          flush=True)
        finally:
            await nc.close()
    append, merge = (statistics.median(rates[m]) for m in ("append", "merge"))
    print(f"{args.messages:,} messages over {args.keys:,} keys, batches of {args.batch:,}, "
          f"{args.rounds} interleaved rounds (medians):")
    print(f"append: {append:,.0f} msg/s")
    print(f"merge: {merge:,.0f} msg/s")
    print(f"merge/append: {merge / append:.2f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--keys", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=20_000)
    ap.add_argument("--smoke", action="store_true", help="2,000 messages, one round")
    args = ap.parse_args()
    if args.smoke:
        args.messages, args.keys, args.rounds, args.batch = 2_000, 200, 1, 500
    asyncio.run(main(args))
