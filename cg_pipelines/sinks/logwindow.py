"""The Delta log window of a table the sink maintains: bounded by what still reads the log,
not by days (issue 40).

Who reads a version's log entry after its commit: the reconcile check (its cursor
``_cg_reconcile/<stream>.<group>.json`` beside the table, :mod:`cg_pipelines.engine.
coverage_log`, reads every version after ``ReconcileCursor.version``), lineage and time travel
(``DeltaTable.history()``, ``DeltaTable(uri, version=v)``), and for a short while the library
itself (a held snapshot brought up to date, a commit's conflict check against the versions
since its snapshot, a zombie's fence check). :func:`keep_from` decides the oldest version the
log must keep:

- the **readers**: the oldest version a registered reconcile cursor has not read yet
  (``version + 1`` of the slowest cursor under ``_cg_reconcile/``);
- a **floor** in time (:attr:`Maintenance.log_floor_s <cg_pipelines.sinks.maintenance.
  Maintenance.log_floor_s>`, one hour): every version committed since is kept;
- a **cap** (:attr:`Maintenance.log_max_versions <cg_pipelines.sinks.maintenance.
  Maintenance.log_max_versions>`): the readers and the floor never hold more than this many
  versions behind the newest one;
- **time travel**, a user's setting (:attr:`Maintenance.log_retention_hours
  <cg_pipelines.sinks.maintenance.Maintenance.log_retention_hours>`, off by default): every
  version younger than it is kept, whatever the cap.

**No cursor** (reconcile never ran on the table, or ``--restart`` deleted it): the log is held
up to the cap. A check that has not stored a cursor yet may still come (a first deployment's
schedule, a ``cg reconcile`` by hand), and holding the cap keeps every version it could read
while the table stays bounded by the same number; a check that starts beyond it (or a cursor
the cap overtook) fails with :class:`~cg_pipelines.engine.coverage_log.CoverageLogError`, as
before: rather than an unbounded log, an explicit "restart the cursor".

:func:`clean_log` then deletes, oldest first, the commit files, checkpoints and checksum /
compaction files of versions before the newest checkpoint at or before that version, through
the table's pyarrow filesystem (:func:`~cg_pipelines.sinks.storage.table_filesystem`).
delta-rs 1.6.6 cannot do it: ``DeltaTable.cleanup_metadata()`` takes no version and deletes
only entries older than ``delta.logRetentionDuration`` (it can be bounded by version only by
loading the table at that version, and never below the table property's age). The Delta
protocol's metadata cleanup ("Metadata Cleanup", PROTOCOL.md) is exactly this: keep the cut-off
checkpoint, its commit file and everything after it, delete what is before; loading any
version from the checkpoint on is unchanged (delta-rs and Spark start from the latest
checkpoint), time travel to the deleted versions is lost. A snapshot held at a deleted
version is still brought up to date (delta-rs rebuilds it from the checkpoint: checked on
1.6.6), while a commit from such a snapshot fails (``DeltaError: Invalid table version``, or
``File not found`` through the sink) and writes nothing, whatever application transaction it
carries (``tests/months/test_log_cut_fence.py``): the cut never lets a zombie's commit through,
so the cap is bounded by the reconcile check's slack, not by the fence (docs/growth.md, "The
log cap").
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Final

import pyarrow.fs as pafs

__all__ = ["LOG_DIR", "READERS_DIR", "LogListing", "clean_log", "keep_from", "list_log",
           "reader_versions"]

LOG_DIR: Final = "_delta_log"
READERS_DIR: Final = "_cg_reconcile"
"""Where the registered readers (the reconcile cursors) are stored, beside the table."""

_COMMIT = re.compile(r"^(\d{20})\.json$")
_CHECKPOINT = re.compile(r"^(\d{20})\.checkpoint(\.\d+\.\d+)?\.parquet$|^(\d{20})\.checkpoint\.")
_OTHER = re.compile(r"^(\d{20})\.(crc|(\d{20})\.compacted\.json)$")


@dataclass(frozen=True)
class LogListing:
    """One listing of ``_delta_log``: commit versions with their files' modification times
    (seconds), checkpoint versions, and every versioned file as ``(version, path)``."""

    commits: dict[int, float]
    checkpoints: list[int]
    files: list[tuple[int, str]]

    @property
    def newest(self) -> int:
        """The newest commit version (-1: none)."""
        return max(self.commits, default=-1)


def list_log(fs: pafs.FileSystem) -> LogListing:
    """List ``_delta_log`` once (on S3 every page of it)."""
    commits: dict[int, float] = {}
    checkpoints: set[int] = set()
    files: list[tuple[int, str]] = []
    for info in fs.get_file_info(pafs.FileSelector(LOG_DIR, allow_not_found=True)):
        name = info.base_name
        m = _COMMIT.match(name)
        if m:
            v = int(m.group(1))
            commits[v] = info.mtime.timestamp() if info.mtime is not None else time.time()
            files.append((v, info.path))
            continue
        m = _CHECKPOINT.match(name)
        if m:
            v = int(m.group(1) or m.group(3))
            checkpoints.add(v)
            files.append((v, info.path))
            continue
        m = _OTHER.match(name)
        if m:  # a compacted file counts as its last version
            files.append((int(m.group(3) or m.group(1)), info.path))
    return LogListing(commits, sorted(checkpoints), files)


def reader_versions(fs: pafs.FileSystem) -> list[int]:
    """The last version read of each reconcile cursor stored beside the table
    (``_cg_reconcile/*.json``); an unreadable cursor is no reader (its check fails on it
    anyway)."""
    out = []
    for info in fs.get_file_info(pafs.FileSelector(READERS_DIR, allow_not_found=True)):
        if info.type != pafs.FileType.File or not info.base_name.endswith(".json"):
            continue
        try:
            with fs.open_input_stream(info.path) as f:
                out.append(int(json.loads(f.read().decode("utf-8"))["version"]))
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            continue
    return out


def keep_from(listing: LogListing, readers: list[int], *, floor_s: float,
              max_versions: int | None, time_travel_s: float | None,
              now: float | None = None) -> int:
    """The oldest version whose log entry must stay (see the module docstring).

    Args:
        listing: the log's listing.
        readers: the last version read of each registered reader (:func:`reader_versions`).
        floor_s: versions committed less than this many seconds ago are kept.
        max_versions: the readers and the floor never hold more than this many versions
            (``None``: no cap).
        time_travel_s: versions younger than this are kept whatever the cap (``None``: off).
        now: the current time (default: ``time.time()``).
    """
    newest = listing.newest
    if newest < 0:
        return 0
    now = time.time() if now is None else now
    young = [v for v, t in listing.commits.items() if t >= now - floor_s]
    keep = min(young, default=newest)
    if readers:
        keep = min(keep, min(readers) + 1)
    elif max_versions is not None:  # no cursor: held up to the cap
        keep = 0
    if max_versions is not None:
        keep = max(keep, newest - max_versions + 1)
    if time_travel_s is not None:
        travel = [v for v, t in listing.commits.items() if t >= now - time_travel_s]
        keep = min(keep, min(travel, default=newest))
    return max(0, min(keep, newest))


def clean_log(fs: pafs.FileSystem, listing: LogListing, keep: int) -> int:
    """Delete the log files of versions before the newest checkpoint at or before ``keep``
    (oldest first; nothing when there is none). Returns how many were deleted."""
    cut = max((c for c in listing.checkpoints if c <= keep), default=None)
    if cut is None:
        return 0
    gone = 0
    for _v, path in sorted(f for f in listing.files if f[0] < cut):
        try:
            fs.delete_file(path)
        except FileNotFoundError:
            continue
        gone += 1
    return gone
