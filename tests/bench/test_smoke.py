"""Every ``bench/`` script runs in its ``--smoke`` mode and prints its headline figures, and leaves
nothing running (issue 33: benchmarks never rot).

Behaviour only: each bench runs as ``python bench/<name>.py --smoke`` (``PYTHONPATH`` = the
repository root), must exit 0 and print every line its regexes in :data:`BENCHES` describe; the
figures themselves are the benches' business (their smoke sizes make them meaningless). A
bench that crashes, stops printing a headline line or changes its format fails here, and so
does a new ``bench/*.py`` script that is not in the table.

Each bench subprocess carries a unique ``CG_BENCH_SMOKE_TOKEN`` in its environment, which every
process it starts (nats-server, Java, the Dagster daemon, run workers, PostgreSQL) inherits:
a process still carrying it a while after the bench exited is one the bench did not stop (it
is killed, and the test fails naming it).

The benches run ``CG_BENCH_SMOKE_JOBS`` (default 3) at a time, longest first: much of a smoke
run's time is waiting (process and JVM starts, Dagster ticks, ack waits), so three at a time
keep the module within its CI budget (240 s) on two cores. Each bench's wall seconds are listed
in the "cg_pipelines figures" summary; ``--durations`` charges the wait for the pool to the
first test that waits.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.procs import kill, with_token

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
TOKEN_VAR = "CG_BENCH_SMOKE_TOKEN"
TIMEOUT_S = 900.0  # per bench; generous, for a loaded machine
LEFTOVER_GRACE_S = 20.0  # a JVM notices its Python parent is gone within a few seconds

_N = r"[\d,]+"  # an integer, with thousands separators
_F = r"-?[\d.]+"  # a decimal

# bench script (bench/<name>.py) -> regexes (re.MULTILINE) of the lines its --smoke run prints.
BENCHES: dict[str, tuple[str, ...]] = {
    "aging": (rf"^aging: append x{_F} at {_N} versions, merge x{_F} at {_N} versions",),
    "baseline": (rf"^  round 1 main job: {_F} s wall \(verified {_N} rows against the reference: "
                 r"0 mismatches",
                 rf"^  round 1 plain spark batch: {_F} s wall \({_N} rows; spark start {_F} s",
                 r"^  plain batch verified [\d,]+ rows: 0 mismatches$",
                 rf"^main job / plain spark batch: {_F} \(main job {_F} s, plain spark batch "
                 rf"{_F} s; "),
    "bench_jetstream_api": (
        rf"^pull\(batch=1\)\+ack, max_ack_pending=1, pinned: {_N} msg/s",
        rf"^baseline nats-py fetch\(1\)\+ack, max_ack_pending=1: {_N} msg/s",
        rf"^direct_get_batch\(batch=\d+\): {_N} msg/s"),
    "chaos": (rf"^total: 1 runs \(seeds 0\.\.0\), {_N} events, .*; faults \d+, lost 0, order "
              r"violations 0, duplicate effects 0, fence conflicts \d+, failed runs 0$",),
    "delta_commit": (
        rf"^local: commit \d+ rows +n=\d+ +median= *{_F} ms",
        rf"^local: watermark cold \(new sink, \d+ log entries\) {_F} ms",
        rf"^moto-s3: commit \d+ rows +n=\d+ +median= *{_F} ms",
        rf"^moto-s3: watermark cold \(new sink, \d+ log entries\) {_F} ms"),
    "delta_log_cost": (rf"^versions +{_N} \( *{_N} log files\): ",),
    "failure_output": (
        r"^exit code: [1-9]\d*$",  # the transform raises: the materialization fails
        r"^output lines: \d+$",
        r"^lines repeating the partition facts: \d+$",
        r"^tracebacks: \d+$",
        r"^STEP_FAILURE line: .*STEP_FAILURE"),
    "iceberg_vs_delta": (
        rf"^delta append +{_F} +{_N} ", rf"^iceberg merge +{_F} +{_N} ",
        rf"^append: Iceberg median commit {_F}x Delta's",
        rf"^merge: Iceberg median commit {_F}x Delta's"),
    "members": (rf"^  static: member/raw +{_F}$", rf"^  elastic: member/raw +{_F}$",
                rf"^member/raw throughput: {_F}; failover p50 {_F} s$"),
    "merge": (rf"^append: {_N} msg/s$", rf"^merge: {_N} msg/s$", rf"^merge/append: {_F}$"),
    "partition_drain": (rf"^  idiomatic loop: {_N} msg/s; client {_F} µs/msg",
                        rf"^  engine: {_N} msg/s; client {_F} µs/msg",
                        rf"^  range read: {_N} msg/s; client {_F} µs/msg",
                        rf"^  nats-py batch fetch: {_N} msg/s; client {_F} µs/msg",
                        rf"^ratio engine/idiomatic loop: {_F}$",
                        rf"^engine / fastest raw reader: {_F}% \(engine {_N} msg/s, "),
    "range_read": (
        rf"^current path \(direct_get_batch x2000 \+ records\), filtered 1/8: {_N} msg/s",
        rf"^direct get filtered all-in-one partition, chunks 2000 x4 in flight: {_N} msg/s",
        rf"^consumer \(reference\) AckNone pull 1/8 partition, limits copy, batch \d+: "
        rf"{_N} msg/s"),
    "reconcile": (rf"^first check over {_N} origin messages: \d+ ticks .* origin msg/s",
                  rf"^steady tick after {_N} new messages \(history {_N}\): {_F} s"),
    "scale": (
        rf"^  legs-7: SUCCESS, {_N} messages",
        rf"^concurrency 2: {_N} msg/s aggregate",
        rf"^run fixed cost: {_F} s \(median of \d+ runs; connect Spark\)",
        rf"^  fixed cost part: .*: {_F} s \(median per concurrency\)",
        rf"^  no-op runs \(example code location\) at concurrency 2: {_F}, {_F} s$",
        rf"^no-op dagster run: {_F} s \(median of 2 runs",
        rf"^bare no-op dagster run: {_F} s",
        rf"^run fixed cost / no-op dagster run: {_F} \(fixed {_F} s, no-op {_F} s\)$",
        rf"^sensor tick 16 partitions: {_F} s", rf"^sensor tick 64 partitions: {_F} s"),
    "join": (rf"^join run: {_N} msg/s \(\d+ commits\)$",
             rf"^two single runs: {_N} msg/s \(\d+ commits\)$"),
    "range_runs": (rf"^run over 1 partition: {_F} s, {_N} msg/s \(\d+ commits\); seconds in: ",
                   rf"^run over 4 partitions: {_F} s, {_N} msg/s \(\d+ commits\); seconds in: "),
    "wq_consistency": (
        r"^seed 1: \d+ runs, rows [\d,]+ of [\d,]+ \(exact\), runs failed with "
        r"WorkQueueLossError 0, server 'internal inconsistency' 0, ",
        r"^split purge filter '\*\.>': 0 of 1 loops lost messages; server inconsistency in 0 "
        r"of 1$"),
    "sensor_ticks": (rf"^sensor tick 16 partitions: {_F} s",
                     rf"^sensor tick 64 partitions: {_F} s",
                     rf"^sensor tick 64 partitions \(postgres\): {_F} s"),
    "soak": (rf"^soak: \d+ published, lost 0, duplicates 0, order violations 0, stalled "
             rf"partitions 0, freshness p50 {_F} s p99 {_F} s, max backlog \d+$",),
    "spark_path": (rf"^spark session start: {_F} s",
                   rf"^spark path, batch 1000: {_N} msg/s steady state"),
    "spark_read": (
        rf"^\(a\) driver: read_range \+ decode \+ createDataFrame +2,000 +{_F} +{_N} ",
        rf"^\(d\) executor step: process_range \(legs\) +2,000 +{_F} +{_N} ",
        rf"^driver read alone \(2,000 msgs\): {_N} msg/s",
        r"^read: (crossover at or below|no crossover up to) ",
        r"^engine step: (crossover at or below|no crossover up to) "),
}

# The same-run ratio lines (issue 42): bench -> a regex whose group 1 is the ratio's figure,
# which must be a finite number above 0 (its size is the bench's business).
RATIOS: dict[str, str] = {
    "baseline": rf"^main job / plain spark batch: ({_F}) ",
    "scale": rf"^run fixed cost / no-op dagster run: ({_F}) ",
    "partition_drain": rf"^engine / fastest raw reader: ({_F})% ",
    "join": rf"^join run / two single runs: ({_F})$",
    "range_runs": rf"^run over 4 partitions / run over 1 partition \(same messages\): ({_F})$",
}

# Longest first, so the pool's last job is a short one (seconds under load, measured).
ORDER = ("scale", "baseline", "spark_read", "soak", "spark_path", "chaos", "sensor_ticks",
         "failure_output", "members", "aging", "delta_commit", "range_read", "iceberg_vs_delta",
         "merge", "reconcile", "join", "range_runs", "partition_drain", "delta_log_cost",
         "wq_consistency", "bench_jetstream_api")


@dataclass
class SmokeRun:
    """One bench's ``--smoke`` run: exit status (None: timed out), output, wall seconds, and
    the processes (``pid cmdline``) it left running."""

    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    leftovers: list[str]


def run_smoke(script: Path, timeout_s: float = TIMEOUT_S,
              grace_s: float = LEFTOVER_GRACE_S) -> SmokeRun:
    """Run ``python <script> --smoke`` from the repository root to its end (or ``timeout_s``
    seconds: then SIGTERM to its process group, SIGKILL 30 s later) and collect the processes
    it started that are still running ``grace_s`` seconds after it ended."""
    token = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": str(ROOT), TOKEN_VAR: token}
    t0 = time.monotonic()
    # Output to files, not pipes: a process left running would hold a pipe open.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, str(script), "--smoke"], cwd=ROOT, env=env,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                start_new_session=True)
        returncode: int | None
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            returncode = None
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    seconds = time.monotonic() - t0
    deadline = time.monotonic() + grace_s
    while (left := with_token(TOKEN_VAR, token)) and time.monotonic() < deadline:
        time.sleep(0.5)  # poll interval (deadline: grace_s)
    if left:  # reported by the test; killed here so they do not outlive the run
        kill([pid for pid, _ in left], signal.SIGKILL)
    return SmokeRun(returncode, stdout, stderr, seconds, [f"{pid} {cmd}" for pid, cmd in left])


@pytest.fixture(scope="module")
def smoke_runs(request: pytest.FixtureRequest) -> Iterator[dict[str, Future[SmokeRun]]]:
    """The smoke runs of the benches this session's tests ask for, started together on a pool
    of ``CG_BENCH_SMOKE_JOBS`` (default 3) workers, longest first."""
    wanted = {item.callspec.params["name"] for item in request.session.items
              if getattr(item, "originalname", None) in ("test_bench_smoke", "test_ratio_line")
              and hasattr(item, "callspec")}
    jobs = int(os.environ.get("CG_BENCH_SMOKE_JOBS", "3"))
    pool = ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="bench-smoke")
    order = [n for n in ORDER if n in wanted] + sorted(wanted - set(ORDER))
    futures = {name: pool.submit(run_smoke, BENCH / f"{name}.py") for name in order}
    try:
        yield futures
    finally:
        for f in futures.values():
            f.cancel()
        pool.shutdown(wait=True)


def bench_scripts() -> set[str]:
    """The names of the ``bench/*.py`` scripts that run as a program (have a ``__main__``)."""
    return {p.stem for p in BENCH.glob("*.py")
            if re.search(r"^if __name__ == .__main__.:", p.read_text(), re.M)}


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_bench_smoke(name: str, smoke_runs: dict[str, Future[SmokeRun]],
                     report: list[str]) -> None:
    run = smoke_runs[name].result()
    report.append(f"bench/{name}.py --smoke: {run.seconds:.1f} s wall (load average "
                  f"{os.getloadavg()[0]:.1f} at its end)")
    tail = (f"\n--- stdout (last 4,000 characters) ---\n{run.stdout[-4000:]}"
            f"\n--- stderr (last 4,000 characters) ---\n{run.stderr[-4000:]}")
    assert run.returncode is not None, f"bench/{name}.py --smoke ran past {TIMEOUT_S:.0f} s{tail}"
    assert run.returncode == 0, f"bench/{name}.py --smoke exited {run.returncode}{tail}"
    missing = [rx for rx in BENCHES[name] if not re.search(rx, run.stdout, re.M)]
    assert not missing, f"bench/{name}.py --smoke printed no line matching {missing}{tail}"
    assert not run.leftovers, (f"bench/{name}.py --smoke left processes running "
                               f"{LEFTOVER_GRACE_S:.0f} s after it exited: {run.leftovers}")


@pytest.mark.parametrize("name", sorted(RATIOS))
def test_ratio_line(name: str, smoke_runs: dict[str, Future[SmokeRun]]) -> None:
    """The bench's same-run ratio line (issue 42) is printed once, with a finite figure above
    0 (smoke sizes: the figure itself means nothing)."""
    run = smoke_runs[name].result()
    found = re.findall(RATIOS[name], run.stdout, re.M)
    assert len(found) == 1, (f"bench/{name}.py --smoke printed {len(found)} lines matching "
                             f"{RATIOS[name]!r}\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}")
    value = float(found[0])
    assert math.isfinite(value) and value > 0, f"bench/{name}.py ratio {value}"


def test_every_bench_script_has_a_smoke_test() -> None:
    scripts = bench_scripts()
    assert scripts, "no bench/*.py script found"
    assert not scripts - set(BENCHES), (
        f"bench scripts without a smoke entry in tests/bench/test_smoke.py BENCHES: "
        f"{sorted(scripts - set(BENCHES))} (give the script a --smoke mode and its headline "
        "regexes)")
    assert not set(BENCHES) - scripts, f"BENCHES names no script: {set(BENCHES) - scripts}"
    for name in scripts:
        assert '"--smoke"' in (BENCH / f"{name}.py").read_text(), f"bench/{name}.py: no --smoke"
    assert set(ORDER) == set(BENCHES), "ORDER and BENCHES name different scripts"


def test_a_process_left_running_is_found_and_stopped(tmp_path: Path) -> None:
    """The leftover check sees a process a script started in a session of its own and did not
    stop (as a nats-server or a JVM would be), and kills it."""
    script = tmp_path / "leaky.py"
    script.write_text(
        "import subprocess, sys\n"
        "assert sys.argv[1:] == ['--smoke']\n"
        "p = subprocess.Popen(['sleep', '120'], start_new_session=True)\n"
        "print('started', p.pid)\n")
    run = run_smoke(script, timeout_s=60, grace_s=1.0)
    assert run.returncode == 0, run.stderr
    pid = int(run.stdout.split()[1])
    assert [line.split()[:2] for line in run.leftovers] == [[str(pid), "sleep"]]
    for _ in range(100):  # killed: gone once its parent (init) has reaped it
        if not Path(f"/proc/{pid}").exists():
            break
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists()


def test_a_script_that_stops_what_it_started_leaves_nothing(tmp_path: Path) -> None:
    script = tmp_path / "tidy.py"
    script.write_text(
        "import subprocess\n"
        "p = subprocess.Popen(['sleep', '120'], start_new_session=True)\n"
        "p.terminate(); p.wait()\n")
    run = run_smoke(script, timeout_s=60, grace_s=1.0)
    assert run.returncode == 0 and run.leftovers == [], run
