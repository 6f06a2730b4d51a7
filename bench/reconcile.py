"""The reconcile check over a long history: time per tick with the cursor.

A local nats-server; an origin stream of N messages (default 1,000,000) on 1,000 keys, an
elastic group of 4 partitions whose work queue sources them all; then, as if every message had
been drained, the work queue is purged and a Delta table gets the commits a drain leaves: per
partition, one commit per 10,000 messages recording their coverage (``cg.coverage``, no rows).
Then the check runs tick after tick from a fresh cursor (``max_messages`` origin messages per
tick) until it reaches the origin's end, and once more after 10,000 new messages were
"drained" (the steady state). Prints each tick's time and the totals; asserts every check is
clean (no gap, no stall).

    .venv/bin/python bench/reconcile.py            # 1,000,000 messages
    .venv/bin/python bench/reconcile.py --smoke    # 20,000 messages, seconds
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
from nats.js.api import StreamConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.core.coverage import ReconcileCursor, encode_seqs
from cg_pipelines.core.subjects import partition_for
from cg_pipelines.engine.coverage_log import DeltaLogCoverage
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.connect import ConnectOptions
from cg_pipelines.jetstream.reconcile import reconcile_group
from cg_pipelines.local.nats_server import NatsServer
from cg_pipelines.sinks.delta import DeltaSink
from cg_pipelines.sinks.storage import table_filesystem

P = 4
KEYS = 1_000
BATCH = 10_000
S = "Bench"


async def _publish(js, first: int, n: int) -> np.ndarray:
    """Publish ``n`` messages (acknowledged, 5,000 in flight); their partitions."""
    keys = [f"k{(first + i) * 7919 % KEYS}" for i in range(n)]
    for i in range(0, n, 5_000):
        acks = [await js.publish_async(f"{S}.{k}", b'{"n":1}') for k in keys[i:i + 5_000]]
        await asyncio.gather(*acks)
    lut = {k: partition_for([k], P) for k in set(keys)}
    return np.array([lut[k] for k in keys], np.int64)


async def _wait(api: JetStreamAPI, stream: str, last: int) -> None:
    for _ in range(6000):
        if int((await api.stream_info(stream))["state"]["last_seq"]) >= last:
            return
        await asyncio.sleep(0.05)
    raise SystemExit(f"{stream} never reached sequence {last}")


def _commit(sink: DeltaSink, parts: np.ndarray, first_seq: int, marks: dict[int, int]) -> int:
    """The commits a drain leaves for origin sequences ``first_seq``... (partition ``parts``):
    per partition, one per BATCH messages, each recording its coverage."""
    commits = 0
    seqs = np.arange(first_seq, first_seq + len(parts), dtype=np.int64)
    for p in range(P):
        mine = seqs[parts == p]
        for i in range(0, len(mine), BATCH):
            chunk = mine[i:i + BATCH]
            app = f"{S}/g/{p}"
            sink.commit(None, {app: (marks.get(p, 0), marks.get(p, 0) + len(chunk))},
                        lineage={"stream": S, "group": "g", "partition": p,
                                 "first_seq": marks.get(p, 0) + 1,
                                 "last_seq": marks.get(p, 0) + len(chunk),
                                 "last_origin_seq": int(chunk[-1]),
                                 "coverage": encode_seqs(chunk)})
            marks[p] = marks.get(p, 0) + len(chunk)
            commits += 1
    return commits


async def main(args: argparse.Namespace) -> None:
    n = 20_000 if args.smoke else args.messages
    with tempfile.TemporaryDirectory() as tmp, \
            NatsServer(Path(tmp) / "nats", port=0) as server:
        nc = await ConnectOptions(server.url, name="bench-reconcile").connect()
        js = nc.jetstream(timeout=30)
        api = JetStreamAPI(nc, timeout=30)
        await js.add_stream(StreamConfig(name=S, subjects=[f"{S}.>"], allow_direct=True))
        await admin.create_elastic(js, S, "g", ElasticConfig(
            P, (PartitioningFilter(f"{S}.*", (1,)),), members=("m1",)))
        t = time.monotonic()
        parts = await _publish(js, 0, n)
        await _wait(api, S, n)
        await _wait(api, f"{S}-g", n)
        print(f"published and sourced {n:,} messages in {time.monotonic() - t:.1f} s", flush=True)
        await api.purge(f"{S}-g")
        sink = DeltaSink(str(Path(tmp) / "table"), schema=pa.schema([("x", pa.int64())]))
        sink.ensure_table(pa.schema([("x", pa.int64())]))
        marks: dict[int, int] = {}
        t = time.monotonic()
        commits = await asyncio.to_thread(_commit, sink, parts, 1, marks)
        print(f"{commits} coverage commits in {time.monotonic() - t:.1f} s", flush=True)
        fs = table_filesystem(sink.uri, {})
        assert fs is not None
        log = DeltaLogCoverage(fs, S, "g")
        cursor = ReconcileCursor()
        ticks: list[float] = []
        while True:
            t = time.monotonic()
            rep = await reconcile_group(js, api, S, "g", coverage=log, cursor=cursor,
                                        max_messages=args.max_messages)
            log.save_cursor(cursor)
            ticks.append(time.monotonic() - t)
            assert rep.ok and rep.stall is None, rep.text()
            print(f"  tick {len(ticks)}: origin {rep.from_seq:,}..{rep.to_seq:,}, "
                  f"{rep.versions_read} versions, {ticks[-1]:.2f} s")
            if not rep.partial:
                break
        total = sum(ticks)
        print(f"first check over {n:,} origin messages: {len(ticks)} ticks of <= "
              f"{args.max_messages:,}, {total:.1f} s in all, {max(ticks):.2f} s per tick at "
              f"most, {n / total:,.0f} origin msg/s; cursor {len(cursor.to_json()):,} bytes")
        more = 10_000
        parts2 = await _publish(js, n, more)
        await _wait(api, f"{S}-g", n + more)
        await api.purge(f"{S}-g")
        await asyncio.to_thread(_commit, sink, parts2, n + 1, marks)
        t = time.monotonic()
        rep = await reconcile_group(js, api, S, "g", coverage=log, cursor=cursor,
                                    max_messages=args.max_messages)
        steady = time.monotonic() - t
        assert rep.ok and rep.stall is None and not rep.partial, rep.text()
        print(f"steady tick after {more:,} new messages (history {n + more:,}): "
              f"{steady:.2f} s, {rep.versions_read} versions read")
        await api.close()
        await nc.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="20,000 messages (seconds)")
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--max-messages", type=int, default=200_000,
                    help="origin messages per tick (the Dagster check's default)")
    asyncio.run(main(ap.parse_args()))
