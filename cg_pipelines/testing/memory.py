"""An in-memory table sink for users' tests: :class:`MemorySink` keeps the committed rows and
watermarks in the Python process and honours the sink contract
(:class:`~cg_pipelines.sinks.base.TableSink`) the way the table sinks do — the same fence (a
stale expected watermark raises :class:`~cg_pipelines.sinks.base.FenceConflictError` and
writes nothing), markers, per-key state reads, write modes and partition replaces — so a
transform, a processor or a whole run (:func:`~cg_pipelines.engine.runner.run_partition`) can
be tested without a table. It is checked against the Delta and Iceberg sinks by the same
conformance suite (``tests/sinks/test_conformance.py``).

Beyond the contract it records every commit (:attr:`MemorySink.commits`, a list of
:class:`MemoryCommit`: what a test asserts on, like a list sink collects values) and hands the
current rows over whole (:meth:`MemorySink.rows`).

The table's columns are those of the first commit (or ``schema``), every one nullable (as an
Iceberg table's); later rows are fitted to them (the same columns, cast to their types).
What it does not do: persist anything (the table lives as long as the object; two holders of
one partition share one object), store types differently than given (Delta truncates
nanosecond timestamps to microseconds; here rows keep their Arrow types), or maintain (it is
no :class:`~cg_pipelines.sinks.base.MaintainedSink`).

Units: watermarks and versions are stream sequences (``int``; 0: nothing committed); a table
version is the number of commits so far.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import pyarrow as pa
import pyarrow.compute as pc

from cg_pipelines.core.errors import ColumnNotFoundError, ContractError, StateError, UsageError
from cg_pipelines.core.state import last_per_key
from cg_pipelines.core.write import DELETE_COLUMN, Append, Merge
from cg_pipelines.sinks.base import (
    PARTITION_COLUMN,
    FenceConflictError,
    Fences,
    TableStats,
    check_fences,
)
from cg_pipelines.sinks.rows import conform, current_of

__all__ = ["MemoryCommit", "MemorySink"]


@dataclass(frozen=True)
class MemoryCommit:
    """One commit a :class:`MemorySink` took.

    Attributes:
        version: the table version it made (1 for the first commit).
        operation: ``"append"``, ``"merge"``, ``"empty"`` (watermarks only) or
            ``"replace_partition"``.
        rows: the rows as given (a commit's batch; a replace's rows after the Merge
            reduction), or None for an empty commit.
        watermarks: every watermark the commit left, ``{app id: version}`` (the fences'
            versions, or a replace's kept ones).
        markers: the unfenced ``{key: version}`` pairs it recorded.
        lineage: the lineage it was given (``{}`` when none).
    """

    version: int
    operation: str
    rows: pa.Table | None
    watermarks: dict[str, int]
    markers: dict[str, int]
    lineage: dict[str, object] = field(default_factory=dict)


class MemorySink:
    """A :class:`~cg_pipelines.sinks.base.TableSink` over a table held in memory (see the
    module docstring). Thread-safe: every call runs under one lock, so a commit's fence check
    and its write are one step.

    Errors: :class:`~cg_pipelines.sinks.base.FenceConflictError` when a watermark moved;
    ``UsageError`` for bad fences or a first commit with no schema; ``ContractError`` for rows
    that do not fit the table; ``StateError`` when :meth:`stats` or :meth:`replace_partition`
    find no table (nothing committed yet).
    """

    table_format: ClassVar[str] = "memory"
    """The table format (Dagster's ``dagster/storage_kind``)."""

    def __init__(self, name: str = "table", *, schema: pa.Schema | None = None,
                 write: Append | Merge | None = None) -> None:
        """
        Args:
            name: the table's name (its :attr:`uri` is ``memory:<name>``).
            schema: the table's schema when the first commit carries no rows (otherwise the
                first batch's schema is the table's).
            write: :class:`~cg_pipelines.core.write.Append` (default) or
                :class:`~cg_pipelines.core.write.Merge` (each key's last row, matched within
                its consumer-group partition, as the table sinks do).

        Raises:
            UsageError: ``write`` is not Append/Merge/None.
        """
        if write is not None and not isinstance(write, (Append, Merge)):
            raise UsageError(f"write must be Append() or Merge(key=...), got {write!r}")
        self._name = name
        self._schema = schema
        self._write: Append | Merge = write if write is not None else Append()
        self._lock = threading.Lock()
        self._table: pa.Table | None = None
        self._marks: dict[str, int] = {}
        self._commits: list[MemoryCommit] = []
        self._last_rows_written: int | None = None

    def __repr__(self) -> str:
        return f"MemorySink({self._name!r}, write={self._write!r})"

    # ---------------------------------------------------------------- properties

    @property
    def uri(self) -> str:
        """``memory:<name>``."""
        return f"memory:{self._name}"

    @property
    def write(self) -> Append | Merge:
        """The write mode."""
        return self._write

    @property
    def versions_written(self) -> list[int]:
        """The versions of every commit so far (the table is this object's)."""
        with self._lock:
            return [c.version for c in self._commits]

    @property
    def last_rows_written(self) -> int | None:
        """The rows the last :meth:`replace_partition` left (None before any)."""
        with self._lock:
            return self._last_rows_written

    @property
    def commits(self) -> list[MemoryCommit]:
        """Every commit so far, oldest first (a copy of the list)."""
        with self._lock:
            return list(self._commits)

    def rows(self) -> pa.Table:
        """The current rows (every partition, in commit order; no columns before the first
        commit)."""
        with self._lock:
            return self._table if self._table is not None else pa.table({})

    # ---------------------------------------------------------------- watermarks

    def watermark(self, app_id: str) -> int:
        """``app_id``'s watermark (0 if none); a commit is fenced on the latest state, so
        nothing is remembered."""
        with self._lock:
            return self._marks.get(app_id, 0)

    def watermarks(self, app_ids: Iterable[str]) -> dict[str, int]:
        """Each of ``app_ids``' watermark (0 if none)."""
        with self._lock:
            return {a: self._marks.get(a, 0) for a in app_ids}

    # ---------------------------------------------------------------- commits

    def commit(self, table: pa.Table | None, fences: Fences, *,
               markers: Mapping[str, int] | None = None,
               lineage: Mapping[str, object] | None = None) -> None:
        """Write ``table`` (append, or merge by key) and move every watermark of ``fences``
        (``{app id: (expected, version)}``) in one step, only if each is still its
        ``expected`` (:meth:`TableSink.commit <cg_pipelines.sinks.base.TableSink.commit>`).
        ``None`` or 0 rows records only the watermarks.

        Raises:
            FenceConflictError: a watermark is not its ``expected``; nothing written.
            UsageError: no fence, a ``version < expected``, no version moves; no table yet
                and neither rows with columns nor a ``schema``.
            ContractError: Merge mode without its columns or with null keys; columns that
                differ from the table's.
        """
        check_fences(fences)
        with self._lock:
            self._check(fences)
            empty = table is None or table.num_rows == 0
            base = self._table if self._table is not None else self._new_table(table)
            self._table = base if empty or table is None else self._written(base, table)
            operation = "empty" if empty else self._write.name
            self._record(operation, None if empty else table,
                         {a: v for a, (_, v) in fences.items()}, markers, lineage)

    def replace_partition(
        self, data: pa.RecordBatchReader, partition: int, app_id: str, expected: int,
        markers: Mapping[str, int] | None = None, *,
        lineage: Mapping[str, object] | None = None,
        fenced: Mapping[str, int] | None = None,
    ) -> int:
        """Replace every row of ``partition`` with ``data``, keeping ``app_id``'s watermark at
        ``expected`` (and each of ``fenced``'s at its value), in one step fenced like
        :meth:`commit` (:meth:`TableSink.replace_partition
        <cg_pipelines.sinks.base.TableSink.replace_partition>`; Merge mode: ``data`` is the
        partition's history, reduced to each key's live last row).

        Returns:
            The rows the partition had before.

        Raises:
            FenceConflictError: a kept watermark moved; nothing written.
            ContractError: a row of ``data`` holds another partition, or columns differ from
                the table's.
            StateError: no table (nothing committed yet).
        """
        kept = {app_id: (expected, expected), **{a: (v, v) for a, v in (fenced or {}).items()}}
        with self._lock:
            if self._table is None:
                raise StateError(f"{self.uri}: no table to replace in (nothing committed)")
            target = self._table.schema
            self._check(kept)
            rows = (current_of(data, self._write, target, self.uri)
                    if isinstance(self._write, Merge) else conform(data.read_all(), target,
                                                                   self.uri))
            if rows.num_rows and PARTITION_COLUMN in rows.column_names and not pc.all(
                    pc.equal(rows[PARTITION_COLUMN], partition)).as_py():
                raise ContractError(f"{self.uri}: replacement rows of partition {partition} "
                                    "hold other partitions")
            mine = self._in_partition(self._table, partition)
            before = int(pc.sum(mine).as_py() or 0)
            self._table = pa.concat_tables([self._table.filter(pc.invert(mine)), rows])
            self._last_rows_written = rows.num_rows
            self._record("replace_partition", rows, {a: v for a, (v, _) in kept.items()},
                         markers, {"partition": partition, **(lineage or {})})
            return before

    def _check(self, fences: Fences) -> None:
        """Raise :class:`FenceConflictError` for the first fence whose watermark is not its
        expected one (under the lock)."""
        for app_id, (expected, _) in fences.items():
            found = self._marks.get(app_id, 0)
            if found != expected:
                raise FenceConflictError(app_id, expected, found)

    def _new_table(self, table: pa.Table | None) -> pa.Table:
        """The empty table a first commit creates: ``table``'s columns (less Merge mode's
        helper column), else the sink's ``schema``'s; every column nullable, no schema
        metadata (as the rows written are fitted to it)."""
        if table is not None and table.num_columns:
            if isinstance(self._write, Merge) and table.num_rows:
                self._write.check(table)
            fields = [f for f in table.schema if f.name != DELETE_COLUMN]
        elif self._schema is not None:
            fields = list(self._schema)
        else:
            raise UsageError(f"{self.uri}: no table yet and no schema to create it with: pass "
                             "schema= or commit rows first")
        return pa.schema([f.with_nullable(True) for f in fields]).empty_table()

    def _written(self, current: pa.Table, table: pa.Table) -> pa.Table:
        """``current`` after ``table`` is written to it in the sink's write mode."""
        if not isinstance(self._write, Merge):
            return pa.concat_tables([current, conform(table, current.schema, self.uri)])
        cur = self._write.current(table)
        live = cur.filter(pc.invert(cur[DELETE_COLUMN])).drop_columns([DELETE_COLUMN])
        on = list(self._write.keys)
        if PARTITION_COLUMN in current.column_names and PARTITION_COLUMN in cur.column_names:
            on.append(PARTITION_COLUMN)  # a key is matched within its partition
        hit = pc.is_in(_key_strings(current, on), value_set=_key_strings(cur, on))
        kept = current.filter(pc.invert(hit))
        return pa.concat_tables([kept, conform(live, current.schema, self.uri)])

    @staticmethod
    def _in_partition(table: pa.Table, partition: int) -> pa.Array:
        """A boolean mask of ``table``'s rows of ``partition`` (all false without the
        partition column)."""
        if PARTITION_COLUMN not in table.column_names:
            return pa.array([False] * table.num_rows)
        return pc.fill_null(pc.equal(table[PARTITION_COLUMN], partition), False)

    def _record(self, operation: str, rows: pa.Table | None, watermarks: dict[str, int],
                markers: Mapping[str, int] | None, lineage: Mapping[str, object] | None
                ) -> None:
        """Move the watermarks and markers and append the commit (under the lock)."""
        self._marks.update(watermarks)
        self._marks.update(markers or {})
        self._commits.append(MemoryCommit(len(self._commits) + 1, operation, rows,
                                          dict(watermarks), dict(markers or {}),
                                          dict(lineage or {})))

    # ---------------------------------------------------------------- reads

    def exists(self) -> bool:
        """Whether anything was committed."""
        with self._lock:
            return self._table is not None

    def stats(self, partition: int | None = None) -> TableStats:
        """The table's :class:`~cg_pipelines.sinks.base.TableStats` (``version``: the commits
        so far).

        Raises:
            StateError: no table (nothing committed yet).
        """
        with self._lock:
            if self._table is None:
                raise StateError(f"{self.uri}: no table (nothing committed)")
            part = None
            if partition is not None and PARTITION_COLUMN in self._table.column_names:
                part = int(pc.sum(self._in_partition(self._table, partition)).as_py() or 0)
            return TableStats(len(self._commits), self._table.num_rows, part,
                              self._table.schema)

    def read_partitions(self, partitions: Sequence[int] | None = None) -> pa.Table:
        """The rows of ``partitions`` (``None``: every row); no rows without a table."""
        table = self.rows()
        if partitions is None or table.num_columns == 0:
            return table
        if PARTITION_COLUMN not in table.column_names:
            return table.slice(0, 0)
        return table.filter(pc.is_in(table[PARTITION_COLUMN],
                                     value_set=pa.array(list(partitions), pa.int64())))

    def last_rows(self, key: str, keys: Sequence[object], columns: Sequence[str],
                  order_by: str, partition: int | None = None, *,
                  app_id: str | None = None) -> pa.Table:
        """Each of ``keys``' last committed row (greatest ``order_by``) with ``columns``
        (``key`` and ``order_by`` included), sorted by key (:meth:`TableSink.last_rows
        <cg_pipelines.sinks.base.TableSink.last_rows>`); ``partition`` limits the read to its
        rows; ``app_id`` is accepted and not needed (the read is of the latest state).

        Raises:
            ColumnNotFoundError: ``key``, ``order_by`` or a column of ``columns`` is not in
                the table.
        """
        cols = list(dict.fromkeys([key, order_by, *columns]))
        table = self.rows()
        if table.num_columns == 0:
            return pa.table({c: pa.nulls(0) for c in cols})
        missing = [c for c in cols if c not in table.column_names]
        if missing:
            raise ColumnNotFoundError(f"{self.uri}: columns {missing} not in "
                                      f"{table.column_names}")
        if partition is not None:
            table = table.filter(self._in_partition(table, partition))
        if not keys:
            return table.select(cols).slice(0, 0)
        hit = pc.is_in(table[key], value_set=pa.array(list(keys), table.schema.field(key).type))
        return last_per_key(table.filter(hit).select(cols), key, order_by)


def _key_strings(table: pa.Table, columns: Sequence[str]) -> pa.Array:
    """One string per row of ``table`` naming its values of ``columns`` (a composite key)."""
    if len(columns) == 1:
        return pc.cast(table[columns[0]], pa.string())
    parts = [pc.cast(table[c], pa.string()) for c in columns]
    return pc.binary_join_element_wise(*parts, "\x1f")
