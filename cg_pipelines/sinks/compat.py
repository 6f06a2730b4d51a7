"""The sink protocols and call forms from before the one commit contract (issue 50), kept only
until the engine and the Dagster layer call :class:`~cg_pipelines.sinks.base.TableSink`
directly; re-exported by :mod:`cg_pipelines.sinks.base`. Delete this module then.

- :class:`Sink`, :class:`StateSink`, :class:`ReplaceSink`, :class:`JoinSink`: the slices of
  :class:`~cg_pipelines.sinks.base.TableSink` the engine checks with ``isinstance`` (every
  table sink is all four).
- :func:`legacy_commit_args`: the one-input positional form ``commit(table, app_id, version,
  expected, markers)`` the engine's drain still uses, turned into the fences form.

Units: watermarks and versions are stream sequences (``int``; 0: nothing committed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import pyarrow as pa

from cg_pipelines.core.errors import UsageError
from cg_pipelines.core.write import Append, Merge

__all__ = ["JoinSink", "ReplaceSink", "Sink", "StateSink", "TableShape", "legacy_commit_args"]


def legacy_commit_args(
    fences: Mapping[str, tuple[int, int]] | str, legacy: tuple[Any, ...],
    markers: Mapping[str, int] | None,
) -> tuple[Mapping[str, tuple[int, int]], Mapping[str, int] | None]:
    """``(fences, markers)`` of a ``commit`` call in either form: the fences form
    ``commit(table, {app_id: (expected, version)}, markers=...)`` (``legacy`` empty), or the
    old one-input form ``commit(table, app_id, version, expected[, markers])`` (``fences`` the
    app id, ``legacy`` the rest).

    Raises:
        UsageError: extra positional arguments to the fences form, or the one-input form
            without ``version`` and ``expected`` (or with markers given twice).
    """
    if not isinstance(fences, str):
        if legacy:
            raise UsageError(f"commit(table, fences, *, markers=..., lineage=...) takes no "
                             f"further positional arguments, got {len(legacy)}")
        return fences, markers
    if len(legacy) not in (2, 3) or (len(legacy) == 3 and markers is not None):
        raise UsageError("commit(table, app_id, version, expected[, markers]): need version "
                         "and expected (markers once)")
    version, expected = int(legacy[0]), int(legacy[1])
    return {fences: (expected, version)}, legacy[2] if len(legacy) == 3 else markers


class Sink(Protocol):
    """The engine's one-input view of a sink (superseded by
    :class:`~cg_pipelines.sinks.base.TableSink`, which every sink is)."""

    def watermark(self, app_id: str) -> int:
        """:meth:`TableSink.watermark <cg_pipelines.sinks.base.TableSink.watermark>`.

        Called: at the start of each batch, under the partition's lease.
        """
        ...

    def commit(self, table: pa.Table | None, *args: Any, **kwargs: Any) -> None:
        """:meth:`TableSink.commit <cg_pipelines.sinks.base.TableSink.commit>`, in either
        form (:func:`legacy_commit_args`).

        Called: once per batch, under the lease, before anything of it is acknowledged.
        """
        ...


@runtime_checkable
class StateSink(Sink, Protocol):
    """A sink that serves per-key state (every :class:`~cg_pipelines.sinks.base.TableSink`
    does)."""

    def last_rows(
        self, key: str, keys: Sequence[object], columns: Sequence[str], order_by: str,
        partition: int | None = None, *, app_id: str | None = None,
    ) -> pa.Table:
        """:meth:`TableSink.last_rows <cg_pipelines.sinks.base.TableSink.last_rows>`.

        Called: while a batch is processed, for the keys missing from the run's state cache.
        """
        ...


@runtime_checkable
class JoinSink(Sink, Protocol):
    """A sink with ``commit_inputs``, the old name of the fences form of
    :meth:`TableSink.commit <cg_pipelines.sinks.base.TableSink.commit>`."""

    def commit_inputs(self, table: pa.Table | None, watermarks: Mapping[str, tuple[int, int]],
                      markers: Mapping[str, int] | None = None, *,
                      lineage: Mapping[str, object] | None = None) -> None:
        """``commit(table, watermarks, markers=markers, lineage=lineage)``.

        Called: once per batch of a co-partitioned run, under every input's lease.
        """
        ...


class TableShape(Protocol):
    """What a sink's ``stats()`` tells a rebuild: the table's Arrow ``schema``."""

    @property
    def schema(self) -> pa.Schema:
        """The table's columns (as Arrow types)."""
        ...


@runtime_checkable
class ReplaceSink(StateSink, Protocol):
    """A sink a rebuild can use (every :class:`~cg_pipelines.sinks.base.TableSink` is)."""

    @property
    def last_rows_written(self) -> int | None:
        """The rows the last ``replace_partition`` left (None: unknown)."""
        ...

    @property
    def write(self) -> Append | Merge:
        """The table's write mode."""
        ...

    def stats(self, partition: int | None = None) -> TableShape:
        """:meth:`TableSink.stats <cg_pipelines.sinks.base.TableSink.stats>`.

        Called: once per rebuild, under the lease, before the replay.
        """
        ...

    def replace_partition(
        self, data: pa.RecordBatchReader, partition: int, app_id: str, expected: int,
        markers: Mapping[str, int] | None = None, *,
        lineage: Mapping[str, object] | None = None,
        fenced: Mapping[str, int] | None = None,
    ) -> int:
        """:meth:`TableSink.replace_partition
        <cg_pipelines.sinks.base.TableSink.replace_partition>`.

        Called: once per rebuild, under the partition's lease, after the watermark read.
        """
        ...
