"""The table contract: what the Dagster layer (and any other reporter) needs from the table a
sink commits to, whatever its format.

:class:`TableSink` is a :class:`~cg_pipelines.sinks.base.Sink` over one named table that can
also say whether the table exists, its size and schema (:meth:`TableSink.stats`, a
:class:`TableStats`), where it lives (``uri``), which table versions this sink object
committed (``versions_written``), the committed watermarks (``watermarks``, read-only),
its format's name (``table_format``: ``"delta"``,
``"iceberg"``; Dagster's ``dagster/storage_kind``), and read the rows of some partitions
(:meth:`TableSink.read_partitions`, what an IO manager hands a downstream asset).
:class:`~cg_pipelines.sinks.delta.DeltaSink` and :class:`~cg_pipelines.sinks.iceberg.
IcebergSink` implement it (structural typing, as every sink protocol: nothing to inherit).

Units: a table version is the format's own counter, an ``int``: a Delta table version, an
Iceberg table's last sequence number (``stats``), or snapshot id (``versions_written``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import pyarrow as pa

from cg_pipelines.sinks.base import Sink

__all__ = ["TableSink", "TableStats"]


@dataclass(frozen=True)
class TableStats:
    """A table version's size: ``version`` (the format's counter, see the module docstring),
    total ``rows``, ``partition_rows`` of one consumer-group partition (``None`` if not asked
    or the table is not partitioned by :data:`~cg_pipelines.sinks.base.PARTITION_COLUMN`),
    Arrow ``schema``."""

    version: int
    rows: int
    partition_rows: int | None
    schema: pa.Schema


@runtime_checkable
class TableSink(Sink, Protocol):
    """A sink over one named table in some format, as the Dagster layer uses it: to run a
    partition (the :class:`~cg_pipelines.sinks.base.Sink` methods), then to report the table
    in the run's metadata and to load it for downstream assets.

    Attributes:
        table_format: the format's name, ``"delta"`` or ``"iceberg"`` (Dagster's
            ``dagster/storage_kind``).
    """

    table_format: ClassVar[str]

    @property
    def uri(self) -> str:
        """Where the table lives (a path or URL; an Iceberg table not yet created: its
        ``iceberg:<identifier>``)."""
        ...

    @property
    def versions_written(self) -> list[int]:
        """The table versions this sink object committed so far, in order (Delta versions,
        Iceberg snapshot ids); empty when it committed nothing."""
        ...

    def watermarks(self, app_ids: Iterable[str]) -> dict[str, int]:
        """Each of ``app_ids``' committed watermark (0: none, or no table) from one read of
        the latest version; read-only (nothing is fenced on it: for observers such as the
        backlog sensor).

        Raises:
            Storage errors: the table cannot be read.
        """
        ...

    def exists(self) -> bool:
        """Whether the table exists (something was committed to it).

        Raises:
            Storage errors other than "no table" (e.g. a missing bucket).
        """
        ...

    def stats(self, partition: int | None = None) -> TableStats:
        """The latest version's :class:`TableStats`, with ``partition``'s row count when
        given.

        Raises:
            Storage errors; the table's own "no table" error when it does not exist (ask
            :meth:`exists` first).
        """
        ...

    def read_partitions(self, partitions: Sequence[int] | None = None) -> pa.Table:
        """The latest version's rows of ``partitions`` (consumer-group partition numbers;
        ``None``: every row), all columns. No rows when the table does not exist.

        Raises:
            Storage errors: the read failed.
        """
        ...
