"""Each key's last row of one consumer-group partition of an append-mode table (Delta or
Iceberg), read in O(files committed since the last snapshot) instead of O(table history).

:class:`PartitionStates` keeps, per (key column, order column, partition), the state over a set
of covered data files in memory, starts from the stored snapshot
(:mod:`cg_pipelines.sinks.statesnapshot`) and catches up from the live files it does not cover
(:func:`cg_pipelines.core.statesnap.catch_up_files`). A covered file that is gone (rebuild,
unknown rewrite) makes it read the partition's live files whole once, exactly as before. After
a compaction it knows the commit's removed and added files
(:meth:`PartitionStates.after_rewrite`) and keeps its state. The sink's maintenance (or every
:data:`PERSIST_EVERY` caught-up files) writes the state back as the new snapshot.

The table format is behind :class:`StateView` (one snapshot of the table: its identity, the
partition's live files, a read of some of them): Delta's is
:class:`~cg_pipelines.sinks.deltastate.TableView`, Iceberg's
:class:`~cg_pipelines.sinks.iceberg_state.IcebergView`.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Final, Protocol

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from cg_pipelines.core.state import last_per_key
from cg_pipelines.core.statesnap import after_rewrite, catch_up_files
from cg_pipelines.sinks.statesnapshot import KeyedSnapshot, SnapshotStore

__all__ = ["PERSIST_EVERY", "PartitionStates", "StateView"]

PERSIST_EVERY: Final = 64
"""Caught-up data files after which a state read writes the snapshot itself (so a sink whose
maintenance never runs still reads at most this many files beyond the snapshot)."""


class StateView(Protocol):
    """What :class:`PartitionStates` needs of one table snapshot, whatever its format (Delta:
    :class:`~cg_pipelines.sinks.deltastate.TableView`; Iceberg:
    :class:`~cg_pipelines.sinks.iceberg_state.IcebergView`). Data file paths are opaque
    strings, unique per file and never reused (both formats name files with a UUID), as the
    format's metadata names them.

    """

    @property
    def table_id(self) -> str:
        """The table's identity (Delta metadata id, Iceberg table UUID): a table re-created at
        the same place never uses an old snapshot."""
        ...

    @property
    def version(self) -> int:
        """The snapshot's version (recorded in a stored snapshot, for people)."""
        ...

    def files(self, partition: int) -> list[tuple[str, int]] | None:
        """``(path, size in bytes)`` of ``partition``'s live data files, or None when the
        table is not partitioned by exactly
        :data:`~cg_pipelines.sinks.base.PARTITION_COLUMN` (no state snapshot)."""
        ...

    def read(self, files: Collection[str], columns: list[str]) -> pa.Table:
        """``columns`` of the rows of ``files`` (some of :meth:`files`' paths)."""
        ...


@dataclass
class _State:
    snap: KeyedSnapshot
    stored: frozenset[str] | None  # the files the stored snapshot covers (None: not stored)


class PartitionStates:
    """In-memory per-partition states of one table, backed by a :class:`SnapshotStore`.
    Thread-safe (one lock; partitions' runs do not share entries)."""

    def __init__(self, fs: pafs.FileSystem) -> None:
        self._store = SnapshotStore(fs)
        self._fs = fs
        self._lock = threading.Lock()
        self._mem: dict[tuple[str, str, int], _State] = {}
        self.files_read = 0  # data files read by state reads (a figure for tests and benches)
        self.full_reads = 0  # state reads that had to read the whole partition

    @property
    def store(self) -> SnapshotStore:
        return self._store

    def last_rows(self, view: StateView, key: str, keys: Sequence[object], columns: list[str],
                  order_by: str, partition: int) -> pa.Table | None:
        """The last row of each of ``keys`` in the snapshot ``view`` shows (``columns``), or
        None when the table is not partitioned by :data:`PARTITION_COLUMN` alone."""
        live = view.files(partition)
        if live is None:
            return None
        state = self._current(view, key, columns, order_by, partition, [p for p, _ in live])
        rows = state.snap.rows
        if not keys or rows.num_rows == 0:
            return rows.slice(0, 0)
        want = pa.array(list(keys)).cast(rows[key].type)
        return rows.filter(pc.is_in(rows[key], value_set=want))

    def _current(self, view: StateView, key: str, columns: list[str], order_by: str,
                 partition: int, live: list[str]) -> _State:
        ident = (key, order_by, int(partition))
        table_id = view.table_id
        with self._lock:
            state = self._mem.get(ident)
        if state is not None and (state.snap.table_id != table_id
                                  or state.snap.rows.column_names != columns):
            state = None
        if state is None:
            stored = self._store.read(key, order_by, columns, partition, table_id)
            if stored is not None:
                state = _State(stored, stored.covered)
        todo = catch_up_files(state.snap.covered, live) if state is not None else None
        if state is None or todo is None:
            self.full_reads += 1
            rows = last_per_key(self._read(view, live, columns), key, order_by)
            state = _State(KeyedSnapshot(rows, frozenset(live), table_id, view.version), None)
        elif todo:
            new = last_per_key(self._read(view, todo, columns), key, order_by)
            old = state.snap.rows
            rows = new if old.num_rows == 0 else last_per_key(
                pa.concat_tables([old, new.cast(old.schema)]), key, order_by)
            state = _State(KeyedSnapshot(rows, state.snap.covered | set(todo), table_id,
                                         view.version), state.stored)
        with self._lock:
            self._mem[ident] = state
        if state.stored is None or len(state.snap.covered - state.stored) >= PERSIST_EVERY:
            self._persist(ident, state)
        return state

    def _read(self, view: StateView, files: Collection[str], columns: list[str]) -> pa.Table:
        """``columns`` of the rows of ``files`` (data files of the snapshot ``view`` shows)."""
        self.files_read += len(files)
        return view.read(files, columns)

    def _persist(self, ident: tuple[str, str, int], state: _State) -> None:
        key, order_by, partition = ident
        self._store.write(state.snap, key, order_by, partition)
        with self._lock:
            if self._mem.get(ident) is state:
                self._mem[ident] = replace(state, stored=state.snap.covered)

    def persist(self, partition: int) -> int:
        """Write every in-memory state of ``partition`` whose covered files changed since it
        was stored. Returns the snapshots written.

        Raises:
            OSError / pyarrow errors: a snapshot could not be written.
        """
        with self._lock:
            todo = [(i, s) for i, s in self._mem.items()
                    if i[2] == int(partition) and s.stored != s.snap.covered]
        for ident, state in todo:
            self._persist(ident, state)
        return len(todo)

    def after_rewrite(self, partition: int, removed: Collection[str], added: Collection[str],
                      version: int) -> None:
        """A commit that kept every row (a compaction) replaced ``removed`` by ``added`` in
        ``partition``: keep the in-memory states that covered every removed file, forget the
        others (their next read starts from the table)."""
        with self._lock:
            for ident, state in list(self._mem.items()):
                if ident[2] != int(partition):
                    continue
                covered = after_rewrite(state.snap.covered, removed, added)
                if covered is None:
                    del self._mem[ident]
                else:
                    self._mem[ident] = _State(replace(state.snap, covered=covered,
                                                      version=version), state.stored)

    def forget(self, partition: int) -> None:
        """Drop the in-memory states of ``partition`` (the next read starts from the stored
        snapshot, or the table)."""
        with self._lock:
            for ident in [i for i in self._mem if i[2] == int(partition)]:
                del self._mem[ident]

    def load_stored(self, view: StateView, partition: int) -> int:
        """Load the stored snapshots of ``partition`` not in memory yet (every state spec a
        run of any process wrote), so :meth:`refresh` and a compaction carry them too.
        Returns how many were loaded."""
        table_id = view.table_id
        loaded = 0
        for key, order_by, columns in self._store.specs(partition):
            ident = (key, order_by, int(partition))
            with self._lock:
                if ident in self._mem:
                    continue
            snap = self._store.read(key, order_by, columns, partition, table_id)
            if snap is not None:
                with self._lock:
                    self._mem.setdefault(ident, _State(snap, snap.covered))
                loaded += 1
        return loaded

    def refresh(self, view: StateView, partition: int) -> int:
        """Catch every known state of ``partition`` up to the snapshot ``view`` shows.
        Returns how many."""
        live = view.files(partition)
        if live is None:
            return 0
        with self._lock:
            idents = [i for i in self._mem if i[2] == int(partition)]
        for key, order_by, p in idents:
            with self._lock:
                state = self._mem.get((key, order_by, p))
            if state is not None:
                self._current(view, key, state.snap.rows.column_names, order_by, p,
                              [path for path, _ in live])
        return len(idents)
