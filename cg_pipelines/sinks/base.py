"""The sink contract: where a run commits its effects, fenced by watermarks.

A sink is any object with the members of :class:`TableSink` (structural typing: no base class
to inherit): one named table in some format that a run commits to, reads per-key state from,
rebuilds a partition of, and reports. :class:`MaintainedSink` (``maintain``) is the one
optional capability, checked once per run with ``isinstance``.

The engine (:mod:`cg_pipelines.engine`) calls a sink's methods, each in a worker thread
(``asyncio.to_thread``), while the run holds the lease of every side it reads (a side is one
partition of one group: ``<stream>/<group>/<p>``, :func:`app_id_for`). The lease only makes a
second holder unlikely; the **fence** makes it harmless: every commit names, for each side,
the watermark it was based on and the one it leaves (``{app_id: (expected, version)}``,
:data:`Fences`), and a sink refuses a commit when any of them moved
(:class:`FenceConflictError`). A one-input run's commit is the one-side case
(:func:`commit_one`).

:class:`~cg_pipelines.sinks.delta.DeltaSink`, :class:`~cg_pipelines.sinks.iceberg.
IcebergSink` and :class:`~cg_pipelines.testing.memory.MemorySink` implement it (and
``tests/sinks/test_conformance.py`` checks them alike). Also here: the watermark keys
(:func:`app_id_for`, :func:`origin_marker`), the partition column the engine adds to every
row (:data:`PARTITION_COLUMN`, :func:`with_partition_column`), and the check a run makes of
a sink before it starts (:func:`missing_members`).

Units: watermarks and versions are sequences of the stream a side reads (``int``, first
message is 1, 0 means "nothing committed"); a table version is the format's own counter.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, TypeAlias, runtime_checkable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cg_pipelines.core.errors import CgError, ContractError, UsageError
from cg_pipelines.core.write import Append, Merge

__all__ = [
    "PARTITION_COLUMN",
    "TABLE_SINK_MEMBERS",
    "FenceConflictError",
    "Fences",
    "MaintainedSink",
    "TableSink",
    "TableStats",
    "app_id_for",
    "check_fences",
    "commit_one",
    "missing_members",
    "origin_marker",
    "with_partition_column",
]

PARTITION_COLUMN = "_partition"
"""Column (int64) the engine adds to every committed row: the consumer-group partition the row
came from. Tables made by the Dagster integration are partitioned by it, so a partition's rows
live in their own files (state reads and rebuilds touch only them)."""

Fences: TypeAlias = Mapping[str, tuple[int, int]]
"""A commit's fences: ``{app_id: (expected, version)}``, one per side of the run, in the run's
side order: the watermark the batch was based on and the one the commit leaves
(``0 <= expected <= version``; a side with nothing in the batch has ``version == expected``
and is fenced all the same)."""


class FenceConflictError(CgError):
    """A commit was refused because a side's watermark moved since it was read
    (another holder committed first: this run is a zombie for that range). Nothing was
    written. The engine ends the run with status ``fenced`` (not an exception).

    Attributes:
        app_id: the watermark key; expected: the watermark the commit was based on;
        found: the watermark found instead (None: a concurrent commit won the race).
    """

    def __init__(self, app_id: str, expected: int, found: int | None) -> None:
        super().__init__(
            f"fence conflict on {app_id}: expected watermark {expected}, found "
            f"{'unknown (concurrent commit)' if found is None else found}"
        )
        self.app_id, self.expected, self.found = app_id, expected, found


def app_id_for(stream: str, group: str, partition: int) -> str:
    """The partition's watermark key in the sink: ``<stream>/<group>/<partition>``."""
    return f"{stream}/{group}/{partition}"


def origin_marker(app_id: str) -> str:
    """The key under which a partition's commits record the origin stream sequence of their
    last message: ``<app_id>@origin``. A rebuild replays the origin stream up to it."""
    return f"{app_id}@origin"


def check_fences(fences: Fences) -> str:
    """Check a commit's ``fences`` (:data:`Fences`) and return the first app id whose version
    moves (``expected < version``).

    Raises:
        UsageError: empty, a negative ``expected``, a ``version < expected``, or no version
            moves.
    """
    if not fences:
        raise UsageError("commit needs at least one fence")
    bad = {a: ev for a, ev in fences.items() if not 0 <= ev[0] <= ev[1]}
    if bad:
        raise UsageError(f"commit: need 0 <= expected <= version, got {bad}")
    moving = [a for a, (e, v) in fences.items() if v > e]
    if not moving:
        raise UsageError(f"commit: no watermark moves (need expected < version for at least "
                         f"one app id), got {dict(fences)}")
    return moving[0]


def commit_one(sink: TableSink, table: pa.Table | None, app_id: str, version: int,
               expected: int, markers: Mapping[str, int] | None = None, *,
               lineage: Mapping[str, object] | None = None) -> None:
    """A one-input run's commit: ``sink.commit(table, {app_id: (expected, version)},
    markers=markers, lineage=lineage)`` (:meth:`TableSink.commit`, whose errors it raises)."""
    sink.commit(table, {app_id: (expected, version)}, markers=markers, lineage=lineage)


@dataclass(frozen=True)
class TableStats:
    """A table version's size: ``version`` (the format's counter: a Delta table version, an
    Iceberg table's last sequence number, a :class:`~cg_pipelines.testing.memory.MemorySink`'s
    commit count), total ``rows``, ``partition_rows`` of one consumer-group partition
    (``None`` if not asked or the table has no :data:`PARTITION_COLUMN`), Arrow ``schema``."""

    version: int
    rows: int
    partition_rows: int | None
    schema: pa.Schema


@runtime_checkable
class TableSink(Protocol):
    """The sink contract: one named table a run commits to, fenced on every side's watermark,
    and reads per-key state from; a rebuild replaces a partition of; a reporter (the Dagster
    layer) describes and loads.

    Thread-safety: a sink may serve several runs (different app ids) from different threads
    at once; calls for one app id never overlap (one holder per partition).

    Attributes:
        table_format: the format's name (``"delta"``, ``"iceberg"``, ``"memory"``; Dagster's
            ``dagster/storage_kind``).
    """

    table_format: ClassVar[str]

    @property
    def uri(self) -> str:
        """Where the table lives (a path or URL; an Iceberg table not yet created: its
        ``iceberg:<identifier>``; a memory sink: ``memory:<name>``)."""
        ...

    @property
    def write(self) -> Append | Merge:
        """The write mode (:class:`~cg_pipelines.core.write.Append` or
        :class:`~cg_pipelines.core.write.Merge`: the table holds each key's last row)."""
        ...

    @property
    def versions_written(self) -> list[int]:
        """The table versions this sink object committed so far, in order (Delta versions,
        Iceberg snapshot ids, a memory sink's commit numbers); empty when it committed
        nothing."""
        ...

    @property
    def last_rows_written(self) -> int | None:
        """The rows the last :meth:`replace_partition` left in its partition (None before
        any)."""
        ...

    def watermark(self, app_id: str) -> int:
        """The last committed version of ``app_id`` (0 if none, or no table yet).

        Called: at the start of each batch, under the lease of ``app_id``'s side, before
        anything of the batch is read. The sink reads a fresh table state, and the next
        :meth:`commit` whose first fence is ``app_id`` may be decided against it. The engine
        never processes a message at or below the result again (it purges and acknowledges
        it).

        Raises:
            Any I/O error of the storage: the run fails (nothing acknowledged), and its retry
            starts from the watermark.
        """
        ...

    def watermarks(self, app_ids: Iterable[str]) -> dict[str, int]:
        """Each of ``app_ids``' committed watermark (0: none, or no table) from one read of
        the latest version; read-only (nothing is fenced on it).

        Called: by observers (the backlog sensor, reconcile), outside any lease.

        Raises:
            Storage errors: the table cannot be read.
        """
        ...

    def commit(self, table: pa.Table | None, fences: Fences, *,
               markers: Mapping[str, int] | None = None,
               lineage: Mapping[str, object] | None = None) -> None:
        """Atomically write ``table`` and set each app id of ``fences`` to its ``version``,
        only if every one is still its ``expected`` (:data:`Fences`). A side whose version
        does not move is fenced all the same: a commit of another holder that moved only that
        side must refuse this one (the rows were computed from state that commit changed).

        Called: once per batch, under every side's lease, after the batch's dead letters
        were published and before anything of it is acknowledged (the exactly-once rule);
        the first app id's :meth:`watermark` was read at the start of the batch.

        Args:
            table: the batch's rows, with :data:`PARTITION_COLUMN` set; ``None`` or 0 rows
                records only the watermarks (an empty commit). In Merge mode the rows are
                reduced to each key's last row (a delete marker deletes the key). The table
                is created on the first commit (from ``table``'s schema, else the sink's).
            fences: ``{app_id: (expected, version)}`` (:data:`Fences`); the first app id is
                the commit's ``cg.app_id`` in the lineage.
            markers: further ``{key: version}`` pairs recorded in the same commit and read
                back with :meth:`watermark`, not fenced (the engine records the origin
                sequence of the batch's last message under :func:`origin_marker`).
            lineage: what the batch was, for the commit's metadata: ``stream``, ``group``,
                ``partition``, ``first_seq``, ``last_seq``, ``last_origin_seq``,
                ``cg.coverage`` (or None values). Recorded with the commit (Delta:
                ``custom_metadata``, ``cg.<name>``; Iceberg: the snapshot summary) or
                ignored.

        Raises:
            FenceConflictError: a watermark is not its ``expected`` (the first found is
                named); nothing written. The engine ends the run ``fenced``.
            UsageError: no fence, a ``version < expected``, or no version moves
                (:func:`check_fences`); no table yet and no schema to create it with.
            ContractError: Merge mode without its columns, or null keys.
            Other errors: nothing may have been written; the run fails (nothing
                acknowledged) and its retry reads the watermark again.
        """
        ...

    def last_rows(
        self, key: str, keys: Sequence[object], columns: Sequence[str], order_by: str,
        partition: int | None = None, *, app_id: str | None = None,
    ) -> pa.Table:
        """One row per key of ``keys`` that has a committed row: the row with the greatest
        ``order_by``, with ``columns`` (``key`` included), sorted by key. Keys without a row
        are absent; no rows when ``keys`` is empty or there is no table.

        Called: while a batch is processed (from the processor's thread), for the keys of
        the batch missing from the run's state cache, under the lease; ``partition`` limits
        the read to that partition's rows (None: the whole table). ``app_id``: the run's
        identity, or None from a caller with no run. With an app id the read comes after the
        run's :meth:`watermark` read of it, and the commits since (the run's own) hold none of
        the keys asked for, so the sink may serve it from the state that read loaded
        (:meth:`DeltaSink.last_rows <cg_pipelines.sinks.delta.DeltaSink.last_rows>`); with
        None it reads the latest version.

        Raises:
            ColumnNotFoundError: ``key`` or ``order_by`` is not a column of the table.
            Storage errors: the batch's processing fails, so does the run (nothing committed).
        """
        ...

    def replace_partition(
        self, data: pa.RecordBatchReader, partition: int, app_id: str, expected: int,
        markers: Mapping[str, int] | None = None, *,
        lineage: Mapping[str, object] | None = None,
        fenced: Mapping[str, int] | None = None,
    ) -> int:
        """Replace every row of consumer-group ``partition`` with ``data`` in one commit,
        keeping ``app_id``'s watermark at ``expected``, fenced like :meth:`commit`.
        ``fenced`` (``{app id: watermark}``): further watermarks kept at their value and
        fenced the same way (a co-partitioned rebuild keeps every input's). Merge mode:
        ``data`` is the partition's history in stream order, reduced to each key's live last
        row. Afterwards :attr:`last_rows_written` holds the rows written.

        Called: once per rebuild, under the partition's lease, after :meth:`watermark`;
        ``data`` streams the replayed output (read it once; an error raised while reading it
        leaves nothing written). ``markers`` and ``lineage`` as for :meth:`commit`.

        Returns:
            The number of rows the partition had before (the rows replaced).

        Raises:
            FenceConflictError: a kept watermark moved meanwhile; nothing written (the
                rebuild's status is ``fenced``).
            ContractError: a row of ``data`` holds another partition.
            The format's "no table" error: nothing was ever committed.
            Other errors: nothing written; the rebuild fails and the old rows stay.
        """
        ...

    def exists(self) -> bool:
        """Whether the table exists (something was committed to it).

        Called: by reporters, before :meth:`stats`.

        Raises:
            Storage errors other than "no table" (e.g. a missing bucket).
        """
        ...

    def stats(self, partition: int | None = None) -> TableStats:
        """The latest version's :class:`TableStats`, with ``partition``'s row count when
        given.

        Called: by a rebuild before its replay (the schema) and by reporters.

        Raises:
            Storage errors; the format's own "no table" error when it does not exist (ask
            :meth:`exists` first).
        """
        ...

    def read_partitions(self, partitions: Sequence[int] | None = None) -> pa.Table:
        """The latest version's rows of ``partitions`` (consumer-group partition numbers;
        ``None``: every row), all columns. No rows when the table does not exist.

        Called: by IO managers and checks, outside any lease.

        Raises:
            Storage errors: the read failed.
        """
        ...


@runtime_checkable
class MaintainedSink(Protocol):
    """The optional capability: a sink that does its table's upkeep for one partition
    (compaction, state snapshots, retention), e.g.
    :meth:`cg_pipelines.sinks.delta.DeltaSink.maintain`. A run checks it once."""

    def maintain(self, partition: int, app_id: str) -> dict[str, int | float | str]:
        """The partition's upkeep; returns figures for the run's metadata
        (``{name: int | float | str}``, in ``RunResult.maintenance``).

        Called: once per run, while the run still holds the partition's lease, after its
        last commit, and only when the run committed something (the run read the watermark
        of ``app_id`` through this sink before its commits, so the sink may do the upkeep on
        the snapshot that read loaded, as the commits advanced it); or by
        :func:`~cg_pipelines.engine.maintain.maintain_partition`, with no run (then on the
        latest version). It must not change a row or a watermark; a snapshot older than the
        latest (a holder that lost its lease) may only make it do less.

        Raises:
            Nothing on purpose: a failure is reported in the figures (``error``). An exception
            fails the run after its commits (they stay; nothing is processed again).
        """
        ...


def with_partition_column(table: pa.Table | None, partition: int) -> pa.Table | None:
    """``table`` with :data:`PARTITION_COLUMN` (int64) set to ``partition`` on every row
    (appended, or checked when the transform kept it). ``None`` stays ``None``.

    Raises:
        ContractError: the table has the column with another partition's number.
    """
    if table is None:
        return None
    if PARTITION_COLUMN in table.column_names:
        col = table[PARTITION_COLUMN]
        if table.num_rows and not pc.all(pc.equal(col, partition)).as_py():
            raise ContractError(f"the transform's {PARTITION_COLUMN} column holds "
                                         f"other partitions than {partition}")
        return table
    return table.append_column(pa.field(PARTITION_COLUMN, pa.int64(), nullable=False),
                               pa.array(np.full(table.num_rows, partition, np.int64)))


TABLE_SINK_MEMBERS: tuple[str, ...] = tuple(n for n in vars(TableSink) if not n.startswith("_"))
"""The names :class:`TableSink` requires, in its order (read from the protocol itself)."""


def missing_members(sink: object) -> list[str]:
    """The members of :class:`TableSink` that ``sink`` lacks (empty: it is a table sink). The
    engine checks this once before a run (``EngineConfigError`` naming them) instead of
    failing mid-run on the first missing call."""
    return [name for name in TABLE_SINK_MEMBERS if not hasattr(sink, name)]

