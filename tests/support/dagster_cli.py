"""Running ``dagster job backfill`` against a test code location: one run per partition,
launched by the DefaultRunCoordinator (no daemon) in run-worker subprocesses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dagster import DagsterInstance, DagsterRun, DagsterRunStatus

ROOT = Path(__file__).resolve().parents[2]
DAGSTER = str(Path(sys.executable).with_name("dagster"))
DAGSTER_YAML = """\
run_coordinator:
  module: dagster._core.run_coordinator
  class: DefaultRunCoordinator
telemetry:
  enabled: false
"""
FINISHED = {DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED}


def dagster_home(path: Path) -> Path:
    """A Dagster home with the DefaultRunCoordinator (runs start at once, no daemon)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "dagster.yaml").write_text(DAGSTER_YAML)
    return path


def _stop_group(proc: subprocess.Popen[str]) -> None:
    """Kill what is left of the CLI's process group (its gRPC server and run workers)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def wait_runs(home: Path, n: int, timeout_s: float) -> list[DagsterRun]:
    """Wait until the instance has at least ``n`` runs, all finished."""
    deadline = time.monotonic() + timeout_s
    with DagsterInstance.from_config(str(home)) as instance:
        while True:
            runs = instance.get_runs()
            if len(runs) >= n and all(r.status in FINISHED for r in runs):
                return list(runs)
            if time.monotonic() > deadline:
                raise AssertionError(f"runs not finished after {timeout_s} s: "
                                     f"{[(r.run_id, r.status) for r in runs]}")
            time.sleep(0.25)


def backfill(home: Path, env: dict[str, str], job: str, partitions: list[str],
             expect_runs: int, location: str = "tests/dagster/backfill_location.py"
             ) -> list[DagsterRun]:
    """``dagster job backfill -j <job> --partitions ...`` (its code server and run workers
    outlive it, in its process group), then wait until the home holds ``expect_runs``
    finished runs; returns all of them."""
    cmd = [DAGSTER, "job", "backfill", "-f", location, "-d", str(ROOT), "-j", job,
           "--partitions", ",".join(partitions), "--noprompt"]
    log = home / f"cli-{job}.log"
    with log.open("w") as out:  # a file, not a pipe: the children keep the CLI's stdout open
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        # The CLI launches every run (a run worker process each) before it returns: minutes
        # on a loaded 2-core machine (it passed 60 s at load 11).
        proc.wait(timeout=300)
        text = log.read_text()
        assert proc.returncode == 0, text
        assert "Launched backfill job" in text, text
        return wait_runs(home, expect_runs, 300)
    finally:
        _stop_group(proc)
