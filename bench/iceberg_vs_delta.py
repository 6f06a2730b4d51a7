"""Fenced commit throughput: Iceberg (pyiceberg, SQL catalog) against Delta (delta-rs), append
and merge, interleaved in one run (prints commits/s and rows/s, median and p90 latency).

    .venv/bin/python bench/iceberg_vs_delta.py [--commits 40] [--rows 2000] [--keys 5000]
                                              [--store local|s3] [--smoke]

Each round commits one batch to each of the four tables in turn — Delta append, Iceberg
append, Delta merge, Iceberg merge (order rotated each round) — so machine noise hits all four
alike. Each commit is what a partition run does: fenced on the previous watermark, one batch
of ``--rows`` rows with ``_partition = 0`` (tables partitioned by it). Merge batches upsert
random keys out of ``--keys`` and delete about 10 % (``Merge(key="key",
delete_when=("op", "del"))``). Iceberg's catalog is SQLite (embedded); data on local disk
(a temp directory) or, with ``--store s3``, moto's server mode started by the bench.
``--smoke``: 3 commits of 50 rows (checks the script runs; figures meaningless).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa

from cg_pipelines.core.write import Merge
from cg_pipelines.sinks.delta import DeltaSink
from cg_pipelines.sinks.iceberg import IcebergSink, sqlite_catalog
from cg_pipelines.testing.s3 import MotoS3Server

MERGE = Merge(key="key", delete_when=("op", "del"))


def batch(rnd: random.Random, first: int, n: int, keys: int, merge: bool) -> pa.Table:
    seqs = list(range(first, first + n))
    ks = [f"K{rnd.randrange(keys)}" if merge else f"K{s % keys}" for s in seqs]
    ops = ["del" if merge and rnd.random() < 0.1 else "up" for _ in seqs]
    return pa.table({
        "key": ks, "op": ops, "_seq": pa.array(seqs, pa.int64()),
        "value": pa.array([rnd.random() for _ in seqs], pa.float64()),
        "time": pa.array([1_700_000_000_000_000 + s for s in seqs], pa.timestamp("us", "UTC")),
        "_partition": pa.array([0] * n, pa.int64()),
    })


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--commits", type=int, default=40)
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--keys", type=int, default=5000)
    ap.add_argument("--store", choices=["local", "s3"], default="local")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    if a.smoke:
        a.commits, a.rows, a.keys = 3, 50, 40
    with tempfile.TemporaryDirectory() as tmp:
        if a.store == "s3":
            with MotoS3Server() as moto:
                moto.create_bucket("bench")
                run(a, tmp, "s3://bench", moto.storage_options())
        else:
            run(a, tmp, str(Path(tmp) / "data"), {})


def run(a: argparse.Namespace, tmp: str, root: str, opts: dict[str, str]) -> None:
    cat = sqlite_catalog(str(Path(tmp) / "catalog"),
                         warehouse=f"{root}/iceberg" if root.startswith("s3://") else None,
                         storage_options=opts)
    sinks: dict[str, Any] = {
        "delta append": DeltaSink(f"{root}/delta_append", storage_options=opts or None),
        "iceberg append": IcebergSink("bench.append", catalog=cat),
        "delta merge": DeltaSink(f"{root}/delta_merge", storage_options=opts or None,
                                 write=MERGE),
        "iceberg merge": IcebergSink("bench.merge", catalog=cat, write=MERGE),
    }
    names = list(sinks)
    lat: dict[str, list[float]] = {n: [] for n in names}
    wm = {n: sinks[n].watermark("bench/g/0") for n in names}
    rnd = random.Random(7)
    for r in range(a.commits):
        order = names[r % 4:] + names[:r % 4]
        for n in order:
            rows = batch(rnd, wm[n] + 1, a.rows, a.keys, "merge" in n)
            commit: Callable[[], None] = lambda n=n, rows=rows: sinks[n].commit(  # noqa: E731
                rows, {"bench/g/0": (wm[n], wm[n] + a.rows)})
            t = time.perf_counter()
            commit()
            lat[n].append(time.perf_counter() - t)
            wm[n] += a.rows
    print(f"{a.commits} commits x {a.rows} rows each, store {a.store}, interleaved "
          f"(merge: {a.keys} keys, ~10 % deletes); Iceberg catalog: SQLite")
    print(f"{'table':16} {'commits/s':>10} {'rows/s':>10} {'median ms':>10} {'p90 ms':>8}")
    for n in names:
        xs = lat[n]
        total = sum(xs)
        print(f"{n:16} {len(xs) / total:10.1f} {len(xs) * a.rows / total:10,.0f} "
              f"{statistics.median(xs) * 1000:10.0f} {pct(xs, 0.9) * 1000:8.0f}")
    for kind in ("append", "merge"):
        d, i = statistics.median(lat[f"delta {kind}"]), statistics.median(lat[f"iceberg {kind}"])
        print(f"{kind}: Iceberg median commit {i / d:.2f}x Delta's")


if __name__ == "__main__":
    main()
