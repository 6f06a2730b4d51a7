"""Latency of one fenced DeltaSink commit (prints milliseconds: median, p90, min, max).

    .venv/bin/python bench/delta_commit.py [--commits 50] [--rows 1000] [--only local|s3]
                                          [--smoke]

Each commit appends ``--rows`` rows (key, seq, time, payload) and records the application
transaction, exactly as a partition run does: one ``watermark`` read, then consecutive commits,
each fenced on the previous version. Also reports the latency of a ``watermark`` read on the
final table (incremental refresh of the remembered snapshot, and a cold load by a new sink).
Local: a temp directory. S3: moto's server mode on 127.0.0.1 in this process (MotoS3Server),
started and stopped by the bench. ``--smoke``: 5 commits of 100 rows on each store (checks the
script runs, in seconds; figures meaningless).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import pyarrow as pa

from cg_pipelines.sinks.delta import DeltaSink
from cg_pipelines.testing.s3 import MotoS3Server


def batch(first: int, n: int) -> pa.Table:
    seqs = list(range(first, first + n))
    return pa.table(
        {
            "key": [f"N{s % 97}" for s in seqs],
            "seq": pa.array(seqs, pa.int64()),
            "time": pa.array([1_700_000_000_000_000 + s for s in seqs], pa.timestamp("us", "UTC")),
            "payload": [b"x" * 64] * n,
        }
    )


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))]


def summary(name: str, secs: list[float]) -> str:
    ms = [s * 1000 for s in secs]
    return (f"{name:<34} n={len(ms):<3} median={statistics.median(ms):7.1f} ms  "
            f"p90={pct(ms, 0.9):7.1f} ms  min={min(ms):7.1f}  max={max(ms):7.1f}")


def run(label: str, make: Callable[[], DeltaSink], commits: int, rows: int) -> None:
    sink = make()
    app = "BENCH/g/0"
    t = time.perf_counter()
    wm = sink.watermark(app)
    first_wm = time.perf_counter() - t
    tables = [batch(wm + 1 + i * rows, rows) for i in range(commits)]
    # First commit creates the table (schema only) and is reported separately.
    t = time.perf_counter()
    sink.commit(tables[0], {app: (wm, wm + rows)})
    first = time.perf_counter() - t
    wm += rows
    lat: list[float] = []
    for tb in tables[1:] + [batch(wm + 1 + commits * rows, rows)]:
        t = time.perf_counter()
        sink.commit(tb, {app: (wm, wm + rows)})
        lat.append(time.perf_counter() - t)
        wm += rows
    warm_wm: list[float] = []
    for _ in range(10):
        t = time.perf_counter()
        assert sink.watermark(app) == wm
        warm_wm.append(time.perf_counter() - t)
    t = time.perf_counter()
    assert make().watermark(app) == wm
    cold_wm = time.perf_counter() - t
    print(summary(f"{label}: commit {rows} rows", lat))
    print(f"{label}: first commit (creates table) {first * 1000:.1f} ms; "
          f"watermark on no table {first_wm * 1000:.1f} ms")
    print(summary(f"{label}: watermark (warm, incremental)", warm_wm))
    print(f"{label}: watermark cold (new sink, {commits + 2} log entries) "
          f"{cold_wm * 1000:.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commits", type=int, default=50)
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--only", choices=["local", "s3"])
    ap.add_argument("--smoke", action="store_true", help="5 commits of 100 rows")
    args = ap.parse_args()
    if args.smoke:
        args.commits, args.rows = 5, 100
    if args.only in (None, "local"):
        with tempfile.TemporaryDirectory() as d:
            run("local", lambda: DeltaSink(f"{d}/t"), args.commits, args.rows)
    if args.only in (None, "s3"):
        with MotoS3Server() as s3:
            uri = s3.create_bucket("bench-delta") + "/t"
            run("moto-s3", lambda: DeltaSink(uri, storage_options=s3.storage_options()),
                args.commits, args.rows)


if __name__ == "__main__":
    main()
