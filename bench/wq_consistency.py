"""Stress: two range runs drain one work queue at once while its source stores new messages;
does every message get committed exactly once? (issue 51, ``notes/RANGE_RUNS.md`` §10-§12: the
rare loss of the chaos runs, root-caused with this loop.)

Each loop (one seed) starts a nats-server (file storage), an origin stream ``O`` and an elastic
group ``g`` of 8 partitions (its work queue ``O-g`` sourced from ``O``), then publishes
``--windows`` windows of 167 keyed events (a pause of 0.3-0.6 s after each, as the chaos
harness does) while two tasks, each on its own connection, run
:func:`~cg_pipelines.engine.runner.run_partitions` over partitions 0-3 and 4-7 again and again
(a :class:`~cg_pipelines.testing.MemorySink`, batches of 120) until the queue is empty. A run
whose partitions hold 90 % of the queue reads it split and purges each batch with ONE purge of
every partition's subjects (``--purge-filter``, default ``*.>``, the engine's); the other run
purges its partitions one by one meanwhile.

Prints per loop: runs, rows committed against the events published (the keyed pandas
reference: per-key order, exactly once), the runs that failed with
:class:`~cg_pipelines.engine.WorkQueueLossError` (a purge removed messages no read returned),
and how often the server logged "internal inconsistency"; then the totals.

``--purge-filter ''`` makes the split purge unfiltered (what the engine did before: nats-server
2.15.1 compacts the store for it, which lost messages here). Run:
``.venv/bin/python bench/wq_consistency.py [--seeds 6] [--windows 24] [--purge-filter '*.>']``;
``--smoke``: one loop of 4 windows.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import nats
from nats.js.api import StreamConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.engine import WorkQueueLossError
from cg_pipelines.engine import reads as engine_reads
from cg_pipelines.engine.options import EngineOptions
from cg_pipelines.engine.runner import run_partitions
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.local.nats_server import NatsServer
from cg_pipelines.testing import MemorySink
from tests.support import keyed

WINDOW = 167
OPTIONS = EngineOptions(batch_max_msgs=120, ack_wait_s=2.0, priority_timeout_s=2.0,
                        hold_wait_s=8.0)


async def one_loop(seed: int, windows: int) -> tuple[int, int, int, int, int]:
    """(runs, rows, events, runs failed with WorkQueueLossError, server inconsistencies)."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp, NatsServer(
            tmp, port=0, die_with_parent=True) as srv:
        nc = await nats.connect(srv.url)
        js = nc.jetstream()
        api = JetStreamAPI.from_js(js)
        await js.add_stream(StreamConfig(name="O", subjects=["O.>"], allow_direct=True))
        await admin.create_elastic(js, "O", "g", ElasticConfig(
            8, (PartitioningFilter("O.*", (1,)),), members=("m1",)))
        evs = keyed.events(n_keys=900, n_events=WINDOW * windows)
        sink = MemorySink()
        published = asyncio.Event()
        runs, losses = [0], [0]

        async def publisher() -> None:
            for w in range(windows):
                await keyed.publish(js, "O", evs[w * WINDOW:(w + 1) * WINDOW])
                await asyncio.sleep(0.3 + 0.3 * rng.random())
            published.set()

        async def runner(partitions: list[int]) -> None:
            conn = await nats.connect(srv.url)
            while True:
                try:
                    await run_partitions(conn, "O", "g", partitions, keyed.processor(), sink,
                                         OPTIONS)
                except WorkQueueLossError:
                    losses[0] += 1
                runs[0] += 1
                if published.is_set() and (
                        await api.stream_info("O-g"))["state"]["messages"] == 0:
                    break
                await asyncio.sleep(rng.random() * 0.5)
            await conn.close()

        await asyncio.gather(publisher(), runner([0, 1, 2, 3]), runner([4, 5, 6, 7]))
        rows = sink.rows()
        bad = keyed.mismatches(rows, evs) if rows.num_rows else "no rows"
        log = Path(tmp, "nats-server.log").read_text(errors="replace")
        await api.close()
        await nc.close()
        return (runs[0], rows.num_rows if bad is None else -rows.num_rows, len(evs), losses[0],
                log.count("internal inconsistency"))


async def main_async(args: argparse.Namespace) -> None:
    engine_reads.ALL_PARTITIONS = args.purge_filter or None  # type: ignore[assignment]
    lost_loops = warned = 0
    for seed in range(1, args.seeds + 1):
        t = time.monotonic()
        runs, rows, events, losses, warns = await one_loop(seed, args.windows)
        exact = rows == events
        lost_loops += not exact
        warned += warns > 0
        print(f"seed {seed}: {runs} runs, rows {abs(rows):,} of {events:,} "
              f"({'exact' if exact else 'NOT exact'}), runs failed with WorkQueueLossError "
              f"{losses}, server 'internal inconsistency' {warns}, "
              f"{time.monotonic() - t:.1f} s", flush=True)
    print(f"split purge filter {args.purge_filter or '(none: unfiltered)'!r}: "
          f"{lost_loops} of {args.seeds} loops lost messages; server inconsistency in "
          f"{warned} of {args.seeds}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--windows", type=int, default=24)
    ap.add_argument("--purge-filter", default="*.>",
                    help="the split read's purge filter; '' = unfiltered")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.seeds, args.windows = 1, 4
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
