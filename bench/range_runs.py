"""Benchmark: a run over k partitions of a group against a run over the one partition of a
group holding the same messages, interleaved in rounds on one nats-server, medians printed
(issue 51: "a run over k partitions must not cost k times a run over one").

Each round makes one stream ``R<r>`` holding ``--messages`` events ``{"key", "v"}`` over
``--keys`` keys and on it one elastic group per contender, all sourcing the same stream (so
every contender reads the same messages): ``one`` (1 partition) and ``p<k>`` (k partitions,
for each k of ``--partitions``). Every contender appends to a fresh local Delta table with the
same work per message (bulk JSON decode, the decoded rows plus their sequence), no state, the
engine's default options but ``--batch``:

- ``run over 1 partition``: :func:`~cg_pipelines.engine.runner.run_partition` on ``one``;
- ``run over k partitions``: :func:`~cg_pipelines.engine.runner.run_partitions` over
  ``range(k)`` of ``p<k>`` (a batch holds at most ``--batch`` messages in all, shared out
  among the partitions still leased).

Contenders alternate order from round to round; each table's row count is checked (a broken
run cannot look fast). Prints each contender's median wall seconds, msg/s, commits, this
process's and the nats-server's CPU (µs per message, from ``/proc``), where
the time went (the run's own ``timings``: read, process, commit, settle, watermark... summed
over the sides, medians; the pipelined steps overlap, so they do not add up to the wall
time), then per k ``run over <k> partitions / run over 1 partition (same messages): <x>``
(the ratio of median wall times; the issue's target is <= 1.25), and the load average before
and after.

With ``--read-paths`` it first measures, per k, the read alone of a k-partition work queue
holding the same messages (a group ``r<k>`` no run drains), interleaved, median msg/s: the
candidate read paths for the next step of issue 51 (see ``notes/RANGE_RUNS.md``):

- ``filtered, one partition after another``: what a range run's sides do now (batched direct
  get per partition, ``next_by_subj "<p>.>"``, ranges of ``--batch / k``), one at a time;
- ``filtered, all partitions at once``: the same requests, all in flight together;
- ``unfiltered, split here``: ONE batched direct get over the work queue (``">"``, ranges of
  ``--batch``), each range split by partition on the client (the subject's first token);
- the reference: the same unfiltered read of a 1-partition group of the same messages (what a
  run over one partition reads).

With ``--purges`` it first measures what settling costs nats-server, per purge size (5,000,
20,000 and 50,000 messages): a work queue holding ``--messages`` purged from its first
message to its last in steps of that size, ``"*.>"`` on a 32-partition group's queue (a split
read's purge) and ``"0.>"`` on a 1-partition group's (a one-partition run's), rounds
interleaved, median seconds for the whole queue: the reason a run settles several commits at
once (``EngineOptions.settle_interval_s``, ``notes/RANGE_RUNS.md`` §13).
``--settle-interval S`` runs every contender with that ``settle_interval_s`` (default: the
engine's; ``0``: a settle after every commit).

Run: ``.venv/bin/python bench/range_runs.py [--messages 100000] [--keys 10000]
[--partitions 8,32] [--rounds 3] [--batch 20000] [--read-paths] [--purges]
[--settle-interval S]``; ``--smoke``: 2,000 messages, k = 4, one round, with
``--purges`` (checks the script runs, in seconds; figures meaningless).
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
from pathlib import Path

import nats
import pyarrow as pa
import pyarrow.compute as pc
from nats.js.api import StreamConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.core.decode import JsonDecoder, JsonField
from cg_pipelines.engine import ArrowProcessor, EngineOptions, run_partition, run_partitions
from cg_pipelines.engine.processor import BatchContext
from cg_pipelines.engine.result import RunResult
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.publish import publish_many
from cg_pipelines.jetstream.rangeread import read_range
from cg_pipelines.local.nats_server import NatsServer
from cg_pipelines.sinks.delta import DeltaSink

DECODER = JsonDecoder([JsonField("key", "string", nullable=False),
                       JsonField("v", "int", nullable=False)])


def transform(table: pa.Table, ctx: BatchContext) -> pa.Table:
    """The decoded rows and their sequence."""
    return table.select(["key", "v", "_seq"])


async def make_stream(nc: nats.NATS, stream: str, groups: dict[str, int], n: int, keys: int,
                      seed: int) -> None:
    """Stream ``stream`` with ``n`` events over ``keys`` keys, and one elastic group per
    ``groups`` entry (name -> partitions), each sourcing all of it."""
    js = nc.jetstream(timeout=60)
    api = JetStreamAPI(nc, timeout=60)
    try:
        await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
        for g, k in groups.items():
            await admin.create_elastic(js, stream, g, ElasticConfig(
                k, (PartitioningFilter(f"{stream}.*", (1,)),), members=("m1",)))
        rnd = random.Random(seed)
        ks = [f"k{rnd.randrange(keys)}" for _ in range(n)]
        await publish_many(nc, [f"{stream}.{k}" for k in ks],
                           [json.dumps({"key": k, "v": i}).encode() for i, k in enumerate(ks)],
                           stream=stream)
        for g in groups:
            while int((await api.stream_info(f"{stream}-{g}"))["state"]["last_seq"]) < n:
                await asyncio.sleep(0.05)
    finally:
        await api.close()


TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """utime + stime of a process, seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


async def contender(nc: nats.NATS, stream: str, group: str, k: int, uri: str, batch: int,
                    server_pid: int, settle_interval: float | None = None
                    ) -> tuple[float, RunResult, int, float, float]:
    """One drain: (wall seconds, result, rows in its table, client CPU s, server CPU s)."""
    sink = DeltaSink(uri)
    proc = ArrowProcessor(DECODER, transform)
    settle = {} if settle_interval is None else {"settle_interval_s": settle_interval}
    opts = EngineOptions(batch_max_msgs=batch, **settle)
    c0, s0 = cpu_s(os.getpid()), cpu_s(server_pid)
    t = time.perf_counter()
    if k == 1:
        res = await run_partition(nc, stream, group, 0, proc, sink, opts)
    else:
        res = await run_partitions(nc, stream, group, range(k), proc, sink, opts)
    seconds = time.perf_counter() - t
    client, server = cpu_s(os.getpid()) - c0, cpu_s(server_pid) - s0
    assert res.status == "drained", (group, res.status, res.detail)
    return seconds, res, sink.read(columns=["key"]).num_rows, client, server


async def read_filtered(nc: nats.NATS, wq: str, k: int, n: int, batch: int, together: bool
                        ) -> int:
    """Every partition of ``wq`` read with its own filter, ranges of ``batch // k``."""
    size = max(1, batch // k)

    async def one(p: int) -> int:
        seq, got = 1, 0
        while True:
            r = await read_range(nc, wq, seq, filter_subject=f"{p}.>", prefix=f"{p}.",
                                 max_msgs=size, last_seq=n, drop_nats_headers=True)
            got += r.num_rows
            if r.ended or not r.num_rows:
                return got
            seq = r.next_seq

    if together:
        return sum(await asyncio.gather(*(one(p) for p in range(k))))
    return sum([await one(p) for p in range(k)])


async def read_unfiltered(nc: nats.NATS, wq: str, k: int, n: int, batch: int) -> int:
    """The whole of ``wq`` in ranges of ``batch``, each split by partition here."""
    seq, got = 1, 0
    while True:
        r = await read_range(nc, wq, seq, filter_subject=">", max_msgs=batch, last_seq=n,
                             drop_nats_headers=True)
        if r.num_rows:
            t = r.table(origin=True)
            part = pc.utf8_slice_codeunits(t["subject"], 0, 3)  # "<p>." (p < 100 here)
            for p in range(k):
                got += t.filter(pc.starts_with(part, f"{p}.")).num_rows
        if r.ended or not r.num_rows:
            return got
        seq = r.next_seq


async def read_paths(nc: nats.NATS, ks: list[int], args: argparse.Namespace) -> None:
    """The ``--read-paths`` figures (see the module docstring)."""
    names = ("filtered, one partition after another", "filtered, all partitions at once",
             "unfiltered, split here", "one partition's read (1-partition group, reference)")
    for k in ks:
        rates: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            stream = f"X{k}r{r}"
            await make_stream(nc, stream, {f"r{k}": k, "r1": 1}, args.messages, args.keys,
                              seed=r)
            order = list(names) if r % 2 == 0 else list(reversed(names))
            for name in order:
                t = time.perf_counter()
                if name == names[3]:
                    got = await read_unfiltered(nc, f"{stream}-r1", 1, args.messages,
                                                args.batch)
                elif name == names[2]:
                    got = await read_unfiltered(nc, f"{stream}-r{k}", k, args.messages,
                                                args.batch)
                else:
                    got = await read_filtered(nc, f"{stream}-r{k}", k, args.messages,
                                              args.batch, together=name == names[1])
                assert got == args.messages, (name, got)
                rates[name].append(args.messages / (time.perf_counter() - t))
            await nc.jetstream().delete_stream(f"{stream}-r{k}")
            await nc.jetstream().delete_stream(f"{stream}-r1")
            await nc.jetstream().delete_stream(stream)
        for name in names:
            print(f"read path, {k} partitions, {name}: "
                  f"{statistics.median(rates[name]):,.0f} msg/s", flush=True)


PURGE_SIZES = (5_000, 20_000, 50_000)


async def purges(nc: nats.NATS, args: argparse.Namespace) -> None:
    """The ``--purges`` figures (see the module docstring)."""
    api = JetStreamAPI(nc, timeout=60)
    kinds = {"32 partitions, '*.>'": (32, "*.>"), "1 partition, '0.>'": (1, "0.>")}
    secs: dict[tuple[str, int], list[float]] = {}
    try:
        for r in range(args.rounds):
            for size in PURGE_SIZES if r % 2 == 0 else reversed(PURGE_SIZES):
                stream = f"P{r}s{size}"
                await make_stream(nc, stream, {"q32": 32, "q1": 1}, args.messages, args.keys,
                                  seed=r)
                order = list(kinds.items()) if r % 2 == 0 else list(reversed(kinds.items()))
                for name, (k, flt) in order:
                    wq, purged = f"{stream}-q{k}", 0
                    t = time.perf_counter()
                    for below in range(size + 1, args.messages + size + 1, size):
                        purged += await api.purge(wq, filter=flt, seq=below)
                    secs.setdefault((name, size), []).append(time.perf_counter() - t)
                    assert purged == args.messages, (name, size, purged)
                for g in ("q32", "q1"):
                    await nc.jetstream().delete_stream(f"{stream}-{g}")
                await nc.jetstream().delete_stream(stream)
    finally:
        await api.close()
    for (name, size), v in sorted(secs.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        n = -(-args.messages // size)
        print(f"purge of {args.messages:,} messages, {name}, {n} purges of {size:,}: "
              f"{statistics.median(v):.2f} s", flush=True)


def name_of(k: int) -> str:
    return f"run over {k} partition{'s' if k > 1 else ''}"


async def main(args: argparse.Namespace) -> None:
    load0 = os.getloadavg()[0]
    ks = [1, *args.partitions]
    secs: dict[int, list[float]] = {k: [] for k in ks}
    commits: dict[int, list[int]] = {k: [] for k in ks}
    timings: dict[int, dict[str, list[float]]] = {k: {} for k in ks}
    cpu: dict[int, tuple[list[float], list[float]]] = {k: ([], []) for k in ks}
    with tempfile.TemporaryDirectory() as tmp, NatsServer(Path(tmp) / "nats", port=0) as srv:
        nc = await nats.connect(srv.url)
        try:
            if args.read_paths:
                await read_paths(nc, args.partitions, args)
            if args.purges:
                await purges(nc, args)
            for r in range(args.rounds):
                stream = f"R{r}"
                groups = {("one" if k == 1 else f"p{k}"): k for k in ks}
                await make_stream(nc, stream, groups, args.messages, args.keys, seed=r)
                order = list(groups.items())
                if r % 2:
                    order.reverse()
                for g, k in order:
                    s, res, rows, cc, sc = await contender(
                        nc, stream, g, k, f"{tmp}/{stream}{g}", args.batch, srv.pid or 0,
                        args.settle_interval)
                    cpu[k][0].append(cc / args.messages * 1e6)
                    cpu[k][1].append(sc / args.messages * 1e6)
                    assert rows == args.messages == res.processed, \
                        f"{g}: {rows} rows, {res.processed} processed, expected {args.messages}"
                    secs[k].append(s)
                    commits[k].append(res.commits)
                    for step, v in res.timings.items():
                        timings[k].setdefault(step, []).append(v)
                    print(f"  round {r + 1} {name_of(k)}: {s:.2f} s, "
                          f"{args.messages / s:,.0f} msg/s ({res.commits} commits)", flush=True)
        finally:
            await nc.close()
    print(f"{args.messages:,} messages over {args.keys:,} keys, batches of {args.batch:,} "
          f"messages, {args.rounds} interleaved rounds (medians):")
    for k in ks:
        s = statistics.median(secs[k])
        steps = ", ".join(f"{step} {statistics.median(v):.2f}"
                          for step, v in sorted(timings[k].items()))
        print(f"{name_of(k)}: {s:.2f} s, {args.messages / s:,.0f} msg/s "
              f"({statistics.median(commits[k]):.0f} commits); seconds in: {steps}")
        print(f"  {name_of(k)} CPU: client {statistics.median(cpu[k][0]):.1f} µs/msg, "
              f"nats-server {statistics.median(cpu[k][1]):.1f} µs/msg")
    one = statistics.median(secs[1])
    for k in args.partitions:
        print(f"run over {k} partitions / run over 1 partition (same messages): "
              f"{statistics.median(secs[k]) / one:.2f}")
    print(f"load average: {load0:.2f} before, {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, default=100_000, help="Messages in all.")
    ap.add_argument("--keys", type=int, default=10_000)
    ap.add_argument("--partitions", type=lambda s: [int(x) for x in s.split(",")],
                    default=[8, 32], help="The k to measure, comma-separated.")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=20_000, help="Messages per batch in all.")
    ap.add_argument("--read-paths", action="store_true",
                    help="First measure the candidate read paths alone.")
    ap.add_argument("--purges", action="store_true",
                    help="First measure nats-server's purge of a work queue per purge size.")
    ap.add_argument("--settle-interval", type=float, default=None,
                    help="EngineOptions.settle_interval_s of every contender (seconds; "
                         "default: the engine's).")
    ap.add_argument("--smoke", action="store_true", help="2,000 messages, k = 4, one round")
    args = ap.parse_args()
    if args.smoke:
        args.messages, args.keys, args.rounds, args.batch = 2_000, 200, 1, 500
        args.partitions, args.purges = [4], True
    asyncio.run(main(args))
