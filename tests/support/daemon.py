"""A real Dagster daemon (``dagster-daemon run``) on a temp Dagster home, for automation tests
and the soak benchmark: queued runs (one per partition at a time), each in its own process
(the default run launcher), sensors ticking as in production."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from dagster import DagsterInstance, DagsterRun, RunsFilter

from cg_pipelines.dagster.history import CHECK_MODE, MODE_TAG
from cg_pipelines.local.spawn import with_default_signals
from tests.support.dagster_dev import stop_process_group

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def instance_yaml(max_concurrent_runs: int = 2, postgres_url: str | None = None) -> str:
    """The queued run coordinator with the per-partition limit (as the README recommends),
    dequeuing every second; with ``postgres_url``, every storage (runs, event log, schedules)
    in that PostgreSQL database (dagster-postgres) instead of SQLite files."""
    storage = "" if postgres_url is None else f"""\
storage:
  postgres:
    postgres_url: "{postgres_url}"
"""
    return storage + f"""\
run_coordinator:
  module: dagster._core.run_coordinator
  class: QueuedRunCoordinator
  config:
    max_concurrent_runs: {max_concurrent_runs}
    dequeue_interval_seconds: 1
    tag_concurrency_limits:
      - key: "dagster/partition"
        value:
          applyLimitPerUniqueValue: true
        limit: 1
telemetry:
  enabled: false
nux:
  enabled: false
"""


def make_home(path: Path, max_concurrent_runs: int = 2, postgres_url: str | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "dagster.yaml").write_text(instance_yaml(max_concurrent_runs, postgres_url))
    with DagsterInstance.from_config(str(path)):
        pass  # create the SQLite storages before the daemon and the CLI race to
    return path


@contextmanager
def daemon(home: Path, location: Path, env: Mapping[str, str]) -> Iterator[subprocess.Popen]:
    """``dagster-daemon run -f <location> -d <repo root>`` with ``DAGSTER_HOME=home``; stopped
    (process group, SIGKILL fallback) on exit. Its output goes to ``home/daemon.log``."""
    full = {**os.environ, **env, "DAGSTER_HOME": str(home)}
    with (home / "daemon.log").open("ab") as log:
        proc = subprocess.Popen(
            with_default_signals([str(BIN / "dagster-daemon"), "run", "-f", str(location),
                                  "-d", str(ROOT)]),
            cwd=ROOT, env=full, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        stop_process_group(proc, 10.0)  # the daemon's group: its code server and run workers


def start_sensor(home: Path, location: Path, env: Mapping[str, str], name: str) -> None:
    """``dagster sensor start <name>`` (sensors of consumer groups start stopped)."""
    full = {**os.environ, **env, "DAGSTER_HOME": str(home)}
    out = subprocess.run([str(BIN / "dagster"), "sensor", "start", name, "-f", str(location),
                          "-d", str(ROOT)], cwd=ROOT, env=full, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def partition_runs(instance: DagsterInstance, key: str) -> list[DagsterRun]:
    """The partition runs of Dagster partition ``key``, oldest first (the backlog sensor's
    check-only runs of the partition, tagged ``cg/mode=check``, left out)."""
    runs = instance.get_runs(RunsFilter(tags={"dagster/partition": key}))
    return [r for r in reversed(runs) if r.tags.get(MODE_TAG) != CHECK_MODE]


def wait_until(what: str, cond, timeout_s: float, home: Path, poll_s: float = 1.0):
    """Poll ``cond()`` until it returns something truthy; fail with the daemon log's tail."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            log = (home / "daemon.log").read_text(errors="replace")[-3000:]
            raise AssertionError(f"{what}: not after {timeout_s:g} s; daemon log tail:\n{log}")
        time.sleep(poll_s)  # poll interval (deadline above)
