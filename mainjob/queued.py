"""Partition runs launched the way a deployment launches them: Dagster's queued run coordinator
with ``max_concurrent_runs`` = the concurrency (and the per-partition ``dagster/partition``
limit), the daemon dequeuing, each run in its own process (the default run launcher), all of
them on one Spark master (``local[...]`` per process, or a standalone cluster).

:func:`run_queued` writes the Dagster home's ``dagster.yaml``, starts ``dagster-daemon run -w
workspace.yaml``, submits a backfill of ``aircraft_legs_job`` over every partition (``dagster
job backfill``), waits for the runs and stops the daemon by its process group (SIGTERM, then
SIGKILL). It reports each run's start/end and messages and the aggregate throughput over the
window from the first run's start to the last run's end.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

DAGSTER_BIN = Path(sys.executable).with_name("dagster")
DAEMON_BIN = Path(sys.executable).with_name("dagster-daemon")
FINISHED = {"SUCCESS", "FAILURE", "CANCELED"}


@dataclass(frozen=True)
class RunTiming:
    """One partition run: key, status, start and end (epoch seconds), messages."""

    partition: str
    status: str
    start: float
    end: float
    messages: int

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class QueuedResult:
    runs: list[RunTiming]

    @property
    def messages(self) -> int:
        return sum(r.messages for r in self.runs)

    @property
    def window_s(self) -> float:
        return max(r.end for r in self.runs) - min(r.start for r in self.runs)

    @property
    def aggregate(self) -> float:
        """Messages per second over the runs' window (first start to last end)."""
        return self.messages / self.window_s if self.window_s > 0 else 0.0

    @property
    def failed(self) -> int:
        """Runs that did not succeed."""
        return sum(r.status != "SUCCESS" for r in self.runs)


def write_instance_config(home: Path, concurrency: int) -> None:
    """``dagster.yaml``: the queued run coordinator, ``concurrency`` runs at a time, one per
    ``dagster/partition`` value, telemetry off."""
    home.mkdir(parents=True, exist_ok=True)
    config = {
        "run_coordinator": {"module": "dagster._core.run_coordinator",
                            "class": "QueuedRunCoordinator",
                            "config": {"dequeue_interval_seconds": 1}},
        "concurrency": {"runs": {
            "max_concurrent_runs": concurrency,
            "tag_concurrency_limits": [{"key": "dagster/partition",
                                        "value": {"applyLimitPerUniqueValue": True},
                                        "limit": 1}]}},
        "telemetry": {"enabled": False},
        "nux": {"enabled": False},
    }
    (home / "dagster.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def _stop_group(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _reset_signals() -> None:  # pragma: no cover - runs in the forked child
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def run_queued(root: Path, home: Path, env: dict[str, str], partitions: list[str],
               job: str = "aircraft_legs_job", timeout_s: float = 1200.0) -> QueuedResult:
    """Queue a backfill of ``job`` over ``partitions`` and let the daemon run them (see the
    module docstring). ``env`` must hold the code location's settings (``DAGSTER_HOME`` is set
    here). Raises ``RuntimeError`` when the backfill cannot be submitted or the runs do not
    finish within ``timeout_s``."""
    from dagster import DagsterInstance, RunsFilter

    env = {**env, "DAGSTER_HOME": str(home)}
    with DagsterInstance.from_config(str(home)) as instance:
        # create the SQLite storages once here, before the daemon and the CLI race to do it
        instance.get_runs(limit=1)
        _ = (instance.event_log_storage, instance.schedule_storage)
    log = home / "daemon.log"
    with log.open("wb") as out:
        daemon = subprocess.Popen([str(DAEMON_BIN), "run", "-w", "workspace.yaml"], cwd=root,
                                  env=env, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True, preexec_fn=_reset_signals)
    try:
        sub = subprocess.run(
            [str(DAGSTER_BIN), "job", "backfill", "-w", "workspace.yaml", "-j", job,
             "--partitions", ",".join(partitions), "--noprompt"],
            cwd=root, env=env, capture_output=True, text=True, timeout=120)
        found = re.search(r"Launched backfill job `(\w+)`", sub.stdout)
        if sub.returncode != 0 or found is None:
            raise RuntimeError(f"backfill not submitted:\n{sub.stdout[-2000:]}\n"
                               f"{sub.stderr[-2000:]}")
        backfill_id = found.group(1)
        deadline = time.monotonic() + timeout_s
        with DagsterInstance.from_config(str(home)) as instance:
            while True:
                records = instance.get_run_records(RunsFilter(
                    job_name=job, tags={"dagster/backfill": backfill_id}))
                done = [r for r in records if r.dagster_run.status.value in FINISHED]
                if len(records) >= len(partitions) and len(done) == len(records):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"runs not finished after {timeout_s:g} s; daemon log "
                                       f"{log}")
                time.sleep(1.0)
            runs = []
            for r in records:
                md = _run_metadata(instance, r.dagster_run.run_id)
                runs.append(RunTiming(r.dagster_run.tags.get("dagster/partition", "?"),
                                      r.dagster_run.status.value, r.start_time or 0.0,
                                      r.end_time or 0.0, int(md.get("messages", 0))))
        return QueuedResult(sorted(runs, key=lambda t: t.start))
    finally:
        _stop_group(daemon)


def _run_metadata(instance: object, run_id: str) -> dict[str, object]:
    """The asset materialization metadata of one run (empty if it materialized nothing)."""
    from dagster import DagsterEventType

    records = instance.get_records_for_run(  # type: ignore[attr-defined]
        run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION).records
    for rec in records:
        mat = rec.event_log_entry.asset_materialization
        if mat is not None:
            return {k: v.value for k, v in mat.metadata.items()}
    return {}
