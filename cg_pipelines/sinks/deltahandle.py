"""The one object a :class:`~cg_pipelines.sinks.delta.DeltaSink` owns and its parts share: the
table's location and storage options, its native pyarrow filesystem, the delta-rs snapshots
(one per app id for fencing, one shared reader snapshot, each run's view) and the locks that
guard them.

The sink is composed of three parts that hold this object, none of which knows the others:
:class:`~cg_pipelines.sinks.deltaread.DeltaReader` (reads),
:class:`~cg_pipelines.sinks.deltacommit.DeltaWriter` (fenced commits) and
:class:`~cg_pipelines.sinks.maintenance.DeltaMaintainer` (upkeep).

Snapshots are loaded with ``DeltaTable(uri, storage_options=...)`` and brought up to date with
``update_incremental()``, or loaded afresh once :data:`SNAPSHOT_RELOAD_VERSIONS` versions past
their last fresh load.
"""

from __future__ import annotations

import functools
import threading
import weakref
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Final

import pyarrow.fs as pafs
from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError

from cg_pipelines.sinks.base import FenceConflictError
from cg_pipelines.sinks.deltastate import TableView
from cg_pipelines.sinks.partstate import PartitionStates
from cg_pipelines.sinks.storage import safe_uri, scrubbed, table_filesystem

if TYPE_CHECKING:
    from collections.abc import Iterable

    import pyarrow.dataset as pads  # imports pandas: annotations only

__all__ = ["SNAPSHOT_RELOAD_VERSIONS", "DeltaHandle", "txn"]

SNAPSHOT_RELOAD_VERSIONS: Final = 20
"""A snapshot the sink holds (per app id for fencing, and the reader's) is loaded afresh, not
``update_incremental()``-ed, once it is this many versions past its last fresh load. Measured on
delta-rs 1.6.6 (local disk): a commit through a held ``DeltaTable`` gets slower with every
version it has applied since it was loaded (2.5 ms right after a load, 16 ms 110 versions
later, 67 ms 810 versions later; a fresh load, which starts from the latest checkpoint, took
9 ms there), whatever the table's age. 20 keeps that overhead near 1 ms for a fresh load's
cost every 20 versions."""


_TXNS: dict[int, tuple[weakref.ref[DeltaTable], int, dict[str, int]]] = {}
"""By snapshot object (its ``id``, a weak reference to it): its version and the transaction
versions known at it; an entry goes with its snapshot. delta-rs's ``transaction_version`` takes
about 0.3 ms a call (deltalake 1.6.6) and a run over 32 partitions asks for 32 per commit; a
snapshot's transactions at one version never change. (A ``DeltaTable`` is not hashable.)"""
_TXNS_LOCK = threading.RLock()  # reentrant: a weakref callback may run under it (GC)


def _forget(key: int, ref: weakref.ref[DeltaTable]) -> None:
    with _TXNS_LOCK:
        got = _TXNS.get(key)
        if got is not None and got[0] is ref:
            del _TXNS[key]


def txn(dt: DeltaTable | None, app_id: str) -> int:
    """The application transaction version of ``app_id`` in snapshot ``dt`` (0 if none, or
    no table), asked of delta-rs (raises its ``DeltaError`` when the log window cut ``dt``'s
    versions: :func:`~cg_pipelines.sinks.deltawrite.cut_snapshot`)."""
    if dt is None:
        return 0
    return dt.transaction_version(app_id) or 0


def known_txn(dt: DeltaTable | None, app_id: str) -> int:
    """:func:`txn`, remembered per snapshot version (:func:`known_txns`): a remembered value
    does not ask delta-rs, so it does not find out that ``dt`` was cut; only a caller whose
    write handles a cut snapshot uses it (``DeltaWriter.commit``)."""
    if dt is None:
        return 0
    version = dt.version()
    with _TXNS_LOCK:
        got = _TXNS.get(id(dt))
        if got is not None and got[0]() is dt and got[1] == version and app_id in got[2]:
            return got[2][app_id]
    found = txn(dt, app_id)
    known_txns(dt, version, {app_id: found})
    return found


def known_txns(dt: DeltaTable, version: int, found: dict[str, int]) -> None:
    """Remember that snapshot ``dt`` at ``version`` holds the transaction versions ``found``
    (e.g. those its own commit of ``version`` just wrote); ignored once ``dt`` is at another
    version."""
    if dt.version() != version:
        return
    key = id(dt)
    with _TXNS_LOCK:
        got = _TXNS.get(key)
        if got is None or got[0]() is not dt or got[1] != version:
            ref = got[0] if got is not None and got[0]() is dt else weakref.ref(
                dt, functools.partial(_forget, key))
            got = _TXNS[key] = (ref, version, {})
        got[2].update(found)


class DeltaHandle:
    """A Delta table's location, filesystem, snapshots and locks (see the module docstring).

    Thread-safe: ``lock`` guards the maps below; each app id's :meth:`app_lock` serializes
    its watermark read, commits and upkeep; ``read_lock`` the shared reader snapshot.
    """

    def __init__(self, uri: str, options: dict[str, str]) -> None:
        """
        Args:
            uri: the table root (local directory or ``s3://bucket/path``).
            options: delta-rs object store options (secret values are scrubbed from errors
                raised under :meth:`guard`).
        """
        self.uri = uri
        self.options = options
        self.lock = threading.Lock()
        self.read_lock = threading.Lock()
        # app id -> the snapshot its next commit is fenced against (None: no table then),
        # and the version it was last loaded afresh at (see caught_up).
        self._snapshots: dict[str, tuple[DeltaTable | None, int]] = {}
        self._app_locks: dict[str, threading.Lock] = {}
        # app id -> the view of its run's snapshot (see run_view): present from a watermark
        # read to the run's upkeep; None until a state read takes it.
        self._views: dict[str, TableView | None] = {}
        # app id -> the version of the last commit that carried its fence and the app id whose
        # snapshot it was made from, from the commit to its run's upkeep (see end_run)
        self._committed: dict[str, tuple[int, str]] = {}
        self._latest_view: TableView | None = None
        self._reader: DeltaTable | None = None
        self._reader_base = -1
        self._fs: pafs.FileSystem | None = None
        self._states: PartitionStates | None = None
        self._names: list[str] = []

    # ---------------------------------------------------------------- loading

    def load(self) -> DeltaTable | None:
        """A fresh snapshot of the latest version, or None if there is no table."""
        try:
            return DeltaTable(self.uri, storage_options=self.options or None)
        except TableNotFoundError:
            return None

    def fresh(self) -> tuple[DeltaTable | None, int]:
        """A fresh snapshot of the latest version and its version (None and -1: no table)."""
        dt = self.load()
        return dt, dt.version() if dt is not None else -1

    @staticmethod
    def stale(dt: DeltaTable | None, base: int) -> bool:
        """Whether held snapshot ``dt`` is :data:`SNAPSHOT_RELOAD_VERSIONS` versions past
        ``base``, the version of its last fresh load."""
        return dt is not None and dt.version() - base >= SNAPSHOT_RELOAD_VERSIONS

    def caught_up(self, dt: DeltaTable | None, base: int) -> tuple[DeltaTable | None, int]:
        """Held snapshot ``dt``, last loaded afresh at version ``base``, brought up to the
        latest version: ``(snapshot, base)``. ``update_incremental()``, or a fresh load when
        there is none yet or it is :data:`SNAPSHOT_RELOAD_VERSIONS` versions past ``base``.
        A base of -1 means "no table at the last load"."""
        if dt is not None and not self.stale(dt, base):
            dt.update_incremental()
            return dt, base
        return self.fresh()

    def filesystem(self) -> pafs.FileSystem | None:
        """A native pyarrow filesystem rooted at the table, or None (delta-rs' handler); see
        :func:`~cg_pipelines.sinks.storage.table_filesystem` (cached once found)."""
        if self._fs is None:
            self._fs = table_filesystem(self.uri, self.options)
        return self._fs

    def safe_uri(self) -> str:
        """The URI without any user:password part."""
        return safe_uri(self.uri)

    def guard(self) -> AbstractContextManager[None]:
        """Re-raise errors whose message contains a secret option value, scrubbed
        (:class:`FenceConflictError` unchanged)."""
        return scrubbed(self.options, keep=(FenceConflictError,))

    def column_names(self) -> list[str]:
        """Column names of the table (empty while it does not exist; cached once known)."""
        if not self._names:
            with self.guard():
                dt = self.load()
            self._names = [f.name for f in dt.schema().fields] if dt is not None else []
        return self._names

    def partition_states(self) -> PartitionStates | None:
        """The table's state snapshots (None without a native pyarrow filesystem)."""
        if self._states is None:
            fs = self.filesystem()
            self._states = PartitionStates(fs) if fs is not None else None
        return self._states

    @property
    def states_made(self) -> PartitionStates | None:
        """The state snapshots if a read or upkeep made them (:meth:`partition_states`),
        else None."""
        return self._states

    # ---------------------------------------------------------------- the shared reader

    def latest(self) -> DeltaTable | None:
        """The shared reader snapshot brought up to the latest version (None: no table).
        Call with :attr:`read_lock` held."""
        self._reader, self._reader_base = self.caught_up(self._reader, self._reader_base)
        return self._reader

    def latest_view(self) -> TableView | None:
        """A view of the shared reader snapshot brought up to the latest version (None: no
        table), its dataset made at once (under the read lock: the reader snapshot is shared
        and moves)."""
        with self.read_lock:
            dt = self.latest()
            if dt is None:
                return None
            cached = self._latest_view
            if cached is not None and cached.version == dt.version() \
                    and cached.table_id == str(dt.metadata().id):
                return cached  # e.g. the upkeep of each side of a run over many partitions
            view = TableView.of(dt, self.filesystem())
            _ = view.dataset  # made now, while the shared snapshot cannot move
            self._latest_view = view
            return view

    # ---------------------------------------------------------------- per app id

    def app_lock(self, app_id: str) -> threading.Lock:
        """The lock of ``app_id``'s snapshot (created on first use)."""
        with self.lock:
            lock = self._app_locks.get(app_id)
            if lock is None:
                lock = self._app_locks[app_id] = threading.Lock()
            return lock

    def held(self, app_id: str) -> tuple[bool, DeltaTable | None, int]:
        """``(remembered, snapshot, base)`` of ``app_id``: whether a snapshot is remembered,
        the snapshot its next commit is fenced against (None: no table then, or none
        remembered) and the version it was last loaded afresh at (-1: none)."""
        with self.lock:
            got = self._snapshots.get(app_id)
        return (False, None, -1) if got is None else (True, *got)

    def hold(self, app_id: str, dt: DeltaTable | None, base: int, *,
             run_starts: bool = False) -> None:
        """Remember ``dt`` (last loaded afresh at ``base``) as ``app_id``'s snapshot; with
        ``run_starts`` a run of ``app_id`` is on from now (see :meth:`run_view`)."""
        with self.lock:
            self._snapshots[app_id] = (dt, base)
            if run_starts:
                self._views[app_id] = None

    def release(self, app_id: str) -> None:
        """Forget ``app_id``'s snapshot and end its run (after a replace)."""
        with self.lock:
            self._snapshots.pop(app_id, None)
            self._views.pop(app_id, None)
            self._committed.pop(app_id, None)

    def wrote(self, app_ids: Iterable[str], version: int, carrier: str | None = None) -> None:
        """Version ``version`` was committed with the fences of ``app_ids`` (a commit of a run
        over several partitions carries one per partition) from the snapshot of ``carrier``
        (the first app id by default), the only one advanced to it (see :meth:`end_run`)."""
        with self.lock:
            for a in app_ids:
                prev = self._committed.get(a)
                if prev is None or version >= prev[0]:
                    self._committed[a] = (version, carrier or a)

    def _run_dataset(self, app_id: str) -> pads.Dataset | None:
        """The dataset of ``app_id``'s run snapshot as it is now (under its lock: not in the
        middle of a commit); None without a native filesystem or a snapshot."""
        fs = self.filesystem()
        with self.app_lock(app_id):
            _, dt, _ = self.held(app_id)
            return dt.to_pyarrow_dataset(filesystem=fs) if dt is not None and fs else None

    def run_view(self, app_id: str | None) -> TableView | None:
        """The view of the snapshot the run of ``app_id`` reads its state from, or None (no
        run of ``app_id`` on in this sink, no table yet, or ``app_id`` None).

        A run is on from its watermark read (:meth:`hold` with ``run_starts``) to its upkeep
        (:meth:`end_run`) or a replace (:meth:`release`). The view is taken once, by the
        run's first state read, of the snapshot that read loaded as the run's commits
        advanced it (under ``app_id``'s lock, so never in the middle of a commit), and then
        serves every state read of the run with no reload; its dataset, made only when a read
        must read data files, is taken under that lock too (the files the view names are
        still in the snapshot: nothing rewrites the partition's files during its run). Exact
        under the engine's contract (:meth:`~cg_pipelines.sinks.base.TableSink.last_rows`): every
        commit of the partition before the watermark read is in it, and the run's own later
        commits hold none of the keys asked for. What it saves: each delta-rs snapshot update
        lists ``_delta_log`` (on local disk the whole directory, whose entries grow with the
        log window)."""
        if app_id is None:
            return None
        with self.lock:
            if app_id not in self._views:
                return None
            view = self._views[app_id]
        if view is not None:
            return view
        with self.app_lock(app_id):
            with self.lock:
                if app_id not in self._views:
                    return None
                view = self._views[app_id]
                dt = self._snapshots.get(app_id, (None, -1))[0]
            if view is None and dt is not None:
                view = TableView.of(dt, self.filesystem(), lambda: self._run_dataset(app_id))
                with self.lock:
                    if app_id in self._views:
                        self._views[app_id] = view
            return view

    def end_run(self, app_id: str) -> TableView | None:
        """End ``app_id``'s run (see :meth:`run_view`) and return the snapshot its upkeep
        works on: during a run, the snapshot its watermark read loaded as its commits
        advanced it, with no reload (the upkeep comes after the run's last commit, under its
        lease), when it holds the last commit that carried ``app_id``'s fence, or else the
        snapshot that commit was made from when it holds it (a side of a run over several
        partitions: their commits advance only the first side's snapshot, see :meth:`wrote`);
        else the latest version. None: no table."""
        with self.lock:
            on = app_id in self._views
            self._views.pop(app_id, None)
            committed, carrier = self._committed.pop(app_id, (-1, app_id))
        if on:
            for holder in dict.fromkeys((app_id, carrier)):  # its own first
                with self.app_lock(holder):
                    _, dt, _ = self.held(holder)
                    if dt is not None and dt.version() >= committed:
                        return TableView.of(dt, self.filesystem())
        return self.latest_view()
