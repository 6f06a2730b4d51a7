"""The sink contract: where a partition run commits its effects, fenced by a watermark.

A sink is any object with the methods of :class:`Sink` (structural typing: no base class to
inherit). The engine (:mod:`cg_pipelines.engine`) calls them, each in a worker thread
(``asyncio.to_thread``), while the run holds the partition's lease; the lease only makes a
second holder unlikely, the **fence** makes it harmless: every commit names the watermark it
was based on, and a sink refuses a commit whose watermark moved (:class:`FenceConflictError`).
Optional capabilities are further protocols, checked with ``isinstance`` before use:

- :class:`MaintainedSink` (``maintain``): the table's upkeep at the end of a run;
- :class:`StateSink` (``last_rows``): per-key state for processors that declare it;
- :class:`ReplaceSink` (``replace_partition``, ``stats``, ``write``): what a rebuild needs;
- :class:`JoinSink` (``commit_inputs``): one commit fenced on several watermarks, what a
  co-partitioned run (:mod:`cg_pipelines.engine.join`) needs.

:class:`~cg_pipelines.sinks.delta.DeltaSink` and :class:`~cg_pipelines.sinks.iceberg.
IcebergSink` implement all five. Also here: the watermark keys the engine commits under
(:func:`app_id_for`, :func:`origin_marker`) and the partition column it adds to every row
(:data:`PARTITION_COLUMN`, :func:`with_partition_column`).

Units: watermarks and versions are sequences of the stream the run reads (``int``, first
message is 1, 0 means "nothing committed").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cg_pipelines.core.errors import CgError, ContractError, UsageError
from cg_pipelines.core.write import Append, Merge

__all__ = [
    "PARTITION_COLUMN",
    "FenceConflictError",
    "JoinSink",
    "MaintainedSink",
    "ReplaceSink",
    "Sink",
    "StateSink",
    "TableShape",
    "app_id_for",
    "check_watermarks",
    "origin_marker",
    "with_partition_column",
]

PARTITION_COLUMN = "_partition"
"""Column (int64) the engine adds to every committed row: the consumer-group partition the row
came from. Tables made by the Dagster integration are partitioned by it, so a partition's rows
live in their own files (state reads and rebuilds touch only them)."""


class FenceConflictError(CgError):
    """A commit was refused because the partition's watermark moved since it was read
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


class Sink(Protocol):
    """Where a partition run's effects are committed, fenced by a per-partition watermark.

    The engine calls :meth:`watermark` then :meth:`commit` once per batch, in that order, for
    one ``app_id`` (:func:`app_id_for`) at a time per run; a sink may serve several runs (of
    different partitions) from different threads at once."""

    def watermark(self, app_id: str) -> int:
        """The last committed version of ``app_id`` (0 if none, or no table yet).

        Called: at the start of each batch, under the partition's lease, before anything of
        the batch is read. The sink reads a fresh snapshot, and the next :meth:`commit` of
        ``app_id`` is fenced against it. The engine never processes a message at or below
        the result again (it purges and acknowledges it).

        Raises:
            Any I/O error of the storage: the run fails (nothing acknowledged), and its retry
            starts from the watermark.
        """
        ...

    def commit(self, table: pa.Table | None, app_id: str, version: int, expected: int,
               markers: Mapping[str, int] | None = None, *,
               lineage: Mapping[str, object] | None = None) -> None:
        """Atomically write ``table`` and set ``app_id``'s watermark to ``version``, only if
        it is still ``expected``.

        Called: once per batch, under the lease, after the batch's dead letters were
        published and before anything of it is acknowledged (the exactly-once rule).

        Args:
            table: the batch's rows, with :data:`PARTITION_COLUMN` set; ``None`` or 0 rows
                records only the watermark.
            app_id: the partition's watermark key (:func:`app_id_for`).
            version: the new watermark: the batch's last sequence (> ``expected``).
            expected: the watermark :meth:`watermark` (or the previous commit) gave.
            markers: other ``{key: version}`` pairs recorded in the same commit and read back
                with :meth:`watermark`, not fenced (the engine records the origin sequence of
                the batch's last message under :func:`origin_marker` ``(app_id)``).
            lineage: what the batch was, for the commit's metadata: ``stream``, ``group``,
                ``partition``, ``first_seq``, ``last_seq`` (sequences of the stream read),
                ``last_origin_seq`` (or None), ``cg.coverage`` (the origin sequences the batch
                settled, :func:`~cg_pipelines.core.coverage.encode_seqs`, or None). A sink
                records it with the commit (Delta: ``custom_metadata``, ``cg.<name>``) or
                ignores it.

        Raises:
            FenceConflictError: the watermark is not ``expected`` (a newer holder committed);
                nothing written. The engine ends the run ``fenced`` and leaves the lease
                unacknowledged for the new holder.
            Other errors: nothing may have been written; the run fails (nothing acknowledged)
                and its retry reads the watermark again.
        """
        ...


@runtime_checkable
class MaintainedSink(Protocol):
    """A sink that does its table's upkeep for one partition (compaction, state snapshots,
    retention), e.g. :meth:`cg_pipelines.sinks.delta.DeltaSink.maintain`."""

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


@runtime_checkable
class StateSink(Sink, Protocol):
    """A sink that can serve per-key state: the last committed row of some keys. A processor
    that declares :class:`~cg_pipelines.core.state.KeyedState` needs one: the engine refuses
    any other sink (``EngineConfigError``) before it reads anything."""

    def last_rows(
        self, key: str, keys: Sequence[object], columns: Sequence[str], order_by: str,
        partition: int | None = None, *, app_id: str | None = None,
    ) -> pa.Table:
        """One row per key of ``keys`` that has a committed row: the row with the greatest
        ``order_by``, with ``columns`` (``key`` included). Keys without a row are absent.

        Called: while a batch is processed (from the processor's thread), for the keys of
        the batch missing from the run's state cache, under the lease; ``partition`` limits
        the read to that partition's rows (None: the whole table).

        ``app_id``: the run's identity, which every state sink accepts (it may ignore it). A
        partition run passes its app id (:func:`app_id_for`); ``None`` from a caller with no
        run (a co-partitioned run, a test). With an app id the read comes after the run's
        :meth:`~Sink.watermark` read of that app id through this sink, under the lease, and
        the commits since (the run's own, maybe still in flight on another thread) hold none
        of the keys asked for (the run's cache has their rows), so the sink may serve it from
        the snapshot that watermark read loaded, with no reload
        (:meth:`DeltaSink.last_rows <cg_pipelines.sinks.delta.DeltaSink.last_rows>`); with
        ``None`` it reads the latest version.

        Raises:
            Storage errors: the batch's processing fails, so does the run (nothing committed).
        """
        ...


@runtime_checkable
class JoinSink(Sink, Protocol):
    """A sink that commits several inputs' progress at once: the rows of a co-partitioned run
    (partition ``p`` of several groups, :func:`~cg_pipelines.engine.join.run_copartitioned`)
    and every input's watermark in ONE commit, fenced on all of them."""

    def commit_inputs(self, table: pa.Table | None, watermarks: Mapping[str, tuple[int, int]],
                      markers: Mapping[str, int] | None = None, *,
                      lineage: Mapping[str, object] | None = None) -> None:
        """Atomically write ``table`` and set each app id of ``watermarks`` (``{app id:
        (expected, version)}``, one per input, in the run's input order) to its ``version``,
        only if every one is still its ``expected``. An input with nothing in the batch keeps
        its version (``version == expected``) and is fenced all the same: a commit of another
        holder that moved only that input must refuse this one (the rows were computed from
        state that commit changed).

        Called: once per batch of a co-partitioned run, under every input's lease, after
        the batch's dead letters were published and before anything is acknowledged; the
        first app id's :meth:`~Sink.watermark` was read at the start of the batch.

        Raises:
            FenceConflictError: one of the watermarks moved (the first found is named);
                nothing written.
            UsageError: no watermark, a ``version < expected``, or no version moves
                (:func:`check_watermarks`).
            Other errors: as :meth:`Sink.commit`.
        """
        ...


def check_watermarks(watermarks: Mapping[str, tuple[int, int]]) -> str:
    """Check a :meth:`JoinSink.commit_inputs` argument (``{app id: (expected, version)}``;
    a sink's ``commit`` is this with one app id) and return the first app id whose version
    moves (``expected < version``).

    Raises:
        UsageError: empty, a negative ``expected``, a ``version < expected``, or no version
            moves.
    """
    if not watermarks:
        raise UsageError("commit_inputs needs at least one watermark")
    bad = {a: ev for a, ev in watermarks.items() if not 0 <= ev[0] <= ev[1]}
    if bad:
        raise UsageError(f"commit: need 0 <= expected <= version, got {bad}")
    moving = [a for a, (e, v) in watermarks.items() if v > e]
    if not moving:
        raise UsageError(f"commit: no watermark moves (need expected < version for at least "
                         f"one app id), got {dict(watermarks)}")
    return moving[0]


class TableShape(Protocol):
    """What a sink's ``stats()`` tells a rebuild: the table's Arrow ``schema``."""

    @property
    def schema(self) -> pa.Schema:
        """The table's columns (as Arrow types)."""
        ...


@runtime_checkable
class ReplaceSink(StateSink, Protocol):
    """A sink a rebuild can use (:func:`~cg_pipelines.engine.rebuild.rebuild_partition`): it
    replaces a partition's rows in one fenced commit.

    Attributes:
        last_rows_written: the rows the last :meth:`replace_partition` left (None: unknown).
    """

    last_rows_written: int | None

    @property
    def write(self) -> Append | Merge:
        """The table's write mode (:class:`~cg_pipelines.core.write.Append` or
        :class:`~cg_pipelines.core.write.Merge`): a rebuild in Merge mode keeps each key's
        last row."""
        ...

    def stats(self, partition: int | None = None) -> TableShape:
        """The table's shape (its ``schema``).

        Called: once per rebuild, under the lease, before the replay, to check the
        processor's output fits the table.

        Raises:
            Storage errors: the rebuild fails before writing anything.
        """
        ...

    def replace_partition(
        self, data: pa.RecordBatchReader, partition: int, app_id: str, expected: int,
        markers: Mapping[str, int] | None = None, *,
        lineage: Mapping[str, object] | None = None,
        fenced: Mapping[str, int] | None = None,
    ) -> int:
        """Replace every row of ``partition`` with ``data`` in one commit, keeping
        ``app_id``'s watermark at ``expected``; fenced like :meth:`Sink.commit`. ``fenced``
        (``{app id: watermark}``): further watermarks kept at their value and fenced the same
        way (a co-partitioned rebuild keeps every input's, :mod:`cg_pipelines.engine.
        join_rebuild`).

        Called: once per rebuild, under the partition's lease, after :meth:`Sink.watermark`;
        ``data`` streams the replayed output (read it once; an error raised while reading it
        must leave nothing written). ``markers`` and ``lineage`` as for
        :meth:`Sink.commit`.

        Returns:
            The number of rows the partition had before (the rows replaced).

        Raises:
            FenceConflictError: another holder committed ``app_id`` meanwhile; nothing
                written (the rebuild's status is ``fenced``).
            Other errors: nothing written; the rebuild fails and the old rows stay.
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
