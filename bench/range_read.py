"""Benchmark: read one partition's range of an elastic group's work-queue stream (issue 14).

Setup (one nats-server, file storage): an origin stream ``O`` (limits) with ``--messages``
messages (200,000) on ~4,000 subjects ``flights.<carrier>.<tailnum>``, JSON payloads of ~250
bytes; three streams sourced from it with the engine's subject transform:

- ``O-g8``: work queue, 8 partitions (``{{Partition(8,1,2)}}.flights.*.*``): partition 3 holds
  about 1/8 of the messages;
- ``O-g1``: work queue, every message in partition 0 (a partition holding all messages);
- ``O-copy8``: a limits-retention copy of ``O-g8`` (for the consumer reference only).

Contenders, each reading the partition's whole range (1/8: all of partition 3; all: the first
``--dense`` messages of partition 0) in ranges of ``--batch`` messages:

- ``current path``: ``JetStreamAPI.direct_get_batch`` in chunks of 2,000 + per-message records
  + an Arrow table (what ``engine/runner.py`` ``_read`` does);
- ``direct get filtered`` (``next_by_subj="<p>.>"``) / ``unfiltered`` (``">"`` and client-side
  skip of the other partitions) with :func:`cg_pipelines.jetstream.rangeread.read_range`: one
  request per range (batch 20,000), chunks of 2,000 one after the other, and chunks of 2,000
  with several requests in flight (pipelined, split by sequence windows);
- ``consumer (reference)``: an ephemeral AckNone pull consumer (filter ``3.>``) on the limits
  copy, one pull of ``--batch`` at a time, frames cut by the same bulk parser; consumer create
  and delete are inside the timing.

Rounds are interleaved (every contender once per round, rotating the order) and each line
reports the median msg/s over the rounds, plus server CPU (``/proc/<pid>/stat`` utime+stime)
and client CPU (``time.process_time``) per message, summed over all rounds.

Run: ``.venv/bin/python bench/range_read.py [--messages 200000] [--rounds 5]``; ``--smoke``:
5,000 messages (2,000 dense), ranges of 1,000, one round (checks the script runs, in seconds;
figures meaningless).
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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import nats
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cg_pipelines.jetstream.api import JetStreamAPI, consumer_config
from cg_pipelines.jetstream.rangeread import (
    GenericReply,
    _header_columns,
    direct_get_reply,
    read_range,
    reply_columns,
)
from cg_pipelines.local.nats_server import NatsServer

CARRIERS = ["AA", "AS", "B6", "DL", "EV", "F9", "FL", "HA", "MQ", "OO", "UA", "US", "VX", "WN",
            "YV", "9E"]
TAILS_PER_CARRIER = 250  # 16 x 250 = 4,000 subjects
TRANSFORM8 = "{{Partition(8,1,2)}}.flights.{{Wildcard(1)}}.{{Wildcard(2)}}"
TRANSFORM1 = "{{Partition(1)}}.flights.{{Wildcard(1)}}.{{Wildcard(2)}}"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def server_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14, 15)


def payload(i: int, rnd: random.Random) -> bytes:
    rec = {
        "year": 2013, "month": 1 + i % 12, "day": 1 + i % 28, "dep_time": rnd.randint(1, 2359),
        "sched_dep_time": rnd.randint(1, 2359), "dep_delay": rnd.randint(-20, 300),
        "arr_time": rnd.randint(1, 2359), "sched_arr_time": rnd.randint(1, 2359),
        "arr_delay": rnd.randint(-40, 300), "flight": rnd.randint(1, 6000),
        "origin": rnd.choice(["EWR", "JFK", "LGA"]), "dest": "ATL", "air_time": 227.0,
        "distance": 1400, "hour": 5, "minute": 15, "time_hour": "2013-01-01T10:00:00Z",
        "seq_in_load": i,
    }
    return json.dumps(rec, separators=(",", ":")).encode()


async def setup(nc: nats.NATS, messages: int) -> dict[str, int]:
    api = JetStreamAPI(nc, timeout=30)
    await api.create_stream({"name": "O", "subjects": ["flights.>"], "storage": "file"})
    rnd = random.Random(14)
    subjects = [f"flights.{c}.N{t:03d}{c}" for c in CARRIERS for t in range(TAILS_PER_CARRIER)]
    sent = 0
    while sent < messages:
        n = min(5_000, messages - sent)
        for i in range(sent, sent + n):
            await nc.publish(rnd.choice(subjects), payload(i, rnd))
        await nc.flush(timeout=30)
        sent += n
        # Let the stream keep up (core publishes are not flow-controlled).
        while True:
            st = (await api.stream_info("O"))["state"]
            if st["messages"] >= sent - 20_000:
                break
            await asyncio.sleep(0.05)
    for _ in range(600):
        st = (await api.stream_info("O"))["state"]
        if st["messages"] >= messages:
            break
        await asyncio.sleep(0.1)
    have = (await api.stream_info("O"))["state"]["messages"]
    js = nc.jetstream(timeout=30)
    for i in range(have, messages):  # anything lost on the way: publish with acks
        await js.publish(rnd.choice(subjects), payload(i, rnd))
    src8 = [{"name": "O", "subject_transforms": [{"src": "flights.*.*", "dest": TRANSFORM8}]}]
    src1 = [{"name": "O", "subject_transforms": [{"src": "flights.*.*", "dest": TRANSFORM1}]}]
    wq = {"retention": "workqueue", "storage": "file", "discard": "new", "allow_direct": True}
    await api.create_stream({"name": "O-g8", "sources": src8, **wq})
    await api.create_stream({"name": "O-g1", "sources": src1, **wq})
    await api.create_stream({"name": "O-copy8", "sources": src8, "storage": "file",
                             "allow_direct": True})
    for name in ("O-g8", "O-g1", "O-copy8"):
        for _ in range(1200):
            if (await api.stream_info(name))["state"]["messages"] >= messages:
                break
            await asyncio.sleep(0.1)
        else:
            raise RuntimeError(f"{name} did not fill up")
    info = await api.stream_info("O-g8", subjects_filter="3.>")
    counts = {"p3": sum(info["state"]["subjects"].values())}
    await api.close()
    return counts


# ------------------------------------------------------------------------------ contenders


@dataclass
class Contender:
    name: str
    fn: Callable[[], Awaitable[int]]
    rates: list[float] = field(default_factory=list)
    msgs: int = 0
    server_s: float = 0.0
    client_s: float = 0.0


async def current_path(api: JetStreamAPI, stream: str, flt: str, prefix: str, last: int,
                       batch: int, chunk: int = 2_000) -> int:
    """engine/runner.py ``_read`` before issue 14: direct_get_batch in chunks, one record per
    message, then an Arrow table."""
    seq, total = 1, 0
    while True:
        out: list[tuple] = []
        done = False
        s = seq
        while len(out) < batch:
            want = min(chunk, batch - len(out))
            msgs = await api.direct_get_batch(stream, s, flt, want, max_bytes=64 << 20)
            for m in msgs:
                if m.seq > last:
                    done = True
                    break
                if not m.subject.startswith(prefix):
                    continue
                hdrs = {k: v for k, v in (m.headers or {}).items() if not k.startswith("Nats-")}
                out.append((m.seq, m.subject[len(prefix):], m.data, m.time_ns, hdrs or None))
            if done or len(msgs) < want or msgs[-1].num_pending == 0:
                done = True
                break
            s = msgs[-1].seq + 1
        pa.Table.from_arrays([
            pa.array([r[0] for r in out], pa.int64()),
            pa.array([r[1] for r in out], pa.string()),
            pa.array([r[3] for r in out], pa.int64()).cast(pa.timestamp("ns", tz="UTC")),
            pa.array([json.dumps(r[4]) if r[4] else None for r in out], pa.string()),
            pa.array([r[2] for r in out], pa.binary()),
        ], names=["seq", "subject", "time", "headers", "data"])
        total += len(out)
        if done or not out:
            return total
        seq = out[-1][0] + 1


async def ranges(nc: nats.NATS, stream: str, flt: str, prefix: str, last: int, batch: int,
                 request_batch: int | None) -> int:
    """read_range over the whole partition up to ``last``, ``batch`` messages per range."""
    seq, total = 1, 0
    while True:
        b = await read_range(nc, stream, seq, filter_subject=flt, prefix=prefix, max_msgs=batch,
                             last_seq=last, request_batch=request_batch,
                             drop_nats_headers=True)
        total += len(b)
        b.table()
        seq = b.next_seq
        if b.ended:
            return total


async def pipelined(nc: nats.NATS, stream: str, flt: str, prefix: str, last: int, batch: int,
                    chunk: int, depth: int, density: float) -> int:
    """Ranges of ``batch`` messages, each read as requests of ``chunk`` messages over sequence
    windows of ``0.8 * chunk / density`` sequences (so that one request usually covers its
    window), ``depth`` requests in flight; a window a request did not finish gets follow-up
    requests. A batched direct get has no upper sequence bound, so a request that covers its
    window reads on into the next one (those messages are dropped): exact for a dense partition,
    some over-read for a sparse one."""
    span = max(1, int((chunk if density >= 1 else 0.8 * chunk) / density))
    seq, total = 1, 0
    sem = asyncio.Semaphore(depth)

    async def window(lo: int, hi: int) -> list:
        out, s = [], lo
        while s <= hi:
            async with sem:
                r = await direct_get_reply(
                    nc, stream, {"seq": s, "next_by_subj": flt, "batch": chunk,
                                 "max_bytes": 16 << 20})
            if not r.servers:
                break
            cols = reply_columns(r.users, r.servers, r.datas, prefix=prefix,
                                 drop_nats_headers=True)
            seqs = cols.seq.to_numpy()
            keep = seqs <= hi
            out.append(cols if keep.all() else cols.filter(pa.array(keep)))
            if not keep.all() or len(r.servers) < chunk:
                break
            s = int(seqs[-1]) + 1 if len(seqs) else s + span
        return out

    while seq <= last:
        hi_range = min(last, seq + int(batch / density) - 1)
        wins = [(lo, min(lo + span - 1, hi_range)) for lo in range(seq, hi_range + 1, span)]
        parts = await asyncio.gather(*(window(lo, hi) for lo, hi in wins))
        cols = [c for p in parts for c in p]
        total += sum(len(c) for c in cols)
        if cols:
            pa.Table.from_arrays([pa.concat_arrays([getattr(c, n) for c in cols])
                                  for n in ("seq", "subject", "time", "headers", "data")],
                                 names=["seq", "subject", "time", "headers", "data"])
        seq = hi_range + 1
    return total


class PullCollector(GenericReply):
    """Deliveries of one pull request: subject, ack reply, header block and payload."""

    __slots__ = ("subjects", "replies", "want")

    def __init__(self, want: int) -> None:
        super().__init__()
        self.subjects: list[bytes] = []
        self.replies: list[bytes] = []
        self.want = want

    def on_frame(self, parts: list[bytes], header: bytes | None, payload: bytes) -> None:
        if header is not None and not payload and header.startswith(b"NATS/1.0 "):
            self.on_status(header)  # 404 / 408 / 409: the pull ended
            return
        self.subjects.append(parts[1])
        self.replies.append(parts[3])
        self.users.append(header or b"NATS/1.0\r\n")
        self.datas.append(payload)
        if len(self.datas) >= self.want:
            self._resolve()


_ACK_RE = (r"\A\$JS\.ACK\.[^.]+\.[^.]+\.[0-9]+\.(?P<seq>[0-9]+)\.[0-9]+\.(?P<ts>[0-9]+)"
           r"\.(?P<pending>[0-9]+)")


async def consumer_reference(nc: nats.NATS, api: JetStreamAPI, stream: str, flt: str,
                             prefix: str, batch: int) -> int:
    info = await api.create_consumer(stream, consumer_config(
        filter_subjects=[flt], ack_policy="none", inactive_threshold_s=30,
        extra={"mem_storage": True}))
    name = info["name"]
    total = 0
    subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{name}"
    try:
        while True:
            r = PullCollector(batch)
            await direct_get_reply(nc, stream, {"batch": batch, "no_wait": True,
                                                "max_bytes": 16 << 20},
                                   reply=r, subject=subject)
            if r.datas:
                m = pc.extract_regex(pa.array(r.replies, pa.binary()), _ACK_RE)
                subj = pc.utf8_slice_codeunits(
                    pa.array(r.subjects, pa.binary()).cast(pa.string()), len(prefix))
                seq = pc.struct_field(m, "seq").cast(pa.int64())
                ts = pc.struct_field(m, "ts").cast(pa.int64()).cast(
                    pa.timestamp("ns", tz="UTC"))
                users = pa.array(r.users, pa.binary())
                headers, _origin = _header_columns(r.users, pc.binary_slice(users, 10, 1 << 30),
                                                   True)
                pa.Table.from_arrays([seq, subj, ts, headers, pa.array(r.datas, pa.binary())],
                                     names=["seq", "subject", "time", "headers", "data"])
                total += len(r.datas)
            if len(r.datas) < batch:
                return total
    finally:
        await api.delete_consumer(stream, name)


async def main_async(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp, NatsServer(
        tmp, port=0, die_with_parent=True
    ) as srv:
        nc = await nats.connect(srv.url, max_reconnect_attempts=2)
        t = time.monotonic()
        counts = await setup(nc, args.messages)
        p3 = counts["p3"]
        print(f"setup: {args.messages:,} messages, partition 3 of 8 holds {p3:,}; "
              f"{time.monotonic() - t:.1f} s; load average {os.getloadavg()[0]:.2f}", flush=True)
        api = JetStreamAPI(nc, timeout=30)
        pid = srv.pid
        assert pid is not None
        N, B, C = args.messages, args.batch, 2_000
        dense = min(args.dense, N)
        density = p3 / N
        contenders = [
            Contender("current path (direct_get_batch x2000 + records), filtered 1/8",
                      lambda: current_path(api, "O-g8", "3.>", "3.", N, B)),
            Contender(f"direct get filtered 1/8 partition, batch {B}",
                      lambda: ranges(nc, "O-g8", "3.>", "3.", N, B, None)),
            Contender(f"direct get filtered 1/8 partition, chunks {C}",
                      lambda: ranges(nc, "O-g8", "3.>", "3.", N, B, C)),
            Contender(f"direct get filtered 1/8 partition, chunks {C} x{args.depth} in flight",
                      lambda: pipelined(nc, "O-g8", "3.>", "3.", N, B, C, args.depth, density)),
            Contender(f"direct get unfiltered 1/8 partition, batch {B}",
                      lambda: ranges(nc, "O-g8", ">", "3.", N, B, None)),
            Contender("current path (direct_get_batch x2000 + records), all-in-one partition",
                      lambda: current_path(api, "O-g1", "0.>", "0.", dense, B)),
            Contender(f"direct get filtered all-in-one partition, batch {B}",
                      lambda: ranges(nc, "O-g1", "0.>", "0.", dense, B, None)),
            Contender(f"direct get unfiltered all-in-one partition, batch {B}",
                      lambda: ranges(nc, "O-g1", ">", "0.", dense, B, None)),
            Contender(f"direct get filtered all-in-one partition, chunks {C}",
                      lambda: ranges(nc, "O-g1", "0.>", "0.", dense, B, C)),
            Contender(f"direct get filtered all-in-one partition, chunks {C} x{args.depth} "
                      "in flight",
                      lambda: pipelined(nc, "O-g1", "0.>", "0.", dense, B, C, args.depth, 1.0)),
            Contender(f"consumer (reference) AckNone pull 1/8 partition, limits copy, batch {B}",
                      lambda: consumer_reference(nc, api, "O-copy8", "3.>", "3.", B)),
        ]
        if args.only:
            contenders = [c for c in contenders if any(o in c.name for o in args.only)]
        # Warm-up (caches, first-call costs), then interleaved rounds.
        for c in contenders:
            await c.fn()
        for rnd in range(args.rounds):
            k = rnd % len(contenders)
            for c in contenders[k:] + contenders[:k]:
                s0, c0, t0 = server_cpu_s(pid), time.process_time(), time.perf_counter()
                n = await c.fn()
                dt = time.perf_counter() - t0
                c.server_s += server_cpu_s(pid) - s0
                c.client_s += time.process_time() - c0
                c.msgs += n
                c.rates.append(n / dt)
        print(f"\nmedian of {args.rounds} interleaved rounds; CPU per message summed over "
              f"the rounds (server: /proc/{pid}/stat utime+stime, {1e6 / CLK_TCK:.0f} µs "
              "ticks)")
        print(f"load average at the end: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")
        for c in contenders:
            print(f"{c.name}: {statistics.median(c.rates):,.0f} msg/s "
                  f"(min {min(c.rates):,.0f}, max {max(c.rates):,.0f}), "
                  f"server {c.server_s / c.msgs * 1e6:.1f} µs/msg, "
                  f"client {c.client_s / c.msgs * 1e6:.1f} µs/msg", flush=True)
        await api.close()
        await nc.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--dense", type=int, default=60_000,
                    help="messages read per round from the all-in-one partition")
    ap.add_argument("--batch", type=int, default=20_000, help="messages per range")
    ap.add_argument("--depth", type=int, default=4, help="requests in flight when pipelined")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", nargs="*", help="run only contenders whose name has one of these")
    ap.add_argument("--smoke", action="store_true", help="5,000 messages, one round")
    args = ap.parse_args()
    if args.smoke:
        args.messages, args.dense, args.batch, args.rounds = 5_000, 2_000, 1_000, 1
    asyncio.run(main_async(args))


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
