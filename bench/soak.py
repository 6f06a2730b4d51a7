"""Soak: unattended operation under the Dagster daemon, with failures, nobody watching.

A local nats-server, an elastic group of ``--partitions`` partitions over ``--keys`` device
keys, a code location whose Arrow transform raises on about ``--fail-rate`` of its batches at
random, the queued run coordinator (one run per partition at a time, ``--concurrency`` runs at
once, each in its own process) and the backlog sensor on (``--interval`` seconds). A publisher
sends ``--rate`` messages per second for ``--minutes`` minutes (each payload carries its
publish time); halfway through, one running partition run's process is killed with SIGKILL.
Then publishing stops, the partitions are given ``2 x interval + 120 s`` to drain, and the
Delta table is verified against what was published:

- lost: published (key, n) pairs missing from the table;
- duplicates: pairs present more than once;
- order violations: rows whose ``count``/``prev_n`` (computed per key from the committed state
  and the batch in stream order) differ from the reference — any reordering, loss or
  duplicate within a key shows here;
- stalled partitions: partitions with messages still pending at the end;
- freshness: per message, the time its batch was processed (just before its commit) minus
  its publish time, p50 and p99 over all messages;
- max backlog: the most messages pending in the work queue, sampled every second.

Prints exactly one line::

    soak: <n> published, lost 0, duplicates 0, order violations 0, stalled partitions 0,
    freshness p50 <s> s p99 <s> s, max backlog <n>

(on one line), after progress on stderr. Target: freshness p99 <= 2 x interval + 30 s.

Run: ``.venv/bin/python bench/soak.py [--rate 2000] [--partitions 8] [--minutes 10]``;
``--smoke``: 100 msg/s for 9 s over 2 partitions and 50 keys, sensor every 2 s, 2 runs at once
(checks the script and its verification run, in about a minute; figures meaningless).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import nats
import numpy as np
import pandas as pd
from nats.js.api import StreamConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dagster import DagsterInstance, DagsterRunStatus, RunsFilter

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.dagster.history import WORKER_TAG
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.backlog import partition_backlog
from cg_pipelines.local.nats_server import NatsServer
from cg_pipelines.sinks.delta import DeltaSink
from tests.support import keyed
from tests.support.daemon import daemon, make_home, start_sensor

STREAM, GROUP, ASSET = "telemetry", "bydevice", "device_state"

LOCATION = '''\
import os
import random
import time

import pyarrow as pa

from cg_pipelines import JsonDecoder, JsonField
from cg_pipelines.dagster import (ConsumerGroupAsset, DeltaWarehouseResource, NatsResource,
                                  PartitionRunsResource, build_definitions)
from cg_pipelines.engine.processing import ArrowProcessor
from tests.support import keyed

FAIL_RATE = float(os.environ["SOAK_FAIL_RATE"])
DECODER = JsonDecoder([JsonField("key", "string", nullable=False),
                       JsonField("n", "int", nullable=False),
                       JsonField("ts", "float", nullable=False)])


def transform(table, ctx):
    if random.random() < FAIL_RATE:
        raise RuntimeError(f"injected failure on {ctx.first_seq}..{ctx.last_seq}")
    out = keyed.transform(table, ctx)  # keeps the batch's (stream) order
    return out.append_column("ts", table["ts"]).append_column(
        "processed_at", pa.array([time.time()] * out.num_rows, pa.float64()))


device_state = ConsumerGroupAsset(
    name="device_state", stream="telemetry", group="bydevice",
    partitions=int(os.environ["SOAK_PARTITIONS"]),
    processor=ArrowProcessor(DECODER, transform, state=keyed.STATE),
    sensor_interval_s=int(os.environ["SOAK_INTERVAL"]), schedule_cron=None,
    lag_objective_s=60.0)

defs = build_definitions([device_state], resources={
    "nats": NatsResource(servers=os.environ["SOAK_NATS"]),
    "warehouse": DeltaWarehouseResource(root=os.environ["SOAK_WAREHOUSE"]),
    # a killed run's lease comes back after the ack wait: 10 s here (30 s by default)
    "partition_runs": PartitionRunsResource(ack_wait_s=10.0, priority_timeout_s=10.0,
                                            hold_wait_s=2.0, retry_backoff_s=5.0,
                                            retry_max_backoff_s=60.0, retry_max_failures=8),
})
'''


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


async def publish(url: str, rate: int, seconds: float, keys: int,
                  published: list[tuple[str, int]]) -> None:
    """``rate`` messages per second for ``seconds``, in 20 ms ticks, acks awaited per tick."""
    nc = await nats.connect(url)
    js = nc.jetstream(timeout=30)
    counters = [0] * keys
    rng = np.random.default_rng(7)
    t0 = time.monotonic()
    sent = 0
    try:
        while (now := time.monotonic() - t0) < seconds:
            due = int(now * rate) - sent
            acks = []
            for k in rng.integers(0, keys, max(0, due)):
                counters[k] += 1
                key = f"d{k}"
                payload = json.dumps({"key": key, "n": counters[k] * 10 + int(k) % 10,
                                      "ts": time.time()}).encode()
                acks.append(js.publish_async(f"{STREAM}.site{int(k) % 5}.{key}", payload))
                published.append((key, counters[k] * 10 + int(k) % 10))
            if acks:
                await asyncio.gather(*[await a for a in acks])
            sent += max(0, due)
            await asyncio.sleep(0.02)
    finally:
        await nc.close()


async def sample_backlog(url: str, partitions: int, stop: asyncio.Event, out: list[int]) -> None:
    nc = await nats.connect(url)
    try:
        async with JetStreamAPI(nc, timeout=5) as api:
            while not stop.is_set():
                got = await partition_backlog(api, STREAM, GROUP, range(partitions))
                out.append(sum(b.pending for b in got))
                await asyncio.sleep(1.0)
    finally:
        await nc.close()


def kill_one_run(home: Path) -> str | None:
    """SIGKILL the process of one run in progress (from its run-worker tag)."""
    with DagsterInstance.from_config(str(home)) as instance:
        for run in instance.get_runs(RunsFilter(statuses=[DagsterRunStatus.STARTED])):
            tag = run.tags.get(WORKER_TAG)
            if tag:
                pid = int(tag.split()[1])
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                return f"run {run.run_id[:8]} ({run.tags.get('dagster/partition')}, pid {pid})"
    return None


async def soak(args: argparse.Namespace, work: Path) -> str:
    server = NatsServer(work / "nats", die_with_parent=True).start()
    try:
        nc = await nats.connect(server.url)
        js = nc.jetstream(timeout=30)
        await js.add_stream(StreamConfig(name=STREAM, subjects=[f"{STREAM}.>"]))
        await admin.create_elastic(js, STREAM, GROUP, ElasticConfig(
            args.partitions, (PartitioningFilter(f"{STREAM}.*.*", (2,)),), members=("m1",)))
        await nc.close()
        home = make_home(work / "home", max_concurrent_runs=args.concurrency)
        location = work / "location.py"
        location.write_text(LOCATION)
        warehouse = work / "warehouse"
        env = {"SOAK_NATS": server.url, "SOAK_WAREHOUSE": str(warehouse),
               "SOAK_PARTITIONS": str(args.partitions), "SOAK_INTERVAL": str(args.interval),
               "SOAK_FAIL_RATE": str(args.fail_rate)}
        await asyncio.to_thread(start_sensor, home, location, env, f"{ASSET}_backlog")
        published: list[tuple[str, int]] = []
        seconds = args.minutes * 60
        stop = asyncio.Event()
        backlog: list[int] = []
        with daemon(home, location, env):
            log(f"publishing {args.rate} msg/s for {seconds:g} s over {args.partitions} "
                f"partitions; sensor every {args.interval} s")
            sampler = asyncio.create_task(sample_backlog(server.url, args.partitions, stop,
                                                         backlog))
            pub = asyncio.create_task(publish(server.url, args.rate, seconds, args.keys,
                                              published))
            await asyncio.sleep(seconds / 2)
            for _ in range(30):
                killed = await asyncio.to_thread(kill_one_run, home)
                if killed:
                    log(f"killed {killed} with SIGKILL")
                    break
                await asyncio.sleep(1.0)
            else:
                log("no run in progress to kill")
            await pub
            log(f"published {len(published):,}; waiting for the partitions to drain")
            deadline = time.monotonic() + 2 * args.interval + 120
            while time.monotonic() < deadline:
                await asyncio.sleep(2.0)
                if backlog and backlog[-1] == 0 and len(backlog) > 3 and max(backlog[-3:]) == 0:
                    break
            stop.set()
            await sampler
        nc = await nats.connect(server.url)
        try:
            async with JetStreamAPI(nc, timeout=5) as api:
                left = await partition_backlog(api, STREAM, GROUP, range(args.partitions))
        finally:
            await nc.close()
        stalled = sum(1 for b in left if b.pending)
        table = DeltaSink(str(warehouse / ASSET)).read().to_pandas()
        pub_df = pd.DataFrame(published, columns=["key", "n"])
        got = table[["key", "n"]]
        dup = int(got.duplicated().sum())
        merged = pub_df.merge(got.drop_duplicates(), how="left", indicator=True)
        lost = int((merged["_merge"] == "left_only").sum())
        ref = keyed.reference(published).sort_values(["key", "n"]).reset_index(drop=True)
        mine = table.drop_duplicates(["key", "n"]).sort_values(["key", "n"]).reset_index(
            drop=True)
        both = ref.merge(mine, on=["key", "n"], suffixes=("_ref", ""))
        violations = int(((both["count"] != both["count_ref"]) |
                          (both["prev_n"].fillna(-1) != both["prev_n_ref"].fillna(-1))).sum())
        fresh = (table["processed_at"] - table["ts"]).to_numpy()
        p50, p99 = (float(np.percentile(fresh, q)) if len(fresh) else float("nan")
                    for q in (50, 99))
        with DagsterInstance.from_config(str(home)) as instance:
            runs = instance.get_runs()
            failed = sum(1 for r in runs if r.status == DagsterRunStatus.FAILURE)
            recs = [r for r in instance.get_run_records() if r.start_time and r.end_time]
            wall = [r.end_time - r.start_time for r in recs]
            queued = [r.start_time - r.create_timestamp.timestamp() for r in recs]
        log(f"{len(runs)} runs, {failed} failed (injected failures, the killed run, held "
            f"retries); table {len(table):,} rows; per run: start-to-end median "
            f"{np.median(wall):.1f} s (p90 {np.percentile(wall, 90):.1f}), request-to-start "
            f"median {np.median(queued):.1f} s (p90 {np.percentile(queued, 90):.1f}), "
            f"{len(table) / max(1, len(recs)):,.0f} rows per run")
        return (f"soak: {len(published)} published, lost {lost}, duplicates {dup}, order "
                f"violations {violations}, stalled partitions {stalled}, freshness p50 "
                f"{p50:.1f} s p99 {p99:.1f} s, max backlog {max(backlog, default=0)}")
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=int, default=2000, help="messages per second")
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--keys", type=int, default=2000, help="device keys")
    ap.add_argument("--interval", type=int, default=5, help="backlog sensor interval, s")
    ap.add_argument("--concurrency", type=int, default=4, help="runs at once")
    ap.add_argument("--fail-rate", type=float, default=0.02,
                    help="share of batches whose transform raises")
    ap.add_argument("--keep", action="store_true",
                    help="keep the work dir (Dagster home, logs, table) for inspection")
    ap.add_argument("--smoke", action="store_true", help="9 s at 100 msg/s, 2 partitions")
    args = ap.parse_args()
    if args.smoke:
        args.rate, args.partitions, args.minutes, args.keys = 100, 2, 0.15, 50
        args.interval, args.concurrency = 2, 2
    if args.keep:
        work = Path(tempfile.mkdtemp(prefix="cg-soak-"))
        log(f"work dir kept: {work} (Dagster home: {work / 'home'})")
        print(asyncio.run(soak(args, work)), flush=True)
        return
    with tempfile.TemporaryDirectory(prefix="cg-soak-") as tmp:
        print(asyncio.run(soak(args, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
