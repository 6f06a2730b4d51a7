"""What the Dagster instance knows of a consumer-group partition's runs, for the triggers.

- :func:`partition_runs`: per partition, consecutive failed runs under the current code since
  the last success, when the newest ended and its error, and whether a run is queued or in
  progress (:class:`~cg_pipelines.core.triggers.PartitionRuns`).
- Lost run workers: a partition run records its process (:func:`run_worker_tags`); a run still
  marked in progress whose process is gone from this host (kill -9, OOM) is marked failed by
  :func:`fail_lost_runs`, so the per-partition run limit frees the partition at the next tick
  instead of after Dagster's ``max_runtime`` (the default run launcher has no run-worker health
  check of its own).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable

from dagster import DagsterEventType, DagsterInstance, DagsterRunStatus, RunsFilter

from cg_pipelines.core.triggers import PartitionRuns, RetryPolicy

__all__ = ["CODE_TAG", "WORKER_TAG", "fail_lost_runs", "partition_runs", "run_worker_tags"]

CODE_TAG = "cg/code_version"
"""Run tag: the code version (:func:`~cg_pipelines.core.fingerprint.code_version` or the
asset's declared one) a partition run was made with."""

WORKER_TAG = "cg/run_worker"
"""Run tag: ``<host> <pid> <process start ticks>`` of the process executing the run."""

PARTITION_TAG = "dagster/partition"
_QUEUED = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING,
           DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING]
_FAILED = {DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED}
_ERROR_CHARS = 400


def run_worker_tags() -> dict[str, str]:
    """This process as a :data:`WORKER_TAG` value: host name, pid and (on Linux) the process
    start time in clock ticks, so a reused pid is not taken for the run's process."""
    pid = os.getpid()
    return {WORKER_TAG: f"{socket.gethostname()} {pid} {_start_ticks(pid) or 0}"}


def _start_ticks(pid: int) -> int | None:
    """The process' start time (field 22 of ``/proc/<pid>/stat``), or None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            tail = f.read().rsplit(")", 1)[1].split()
        return int(tail[19])
    except (OSError, IndexError, ValueError):
        return None


def worker_gone(tag: str) -> bool:
    """Whether the run worker named by a :data:`WORKER_TAG` value ran on this host and its
    process no longer exists (False when it cannot be told: another host, no ``/proc``)."""
    try:
        host, pid_s, ticks_s = tag.split(" ")
        pid, ticks = int(pid_s), int(ticks_s)
    except ValueError:
        return False
    if host != socket.gethostname() or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    now = _start_ticks(pid)
    return bool(ticks) and now is not None and now != ticks


def fail_lost_runs(instance: DagsterInstance, partition_keys: Iterable[str]) -> list[str]:
    """Mark failed every in-progress run of these partition keys whose recorded run worker
    (:data:`WORKER_TAG`) is gone from this host. Returns their run ids. Harmless if wrong:
    the engine's lease and fenced commit keep a live run from double-committing."""
    lost = []
    for key in partition_keys:
        for rec in instance.get_run_records(RunsFilter(
                tags={PARTITION_TAG: key}, statuses=[DagsterRunStatus.STARTED])):
            run = rec.dagster_run
            tag = run.tags.get(WORKER_TAG)
            if tag and worker_gone(tag):
                instance.report_run_failed(
                    run, f"run worker process of partition {key} is gone ({tag.split()[1]} "
                    "no longer runs on this host: killed or out of memory); marked failed so "
                    "the partition can run again")
                lost.append(run.run_id)
    return lost


def partition_runs(instance: DagsterInstance, partition_keys: dict[int, str], code: str,
                   policy: RetryPolicy, *, exclude_tag: tuple[str, str] | None = None
                   ) -> dict[int, PartitionRuns]:
    """The run history of each partition (``{partition: its Dagster partition key}``).

    Reads at most ``policy.max_failures + 1`` newest runs per partition (one query each)
    and, for a partition with failures, the newest failure's error. Runs carrying
    ``exclude_tag`` (e.g. rebuild runs) are ignored; a failed run counts only when it was made
    with ``code`` (:data:`CODE_TAG`).
    """
    out: dict[int, PartitionRuns] = {}
    for p, key in partition_keys.items():
        records = instance.get_run_records(RunsFilter(tags={PARTITION_TAG: key}),
                                           limit=policy.max_failures + 8)
        failures, newest = 0, None
        in_progress = failed_before = False
        counting = True
        for rec in records:  # newest first
            run = rec.dagster_run
            if exclude_tag is not None and run.tags.get(exclude_tag[0]) == exclude_tag[1]:
                continue
            if run.status in _QUEUED:
                in_progress = True
                continue
            if run.status not in _FAILED:
                break
            failed_before = True
            if counting and run.tags.get(CODE_TAG) == code:
                failures += 1
                newest = newest or rec
            else:
                counting = False
        if failures == 0:
            out[p] = PartitionRuns(in_progress=in_progress, failed_before=failed_before)
            continue
        assert newest is not None
        out[p] = PartitionRuns(
            failures=failures,
            last_failed_at=newest.end_time or newest.update_timestamp.timestamp(),
            last_error=_error_of(instance, newest.dagster_run.run_id),
            in_progress=in_progress, failed_before=True)
    return out


def _error_of(instance: DagsterInstance, run_id: str) -> str:
    """The failed run's error as one line (its step failure, else its run failure)."""
    for kind in (DagsterEventType.STEP_FAILURE, DagsterEventType.RUN_FAILURE):
        for entry in reversed(instance.all_logs(run_id, of_type=kind)):
            event = entry.dagster_event
            data = getattr(event, "event_specific_data", None) if event else None
            err = getattr(data, "error", None)
            text = getattr(err, "message", None) or entry.message or ""
            if text:
                line = " ".join(text.split())
                return line if len(line) <= _ERROR_CHARS else line[:_ERROR_CHARS - 1] + "…"
    return ""
