"""Benchmark: a two-input co-partitioned run against two single-input runs of the same
messages, interleaved in rounds on one nats-server, medians printed (issue 39: the cost of the
joint commit).

Each round makes two streams, ``J<r>a`` and ``J<r>b``, each holding ``--messages`` events
``{"key", "v"}`` over ``--keys`` keys, and on each stream two elastic groups of one partition,
``join`` and ``single``: two work queues sourcing the same stream, so both contenders read the
same messages. Both append to fresh local Delta tables, with the same work per message (bulk
JSON decode, the decoded rows plus their sequence and a ``side`` column), no state:

- ``join run``: one :func:`~cg_pipelines.engine.join.run_copartitioned` over the ``join``
  groups of both streams (an :class:`~cg_pipelines.engine.join_processor.ArrowJoinProcessor`
  whose transform concatenates the two inputs' rows): per batch up to ``--batch`` messages of
  each input and ONE commit carrying both watermarks, fenced on both;
- ``two single runs``: :func:`~cg_pipelines.engine.runner.run_partition` with an
  :class:`~cg_pipelines.engine.ArrowProcessor` on the ``single`` group of ``J<r>a``, then on
  that of ``J<r>b``, each into its own table (as two separate assets would): per batch up to
  ``--batch`` messages and one commit.

The rate is all messages of both inputs / wall seconds of the drain (for the single runs, the
two drains' seconds summed). Contenders alternate order from round to round; each table's row
count is checked (a broken run cannot look fast).

Prints ``join run: <n> msg/s (<c> commits)``, ``two single runs: <n> msg/s (<c> commits)``
(medians) and ``join run / two single runs: <x>``, and the load average before and after.

Run: ``.venv/bin/python bench/join.py [--messages 100000] [--keys 10000] [--rounds 3]
[--batch 20000]``; ``--smoke``: 2,000 messages per input in batches of 500, one round (checks
the script runs, in seconds; figures meaningless).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import nats
import pyarrow as pa
from nats.js.api import StreamConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.core.decode import JsonDecoder, JsonField
from cg_pipelines.engine import ArrowProcessor, EngineOptions, run_partition
from cg_pipelines.engine.join import JoinInput, run_copartitioned
from cg_pipelines.engine.join_processor import ArrowJoinProcessor, JoinContext
from cg_pipelines.engine.processor import BatchContext
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.publish import publish_many
from cg_pipelines.local.nats_server import NatsServer
from cg_pipelines.sinks.delta import DeltaSink

DECODER = JsonDecoder([JsonField("key", "string", nullable=False),
                       JsonField("v", "int", nullable=False)])
SIDES = ("a", "b")
GROUPS = ("join", "single")


def _rows(table: pa.Table, side: str) -> pa.Table:
    """The decoded rows, their sequence and the input's name (the same work both ways)."""
    out = table.select(["key", "v", "_seq"])
    return out.append_column("side", pa.array([side] * out.num_rows, pa.string()))


def join_transform(tables: Mapping[str, pa.Table], ctx: JoinContext) -> pa.Table:
    """Both inputs' rows, one table."""
    return pa.concat_tables([_rows(tables[s], s) for s in SIDES])


def single_transform(side: str):  # an ArrowTransform
    def transform(table: pa.Table, ctx: BatchContext) -> pa.Table:
        return _rows(table, side)
    return transform


async def make_streams(nc: nats.NATS, prefix: str, n: int, keys: int, seed: int) -> None:
    """Streams ``<prefix>a``/``<prefix>b`` with ``n`` events each, and on each the groups
    ``join`` and ``single`` (one partition, on the key token), every work queue sourced."""
    js = nc.jetstream(timeout=30)
    rnd = random.Random(seed)
    api = JetStreamAPI(nc)
    try:
        for side in SIDES:
            stream = f"{prefix}{side}"
            await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
            for g in GROUPS:
                await admin.create_elastic(js, stream, g, ElasticConfig(
                    1, (PartitioningFilter(f"{stream}.*", (1,)),), members=("m1",)))
            ks = [f"k{rnd.randrange(keys)}" for _ in range(n)]
            await publish_many(nc, [f"{stream}.{k}" for k in ks],
                               [json.dumps({"key": k, "v": i}).encode()
                                for i, k in enumerate(ks)], stream=stream)
        for side in SIDES:
            for g in GROUPS:
                wq = f"{prefix}{side}-{g}"
                while int((await api.stream_info(wq))["state"]["last_seq"]) < n:
                    await asyncio.sleep(0.05)
    finally:
        await api.close()


async def join_run(nc: nats.NATS, prefix: str, tmp: str, batch: int) -> tuple[float, int, int]:
    """The co-partitioned run: (msg/s, commits, rows)."""
    sink = DeltaSink(f"{tmp}/{prefix}join")
    proc = ArrowJoinProcessor({s: DECODER for s in SIDES}, join_transform)
    inputs = [JoinInput(s, f"{prefix}{s}", "join") for s in SIDES]
    t = time.perf_counter()
    res = await run_copartitioned(nc, inputs, 0, proc, sink, EngineOptions(batch_max_msgs=batch))
    seconds = time.perf_counter() - t
    assert res.status == "drained", (res.status, res.detail)
    return res.processed / seconds, res.commits, sink.read(columns=["key"]).num_rows


async def single_runs(nc: nats.NATS, prefix: str, tmp: str, batch: int
                      ) -> tuple[float, int, int]:
    """The two single-input runs, one after the other: (msg/s, commits, rows)."""
    seconds, processed, commits, rows = 0.0, 0, 0, 0
    for side in SIDES:
        sink = DeltaSink(f"{tmp}/{prefix}single_{side}")
        t = time.perf_counter()
        res = await run_partition(nc, f"{prefix}{side}", "single", 0,
                                  ArrowProcessor(DECODER, single_transform(side)), sink,
                                  EngineOptions(batch_max_msgs=batch))
        seconds += time.perf_counter() - t
        assert res.status == "drained", (res.status, res.detail)
        processed, commits = processed + res.processed, commits + res.commits
        rows += sink.read(columns=["key"]).num_rows
    return processed / seconds, commits, rows


async def main(args: argparse.Namespace) -> None:
    load0 = os.getloadavg()[0]
    rates: dict[str, list[float]] = {"join": [], "single": []}
    commits: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp, NatsServer(Path(tmp) / "nats", port=0) as srv:
        nc = await nats.connect(srv.url)
        try:
            for r in range(args.rounds):
                prefix = f"J{r}"
                await make_streams(nc, prefix, args.messages, args.keys, seed=r)
                order = ["join", "single"] if r % 2 == 0 else ["single", "join"]
                for who in order:
                    run = join_run if who == "join" else single_runs
                    rate, commits[who], rows = await run(nc, prefix, tmp, args.batch)
                    assert rows == 2 * args.messages, f"{who}: {rows} rows, expected " \
                                                      f"{2 * args.messages}"
                    rates[who].append(rate)
                    print(f"  round {r + 1} {who}: {rate:,.0f} msg/s ({commits[who]} commits)",
                          flush=True)
        finally:
            await nc.close()
    join, single = statistics.median(rates["join"]), statistics.median(rates["single"])
    print(f"{args.messages:,} messages per input over {args.keys:,} keys, batches of "
          f"{args.batch:,} per input, {args.rounds} interleaved rounds (medians):")
    print(f"join run: {join:,.0f} msg/s ({commits['join']} commits)")
    print(f"two single runs: {single:,.0f} msg/s ({commits['single']} commits)")
    print(f"join run / two single runs: {join / single:.2f}")
    print(f"load average: {load0:.2f} before, {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, default=100_000, help="Messages per input.")
    ap.add_argument("--keys", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=20_000, help="Messages per batch and input.")
    ap.add_argument("--smoke", action="store_true", help="2,000 messages per input, one round")
    args = ap.parse_args()
    if args.smoke:
        args.messages, args.keys, args.rounds, args.batch = 2_000, 200, 1, 500
    asyncio.run(main(args))
