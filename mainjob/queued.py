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
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cg_pipelines.local.spawn import with_default_signals

DAGSTER_BIN = Path(sys.executable).with_name("dagster")
DAEMON_BIN = Path(sys.executable).with_name("dagster-daemon")
FINISHED = {"SUCCESS", "FAILURE", "CANCELED"}


WORK_TIMINGS = ("read", "process", "commit", "dead_letter", "read_executors")
"""The engine's timings that are the run's work on its messages: waiting for a range read,
processing, committing (``read_overlapped`` is left out: it overlaps ``process``; so is
``settle``, the purge and ack, which overlaps the next batch; ``watermark`` is part of taking
the lease)."""


@dataclass(frozen=True)
class RunTiming:
    """One partition run: key, status, start and end (epoch seconds), messages.

    ``start``/``end`` are the run record's (the run worker's RUN_START to its end). The
    breakdown fields are epoch seconds from the run's event log (0.0 when absent):
    ``launched`` (RUN_STARTING: the daemon handed it to the run launcher), ``step_start``
    (the asset step started), ``session`` (seconds the Spark session took, from the resource's
    log line), ``engine_s`` (the engine's run, from its connect to its last ack: the
    materialization's ``seconds``), ``work_s`` (the engine's work on the messages: read,
    process, commit; see :data:`WORK_TIMINGS`), ``engine_end`` (its summary log line),
    ``batches`` (commits), ``timings`` (the engine's seconds by step: ``read``, ``process``,
    ``commit``...).
    """

    partition: str
    status: str
    start: float
    end: float
    messages: int
    launched: float = 0.0
    step_start: float = 0.0
    session: float = 0.0
    engine_s: float = 0.0
    work_s: float = 0.0
    engine_end: float = 0.0
    batches: int = 0
    error: str = ""
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def run_s(self) -> float:
        """Seconds from the launch (RUN_STARTING) to the run's end."""
        return self.end - (self.launched or self.start)

    @property
    def fixed_s(self) -> float:
        """Run time less the work on its messages: everything a run costs whatever its
        backlog (process start and imports, code location, Dagster run and step start, Spark
        session, group config, lease, table stats, checks, run end)."""
        return self.run_s - self.work_s

    def breakdown(self) -> dict[str, float]:
        """The fixed cost in parts (seconds; needs the event-log fields)."""
        launched = self.launched or self.start
        engine_start = self.engine_end - self.engine_s
        return {
            "launch->run start (process, imports, code location)": self.start - launched,
            "run start->step start (Dagster, resources)": self.step_start - self.start,
            "step start->engine (run checks, group config, Spark session)":
                engine_start - self.step_start,
            "  of which Spark session": self.session,
            "engine less work (NATS connect, lease, watermark, last ack, release)":
                self.engine_s - self.work_s,
            "engine end->run end (table stats, checks, run end)": self.end - self.engine_end,
        }


@dataclass(frozen=True)
class QueuedResult:
    runs: list[RunTiming]

    @property
    def messages(self) -> int:
        return sum(r.messages for r in self.runs)

    @property
    def window_s(self) -> float:
        """Seconds from the first run's launch (RUN_STARTING; its start when unknown) to the
        last run's end."""
        return max(r.end for r in self.runs) - min(r.launched or r.start for r in self.runs)

    @property
    def aggregate(self) -> float:
        """Messages per second over the runs' window (first launch to last end)."""
        return self.messages / self.window_s if self.window_s > 0 else 0.0

    @property
    def failed(self) -> int:
        """Runs that did not succeed."""
        return sum(r.status != "SUCCESS" for r in self.runs)

    @property
    def fixed_median(self) -> float:
        """Median over the runs of :attr:`RunTiming.fixed_s` (seconds)."""
        return statistics.median(r.fixed_s for r in self.runs)

    def breakdown_median(self) -> dict[str, float]:
        """Median over the runs of each part of :meth:`RunTiming.breakdown` (seconds)."""
        parts = [r.breakdown() for r in self.runs]
        return {k: statistics.median(p[k] for p in parts) for k in parts[0]}


def write_instance_config(home: Path, concurrency: int) -> None:
    """``dagster.yaml``: the queued run coordinator, ``concurrency`` runs at a time, one per
    ``dagster/partition`` value, telemetry off."""
    home.mkdir(parents=True, exist_ok=True)
    config = {
        "run_coordinator": {"module": "dagster._core.run_coordinator",
                            "class": "QueuedRunCoordinator",
                            "config": {"dequeue_interval_seconds": 1,
                                       # launch a tick's runs at once, not one after another
                                       "dequeue_use_threads": True,
                                       "dequeue_num_workers": max(1, concurrency)}},
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


def run_queued(root: Path, home: Path, env: dict[str, str], partitions: list[str],
               job: str = "aircraft_legs_job", timeout_s: float = 1200.0,
               workspace: str = "workspace.yaml", location: str | None = None
               ) -> QueuedResult:
    """Queue a backfill of ``job`` over ``partitions`` and let the daemon run them (see the
    module docstring). ``env`` must hold the code location's settings (``DAGSTER_HOME`` is set
    here). ``workspace``: the workspace file the daemon and the backfill load (relative to
    ``root``); ``location``: the code location of ``job`` when the workspace has several.
    Raises ``RuntimeError`` when the backfill cannot be submitted or the runs do not finish
    within ``timeout_s`` seconds."""
    from dagster import DagsterInstance, RunsFilter

    env = {**env, "DAGSTER_HOME": str(home)}
    with DagsterInstance.from_config(str(home)) as instance:
        # create the SQLite storages once here, before the daemon and the CLI race to do it
        instance.get_runs(limit=1)
        _ = (instance.event_log_storage, instance.schedule_storage)
    log = home / "daemon.log"
    with log.open("wb") as out:
        daemon = subprocess.Popen(
            with_default_signals([str(DAEMON_BIN), "run", "-w", workspace]), cwd=root, env=env,
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        sub = subprocess.run(
            [str(DAGSTER_BIN), "job", "backfill", "-w", workspace, "-j", job,
             *(["-l", location] if location else []),
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
                ev = _run_events(instance, r.dagster_run.run_id)
                timings = md.get("timings") or {}
                runs.append(RunTiming(
                    r.dagster_run.tags.get("dagster/partition", "?"),
                    r.dagster_run.status.value, r.start_time or 0.0, r.end_time or 0.0,
                    int(md.get("messages", 0)), launched=ev.get("launched", 0.0),
                    step_start=ev.get("step_start", 0.0), session=ev.get("session", 0.0),
                    engine_s=float(md.get("seconds", 0.0) or 0.0),
                    work_s=sum(float(timings.get(k, 0.0)) for k in WORK_TIMINGS),
                    engine_end=ev.get("engine_end", 0.0), batches=int(md.get("commits", 0)),
                    timings={k: float(v) for k, v in timings.items()},
                    error=str(ev.get("error", "")) if r.dagster_run.status.value != "SUCCESS"
                    else ""))
        return QueuedResult(sorted(runs, key=lambda t: t.start))
    finally:
        _stop_group(daemon)


_SESSION_RE = re.compile(r"Spark session \(.*\) ready in ([\d.]+) s")


def _run_events(instance: object, run_id: str) -> dict[str, Any]:
    """Timestamps (epoch seconds) of one run's milestones: ``launched`` (RUN_STARTING),
    ``step_start`` (the first STEP_START), ``engine_end`` (the engine's summary line:
    ``partition <p>: <status>, ... messages committed of ...``), and ``session`` (seconds the
    Spark resource's session took, from its log line)."""
    out: dict[str, float] = {}
    for e in instance.all_logs(run_id):  # type: ignore[attr-defined]
        kind = e.dagster_event.event_type_value if e.dagster_event else None
        msg = e.user_message or ""
        if kind == "PIPELINE_STARTING":
            out.setdefault("launched", e.timestamp)
        elif kind == "STEP_START":
            out.setdefault("step_start", e.timestamp)
        elif kind is None and "messages committed of" in msg:
            out["engine_end"] = e.timestamp
        elif kind is None and (m := _SESSION_RE.search(msg)):
            out["session"] = float(m.group(1))
        elif kind in ("STEP_FAILURE", "PIPELINE_FAILURE", "ENGINE_EVENT") and "error" not in out:
            info = getattr(e.dagster_event.event_specific_data, "error", None)
            if info is not None or kind != "ENGINE_EVENT":
                text = getattr(info, "message", None) or msg
                out["error"] = text.strip().splitlines()[-1][:300] if text.strip() else kind
    return out


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
