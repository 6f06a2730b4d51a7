"""Table maintenance of a :class:`~cg_pipelines.sinks.delta.DeltaSink`, run by the holder of a
partition's lease after its run's last commit (:meth:`DeltaMaintainer.maintain`, the engine's
optional ``maintain(partition, app_id)`` hook): what keeps a partition run's cost flat as the
table ages.

Per call, for the one consumer-group partition:

1. **State snapshots** of the partition are caught up to the latest version
   (:mod:`cg_pipelines.sinks.partstate`).
2. **Compaction** (anchor: Delta's auto-compaction, ``delta.autoOptimize.autoCompact``): when
   the partition has at least :attr:`Maintenance.compact_min_files` live files smaller than
   :attr:`Maintenance.target_size`, ``DeltaTable.optimize.compact(partition_filters=
   [("_partition", "=", p)], target_size=...)`` bin-packs them (append and merge tables). The
   commit rewrites files without changing rows (``dataChange = false``) and carries
   ``cg.operation = "compact"``; its removed/added files (read from its own log entry) carry
   the state snapshots over. A compaction that loses a commit race while the partition's
   watermark did not move (someone else's OPTIMIZE, say) is retried
   (:data:`COMPACT_ATTEMPTS` in all); when the watermark moved (a newer holder committed) it is
   given up (``compact = "fenced"``): the newer holder compacts after its own run.
   Live files per partition stay below ``compact_min_files`` small files plus one file per
   ``target_size`` bytes of the partition's data.
3. **Retention**, at most every :attr:`Maintenance.vacuum_interval_s` seconds per table (a
   marker ``_cg_state/_vacuum.json`` holds the last time): ``DeltaTable.vacuum(retention_hours=
   ..., dry_run=False, full=True)`` deletes files no version within the retention needs
   (delta-rs keeps every file the current version references and every file removed less than
   the retention ago; ``full`` also deletes unreferenced files older than the retention whose
   tombstones already left the checkpoints, which the default mode leaks; it never enters
   ``_``-directories such as ``_delta_log`` and ``_cg_state``).
4. **Log cleanup** (:mod:`cg_pipelines.sinks.logwindow`), every
   :attr:`Maintenance.log_cleanup_versions` versions (and at least every
   ``vacuum_interval_s``; a marker ``_cg_state/_log.json`` holds the version and time of the
   last one): the log keeps what its slowest registered reader (a reconcile cursor under
   ``_cg_reconcile/``) has not read, the versions of the last :attr:`Maintenance.log_floor_s`
   (one hour), at most :attr:`Maintenance.log_max_versions` of those (500), and the time
   travel a user asks for (:attr:`Maintenance.log_retention_hours`, off by default); without a
   cursor the log is held up to the cap. So ``_delta_log`` holds at most
   ``log_max_versions + log_cleanup_versions + delta.checkpointInterval`` commits (plus their
   checkpoints) whatever the table's age and commit rate, unless time travel is asked for.
   This is the only log cleanup: the sink's commits skip delta-rs' post-commit one (it lists
   the whole log, :data:`~cg_pipelines.sinks.deltawrite.COMMIT_HOOKS`). Time travel (and
   ``DeltaTable.history()`` lineage) is kept for the vacuum retention (data) and the log
   window (commit infos) respectively. VACUUM's two commits carry
   ``cg.operation = "vacuum"``.

Maintenance never changes a row or a watermark. Failures are returned as figures
(``error``), never raised into the run whose data is already committed.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from deltalake import CommitProperties, DeltaTable, PostCommitHookProperties
from deltalake.exceptions import CommitFailedError

from cg_pipelines.core.errors import ConfigError
from cg_pipelines.core.statesnap import needs_compaction
from cg_pipelines.core.write import Merge
from cg_pipelines.sinks.base import PARTITION_COLUMN
from cg_pipelines.sinks.deltahandle import DeltaHandle, txn
from cg_pipelines.sinks.deltastate import TableView
from cg_pipelines.sinks.deltawrite import COMMIT_HOOKS
from cg_pipelines.sinks.lineage import CommitLineage
from cg_pipelines.sinks.logwindow import clean_log, keep_from, list_log, reader_versions
from cg_pipelines.sinks.statesnapshot import STATE_DIR

if TYPE_CHECKING:
    from cg_pipelines.core.write import Append

__all__ = ["COMPACT_ATTEMPTS", "DeltaMaintainer", "Maintenance", "rewritten_files"]

COMPACT_ATTEMPTS: Final = 3
"""Compaction attempts when a commit race is lost while the watermark stays put."""

_VACUUM_MARKER: Final = f"{STATE_DIR}/_vacuum.json"
_LOG_MARKER: Final = f"{STATE_DIR}/_log.json"


@dataclass(frozen=True)
class Maintenance:
    """What :meth:`DeltaMaintainer.maintain` does (per group: the Dagster resource and
    ``DeltaSink(maintenance=...)`` take one).

    Attributes:
        compact: compact the partition's small files (default on).
        compact_min_files: small files (under ``target_size``) a partition may have before it
            is compacted (>= 2; default 16).
        target_size: bytes; the size compaction aims for (default 128 MiB).
        vacuum_retention_hours: keep unreferenced files this long (default 168 = 7 days,
            Delta's default ``delta.deletedFileRetentionDuration``); ``None``: never vacuum.
            Under 168 hours delta-rs' retention check is switched off for the call: readers
            older than the retention may then find files gone.
        vacuum_interval_s: seconds between two VACUUM + log cleanups of the table (default
            3,600: the cost is one listing of the table's files).
        snapshots: write the partitions' state snapshots (default on).
        log_cleanup: clean up the log window (the module docstring's 4.) in :meth:`maintain
            <DeltaMaintainer.maintain>` (default on), and never in a commit
            (:data:`~cg_pipelines.sinks.deltawrite.COMMIT_HOOKS`). Off: commits run delta-rs'
            default hooks, which clean up after each checkpoint (by
            ``delta.logRetentionDuration``) and list the whole log to do so.
        log_floor_s: seconds; versions committed this recently are kept (default 3,600: a
            held snapshot, a commit's conflict check and a zombie's fence read the versions
            since their snapshot), up to ``log_max_versions``. Not needed for the fence: a
            commit from a snapshot whose following versions were cleaned up fails and writes
            nothing (delta-rs 1.6.6, ``tests/months/test_log_cut_fence.py``); it spares a
            long run's commit that failure.
        log_max_versions: the most versions the readers (reconcile cursors) and the floor
            hold behind the newest (default 500; ``None``: no cap, then a stuck or
            abandoned cursor holds the log for ever). A cursor the cap overtakes fails its
            next check with :class:`~cg_pipelines.engine.coverage_log.CoverageLogError`
            (restart it): run the reconcile check at least every ``log_max_versions``
            commits of the table (500 commits: ~10 minutes at 70,000 commits a day, ten ticks
            of a 60-s reconcile sensor). A table committing more than this an hour sits at the
            cap, and on local disk every snapshot update and commit lists the whole log (~2 ms
            a listing at 1,100 entries): 500 rather than 1,000 took an aged append run from
            1.46x to 1.13-1.25x of a fresh one's (``bench/aging.py --library-retention``,
            three runs, docs/growth.md).
        log_cleanup_versions: the log is cleaned up once the table is this many versions past
            the last cleanup (default 100), and at least every ``vacuum_interval_s``.
        log_retention_hours: time travel and lineage (``DeltaTable.history()``) a user asks
            for: versions younger than this are kept, whatever the cap (default ``None``:
            none beyond the window above). Also the ``delta.logRetentionDuration`` of a table
            the sink creates (``None``: the larger of 168 = 7 days and
            ``vacuum_retention_hours``), which only other writers' cleanups (and delta-rs'
            own with ``log_cleanup=False``) go by. When set, it must be >=
            ``vacuum_retention_hours``: time travel to a version needs its log entries as well
            as its data files.
        tombstone_retention_hours: hours; ``delta.deletedFileRetentionDuration`` of a table
            the sink creates (default ``None``: :meth:`tombstone_retention`, the log window's
            reach: ``log_retention_hours`` when set, else the floor, one hour; see below).

    A table the sink creates also gets ``delta.deletedFileRetentionDuration`` =
    :meth:`tombstone_retention`: how long removed files stay listed (as tombstones) in every
    checkpoint, so what every checkpoint write and snapshot load carries (one tombstone per
    file a commit removes: about one per commit on a merge table, and on an append table once
    compaction removes what the commits added). The default is the reach of the log window,
    not Delta's 7 days: a reader can only time-travel to a version the log still holds (the
    last hour, at most ``log_max_versions`` versions, unless ``log_retention_hours`` asks for
    more), and VACUUM (``full``) protects a removed file for the tombstone retention after its
    removal (and until the next checkpoint: delta-rs 1.6.6 keeps every tombstone of the
    commits since) and for ``vacuum_retention_hours`` after it was written
    (``tests/months/test_maintenance_settings.py``). What it gives up: a scan
    of a snapshot older than the window (a time travel past the log, a query running longer
    than an hour) may find a file gone that was written more than ``vacuum_retention_hours``
    ago and removed more than an hour ago; another engine's VACUUM run without an explicit
    retention (Spark, delta-rs' ``vacuum()``) goes by this property too. What it saves: at 7
    days a table committing 70,000 times a day carries ~490,000 tombstones in each checkpoint
    (written every ``delta.checkpointInterval`` commits, read by every snapshot load), at one
    hour ~2,900; ``bench/aging.py`` measured a checkpoint of 10,000 tombstones (880 KiB) at
    ~0.1 s to write, against a few ms without them (docs/growth.md). Existing tables keep
    their properties (change them with ``DeltaTable.alter.set_table_properties`` while no run
    commits).

    Raises:
        ConfigError: bad numbers.
    """

    compact: bool = True
    compact_min_files: int = 16
    target_size: int = 128 * 1024 * 1024
    vacuum_retention_hours: int | None = 168
    vacuum_interval_s: float = 3600.0
    snapshots: bool = True
    log_cleanup: bool = True
    log_retention_hours: float | None = None
    log_floor_s: float = 3600.0
    log_max_versions: int | None = 500
    log_cleanup_versions: int = 100
    tombstone_retention_hours: float | None = None

    def __post_init__(self) -> None:
        if self.compact_min_files < 2:
            raise ConfigError("compact_min_files", f"must be >= 2, got {self.compact_min_files}")
        if self.target_size < 1:
            raise ConfigError("target_size", f"must be >= 1 byte, got {self.target_size}")
        if self.vacuum_retention_hours is not None and self.vacuum_retention_hours < 0:
            raise ConfigError("vacuum_retention_hours", "must be >= 0 (or None: never vacuum)")
        if self.vacuum_interval_s < 0:
            raise ConfigError("vacuum_interval_s", "must be >= 0 seconds")
        if self.log_retention_hours is not None and self.log_retention_hours <= 0:
            raise ConfigError("log_retention_hours",
                              "must be > 0 (or None: the larger of 168 h and the vacuum retention)")
        if self.log_retention_hours is not None and self.vacuum_retention_hours is not None \
                and self.log_retention_hours < self.vacuum_retention_hours:
            raise ConfigError(
                "log_retention_hours",
                f"must be >= vacuum_retention_hours ({self.vacuum_retention_hours}), got "
                f"{self.log_retention_hours}: time travel within the vacuum retention needs the "
                "log entries of those versions")

        if self.log_floor_s < 0:
            raise ConfigError("log_floor_s", f"must be >= 0 seconds, got {self.log_floor_s}")
        if self.log_max_versions is not None and self.log_max_versions < 1:
            raise ConfigError("log_max_versions",
                              f"must be >= 1 (or None: no cap), got {self.log_max_versions}")
        if self.tombstone_retention_hours is not None and self.tombstone_retention_hours < 0:
            raise ConfigError("tombstone_retention_hours",
                              "must be >= 0 (or None: the vacuum retention)")
        if self.log_cleanup_versions < 1:
            raise ConfigError("log_cleanup_versions",
                              f"must be >= 1, got {self.log_cleanup_versions}")

    def table_properties(self) -> dict[str, str]:
        """Delta table properties for a table created under this policy (see above)."""
        props = {"delta.deletedFileRetentionDuration":
                 f"interval {round(self.tombstone_retention() * 3600)} seconds"}
        props["delta.logRetentionDuration"] = \
            f"interval {max(1, round(self.log_retention() * 3600))} seconds"
        return props

    def tombstone_retention(self) -> float:
        """Hours: ``tombstone_retention_hours``, else ``log_retention_hours`` when set (time
        travel that far needs the files removed since), else the log window's floor
        (``log_floor_s``, one hour), or ``vacuum_retention_hours`` when that is shorter."""
        if self.tombstone_retention_hours is not None:
            return self.tombstone_retention_hours
        if self.log_retention_hours is not None:
            return self.log_retention_hours
        floor = self.log_floor_s / 3600
        if self.vacuum_retention_hours is not None:
            return min(float(self.vacuum_retention_hours), floor)
        return floor

    def log_retention(self) -> float:
        """Hours: ``log_retention_hours``, else the larger of 168 and
        ``vacuum_retention_hours``."""
        if self.log_retention_hours is not None:
            return self.log_retention_hours
        return float(max(168, self.vacuum_retention_hours or 0))

    def commit_hooks(self) -> PostCommitHookProperties | None:
        """delta-rs post-commit hooks of the sink's commits: :data:`~cg_pipelines.sinks.
        deltawrite.COMMIT_HOOKS` (no expired-log cleanup) with ``log_cleanup``, else
        ``None`` (delta-rs' defaults)."""
        return COMMIT_HOOKS if self.log_cleanup else None

    @classmethod
    def off(cls) -> Maintenance:
        """No compaction, no vacuum, no snapshot writes, no log cleanup of its own (commits
        then clean up the log as delta-rs does by default)."""
        return cls(compact=False, vacuum_retention_hours=None, snapshots=False,
                   log_cleanup=False)


def rewritten_files(entry: str, partition: int) -> tuple[list[str], list[str]] | None:
    """``(removed, added)`` data file paths of ``partition`` in one Delta log entry (JSON
    lines), or None when the entry changes data (an ``add``/``remove`` with
    ``dataChange = true``): only a pure rewrite (a compaction) keeps a snapshot's rows."""
    removed: list[str] = []
    added: list[str] = []
    for line in entry.splitlines():
        if not line.strip():
            continue
        action = json.loads(line)
        for kind, into in (("remove", removed), ("add", added)):
            a = action.get(kind)
            if a is None:
                continue
            if a.get("dataChange", True):
                return None
            values = a.get("partitionValues") or {}
            if str(values.get(PARTITION_COLUMN)) == str(int(partition)):
                into.append(a["path"])
    return removed, added


class DeltaMaintainer:
    """The maintenance part of a :class:`~cg_pipelines.sinks.delta.DeltaSink` (see the module
    docstring), over the sink's :class:`~cg_pipelines.sinks.deltahandle.DeltaHandle`."""

    def __init__(self, handle: DeltaHandle, policy: Maintenance, write: Append | Merge,
                 lineage: CommitLineage) -> None:
        """
        Args:
            handle: the sink's table handle. policy: what :meth:`maintain` does.
            write: the sink's write mode (state snapshots are kept for append tables only).
            lineage: the commit info of the compaction and VACUUM commits.
        """
        self._t = handle
        self.policy = policy
        self._write = write
        self._lineage = lineage
        self._vacuumed_at: float | None = None

    def maintain(self, partition: int, app_id: str) -> dict[str, int | float | str]:
        """:meth:`DeltaSink.maintain <cg_pipelines.sinks.delta.DeltaSink.maintain>`."""
        t0 = time.monotonic()
        pol = self.policy
        out: dict[str, int | float | str] = {"compact": "no", "vacuum": "no"}
        try:
            with self._t.guard():
                self._maintain(partition, app_id, pol, out)
        except Exception as e:  # reported, the run's data is committed
            out["error"] = f"{type(e).__name__}: {e}"[:500]
        out["maintain_s"] = round(time.monotonic() - t0, 3)
        return out

    def _maintain(self, partition: int, app_id: str, pol: Maintenance,
                  out: dict[str, int | float | str]) -> None:
        states = self._t.partition_states() if pol.snapshots else None
        view = self._t.end_run(app_id)
        if view is None:
            return
        if states is not None and not isinstance(self._write, Merge):
            states.load_stored(view, partition)
            states.refresh(view, partition)
        live = view.files(partition)
        if live is None:
            out["files_live"] = -1
        elif pol.compact and needs_compaction([s for _, s in live], pol.compact_min_files,
                                              pol.target_size):
            self._compact(partition, app_id, pol, out)
            dt = self._t.load()
            if dt is not None:
                live = TableView.of(dt, self._t.filesystem()).files(partition)
        if live is not None:
            out["files_live"] = len(live)
        if states is not None:
            out["snapshots_written"] = states.persist(partition)
        if (pol.vacuum_retention_hours is not None or pol.log_cleanup) \
                and self._vacuum_due(pol):
            self._vacuum(app_id, pol, out)
        if pol.log_cleanup and self._t.filesystem() is not None and self._log_due(pol, view):
            self._clean_log(pol, out)

    def _compact(self, partition: int, app_id: str, pol: Maintenance,
                 out: dict[str, int | float | str]) -> None:
        for attempt in range(COMPACT_ATTEMPTS):
            dt = self._t.load()
            if dt is None:
                return
            watermark = txn(dt, app_id)
            props = CommitProperties(custom_metadata=self._lineage.commit(
                app_id, watermark, "compact", {"partition": partition}))
            try:
                metrics = dt.optimize.compact(
                    partition_filters=[(PARTITION_COLUMN, "=", str(int(partition)))],
                    target_size=pol.target_size, commit_properties=props,
                    post_commithook_properties=pol.commit_hooks())
            except CommitFailedError:
                fresh = self._t.load()
                if fresh is None or txn(fresh, app_id) != watermark:
                    out["compact"] = "fenced"
                    return
                out["compact_retries"] = attempt + 1
                continue
            out["compact"] = "done"
            out["files_compacted"] = int(metrics.get("numFilesRemoved", 0))
            out["files_added"] = int(metrics.get("numFilesAdded", 0))
            if metrics.get("numFilesRemoved", 0):
                self._carry_states(dt, partition)
            return
        out["compact"] = "failed"

    def _carry_states(self, dt: DeltaTable, partition: int) -> None:
        """Tell the state snapshots which files the compaction commit (``dt``'s version)
        replaced by which."""
        states = self._t.states_made
        fs = self._t.filesystem()
        if states is None or fs is None:
            return
        version = dt.version()
        with fs.open_input_stream(f"_delta_log/{version:020d}.json") as f:
            entry = f.read().decode()
        got = rewritten_files(entry, partition)
        if got is None:
            states.forget(partition)
        else:
            states.after_rewrite(partition, got[0], got[1], version)

    def _vacuum_due(self, pol: Maintenance) -> bool:
        fs = self._t.filesystem()
        if fs is None:  # no marker without a native filesystem: this sink object's own clock
            last_here = self._vacuumed_at
            return last_here is None or time.time() - last_here >= pol.vacuum_interval_s
        try:
            with fs.open_input_stream(_VACUUM_MARKER) as f:
                last = float(json.loads(f.read())["at"])
        except (FileNotFoundError, ValueError, KeyError, OSError):
            return True
        return time.time() - last >= pol.vacuum_interval_s

    def _vacuum(self, app_id: str, pol: Maintenance, out: dict[str, int | float | str]) -> None:
        dt = self._t.load()
        if dt is None:
            return
        fs = self._t.filesystem()
        self._vacuumed_at = time.time()
        if fs is not None:  # first: a slow vacuum is not started again by every run meanwhile
            fs.create_dir(STATE_DIR, recursive=True)
            with fs.open_output_stream(_VACUUM_MARKER) as f:
                f.write(json.dumps({"at": time.time()}).encode())
        if pol.vacuum_retention_hours is not None:
            props = CommitProperties(custom_metadata=self._lineage.commit(
                app_id, txn(dt, app_id), "vacuum", None))
            # full=True: also files whose tombstones already left the checkpoints (after
            # delta.deletedFileRetentionDuration), which the default "lite" mode never deletes
            # (checked on 1.6.6); files still tombstoned are kept for the retention as in lite
            # mode.
            gone = dt.vacuum(retention_hours=pol.vacuum_retention_hours, dry_run=False,
                             enforce_retention_duration=pol.vacuum_retention_hours >= 168,
                             commit_properties=props,
                             post_commithook_properties=pol.commit_hooks(), full=True)
            out["vacuum"] = "done"
            out["files_vacuumed"] = len(gone)
        if pol.log_cleanup and fs is None:
            # delta-rs' own filesystem handler (no native one): its cleanup, by the table's
            # delta.logRetentionDuration (the reader-bounded window needs the native one)
            dt.cleanup_metadata()
            out["log_cleanup"] = "done"

    def _log_due(self, pol: Maintenance, view: TableView) -> bool:
        """Whether the log window is due a cleanup: ``log_cleanup_versions`` versions or
        ``vacuum_interval_s`` seconds past the last one (the marker)."""
        fs = self._t.filesystem()
        assert fs is not None
        try:
            with fs.open_input_stream(_LOG_MARKER) as f:
                last = json.loads(f.read())
            version, at = int(last["version"]), float(last["at"])
        except (FileNotFoundError, ValueError, KeyError, TypeError, OSError):
            return True
        return view.version - version >= pol.log_cleanup_versions \
            or time.time() - at >= pol.vacuum_interval_s

    def _clean_log(self, pol: Maintenance, out: dict[str, int | float | str]) -> None:
        """One cleanup of the log window (:mod:`cg_pipelines.sinks.logwindow`): one listing
        of ``_delta_log`` and one of ``_cg_reconcile``, then the deletions."""
        fs = self._t.filesystem()
        assert fs is not None
        listing = list_log(fs)
        fs.create_dir(STATE_DIR, recursive=True)
        with fs.open_output_stream(_LOG_MARKER) as f:  # first, as the VACUUM marker
            f.write(json.dumps({"version": listing.newest, "at": time.time()}).encode())
        keep = keep_from(listing, reader_versions(fs), floor_s=pol.log_floor_s,
                         max_versions=pol.log_max_versions,
                         time_travel_s=None if pol.log_retention_hours is None
                         else pol.log_retention_hours * 3600)
        out["log_files_deleted"] = clean_log(fs, listing, keep)
        out["log_keep_from"] = keep
        out["log_cleanup"] = "done"
