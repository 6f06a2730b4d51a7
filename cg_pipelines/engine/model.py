"""Data shapes of the ordered partition engine: records, processing results, run results.

Units: sequences are work-queue stream sequences (``int``, first is 1); ``time_ns`` is the
publish time in nanoseconds since the Unix epoch; durations are seconds (``float``).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cg_pipelines.core.batching import CostModel
from cg_pipelines.core.errors import CgError
from cg_pipelines.core.record import RECORD_SCHEMA as CORE_RECORD_SCHEMA
from cg_pipelines.core.state import KeyedState
from cg_pipelines.core.write import Append, Merge

RECORD_SCHEMA = CORE_RECORD_SCHEMA
"""Arrow schema of a batch of records, in stream order: ``seq`` is the sequence in the stream
read (an elastic group's work-queue stream; a static group's own stream), ``origin_seq`` the
message's sequence in the origin stream (from the ``Nats-Stream-Source`` header the server puts
on sourced messages; null when the stream read is the origin), ``headers`` the user headers as
a JSON object string or null. Defined once, in :mod:`cg_pipelines.core.record`."""


@dataclass(frozen=True, slots=True)
class Record:
    """One message of a partition, as user code sees it.

    ``subject`` has the partition token stripped (the origin stream's subject); ``seq`` is the
    sequence in the stream read: the **work-queue** stream's (for static groups, the origin
    stream's); ``origin_seq`` the **origin** stream's sequence of a sourced message (None when
    the stream read is the origin); ``headers`` are the user headers. The decoded batch's and
    the output's column ``_seq`` (:data:`~cg_pipelines.core.contract.SEQ_COLUMN`) is the
    origin sequence: ``origin_seq``, else ``seq``.
    """

    seq: int
    subject: str
    data: bytes
    time_ns: int
    headers: dict[str, str] | None = None
    origin_seq: int | None = None


def records_to_arrow(records: Sequence[Record]) -> pa.Table:
    """A batch as an Arrow table with :data:`RECORD_SCHEMA` (in the given order)."""
    return pa.Table.from_arrays(
        [
            pa.array([r.seq for r in records], pa.int64()),
            pa.array([r.subject for r in records], pa.string()),
            pa.array([r.time_ns for r in records], pa.int64()).cast(pa.timestamp("ns", tz="UTC")),
            pa.array([json.dumps(r.headers) if r.headers else None for r in records], pa.string()),
            pa.array([r.data for r in records], pa.binary()),
            pa.array([r.origin_seq for r in records], pa.int64()),
        ],
        schema=RECORD_SCHEMA,
    )


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A message the processing step could not handle, and why (one line)."""

    seq: int
    reason: str


@dataclass(slots=True)
class Processed:
    """Output of the processing step for one batch.

    ``table``: rows to commit (``None`` or empty when nothing to write); ``dead``: messages to
    dead-letter, by sequence. Every input sequence must be either reflected in ``table`` or
    listed in ``dead`` — the engine never drops one silently.
    """

    table: pa.Table | None
    dead: list[DeadLetter] = field(default_factory=list)


PARTITION_COLUMN = "_partition"
"""Column (int64) the engine adds to every committed row: the consumer-group partition the row
came from. Tables made by the Dagster integration are partitioned by it, so a partition's rows
live in their own files (state reads and rebuilds touch only them)."""


class StateReader(Protocol):
    """Per-key state for a batch (see :class:`~cg_pipelines.core.state.KeyedState`):
    ``lookup(keys)`` returns the last row of each key that has one, with the spec's
    ``read_columns``."""

    def lookup(self, keys: Sequence[object]) -> pa.Table: ...


@dataclass(frozen=True, slots=True)
class BatchContext:
    """What the processing step knows about the batch besides its records.

    ``app_id`` is the partition's watermark key in the sink (``<stream>/<group>/<partition>``);
    ``sink`` is where the batch will be committed; ``state`` serves the per-key state the
    processor declared (``None`` when it declared none); ``mode`` is ``"drain"`` or
    ``"rebuild"`` (a rebuild replays the partition's history from empty state).
    """

    stream: str
    group: str
    partition: int
    app_id: str
    first_seq: int
    last_seq: int
    sink: Sink
    state: StateReader | None = None
    mode: str = "drain"


class Processor(Protocol):
    """The processing step: turns a batch (in stream order) into rows to commit.

    ``batch`` is an Arrow table with :data:`RECORD_SCHEMA` (:func:`records_to_arrow` builds one
    from :class:`Record` objects). It must be deterministic for the same batch and committed
    state, so that a batch re-processed after a crash or fence conflict gives the same effect.

    Every hook the engine and the Dagster integration read is declared here; subclass
    :class:`ProcessorBase` for their defaults (a processor that only has ``process`` is given
    them by :func:`with_defaults`):

    - ``state``: the per-key state the processor reads
      (:class:`~cg_pipelines.core.state.KeyedState`), ``None`` for none. The engine serves it
      from the sink (which must then be a :class:`StateSink`).
    - ``uses_spark``: the processor runs on Spark (the Dagster asset then requires the Spark
      resource and calls ``bind``).
    - ``bind(spark)``: a copy of the processor that uses the given Spark session.
    - ``cost_model``: a :class:`~cg_pipelines.core.batching.CostModel` the engine's adaptive
      batch sizing learns into (``None``: a fresh one per run).
    - ``read_options``: extra ``jetstream`` source options for an executor read (e.g. TLS
      files, :class:`~cg_pipelines.engine.executor_read.RangeProcessor`).
    """

    state: KeyedState | None
    uses_spark: bool
    cost_model: CostModel | None
    read_options: Mapping[str, str | int | bool]

    def bind(self, spark: Any) -> Processor: ...

    def process(self, batch: pa.Table, ctx: BatchContext) -> Processed: ...


_NO_OPTIONS: Mapping[str, str | int | bool] = MappingProxyType({})


class ProcessorBase(ABC):
    """A :class:`Processor` with every optional hook at its default: no state, not on Spark,
    ``bind`` returns the processor itself, no cost model of its own, no extra read options.
    Subclasses implement :meth:`process` and override what they use."""

    state: KeyedState | None = None
    uses_spark: bool = False
    cost_model: CostModel | None = None
    read_options: Mapping[str, str | int | bool] = _NO_OPTIONS

    def bind(self, spark: Any) -> Processor:
        """This processor for ``spark``; by default the processor itself (it uses no Spark)."""
        return self

    @abstractmethod
    def process(self, batch: pa.Table, ctx: BatchContext) -> Processed:
        """The batch's rows to commit and its dead letters (see :class:`Processor`)."""


class _Defaulted(ProcessorBase):
    """A processor written without :class:`ProcessorBase`, with the hooks it lacks defaulted
    (the hooks it has are read once, here)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        for hook in ("state", "uses_spark", "cost_model", "read_options"):
            if hasattr(inner, hook):
                setattr(self, hook, getattr(inner, hook))
        if hasattr(inner, "process_range"):  # an executor-read processor stays one
            self.process_range = inner.process_range

    def bind(self, spark: Any) -> Processor:
        return with_defaults(self.inner.bind(spark)) if hasattr(self.inner, "bind") else self

    def process(self, batch: pa.Table, ctx: BatchContext) -> Processed:
        out: Processed = self.inner.process(batch, ctx)
        return out


def with_defaults(processor: Any) -> Processor:
    """``processor`` as a full :class:`Processor`: itself when it subclasses
    :class:`ProcessorBase`, else a wrapper giving the hooks it lacks their defaults."""
    if isinstance(processor, ProcessorBase):
        return processor
    return _Defaulted(processor)


class FenceConflictError(CgError):
    """A commit was refused because the partition's watermark moved since it was read
    (another holder committed first: this run is a zombie for that range)."""

    def __init__(self, app_id: str, expected: int, found: int | None) -> None:
        super().__init__(
            f"fence conflict on {app_id}: expected watermark {expected}, found "
            f"{'unknown (concurrent commit)' if found is None else found}"
        )
        self.app_id, self.expected, self.found = app_id, expected, found


class Sink(Protocol):
    """Where effects are committed, fenced by a per-partition watermark.

    ``watermark(app_id)``: the last committed sequence for ``app_id`` (0 if none), read from a
    fresh snapshot which later ``commit`` calls are fenced against.
    ``commit(table, app_id, version, expected, markers)``: atomically append ``table`` and set
    the watermark to ``version``, only if it is still ``expected``; raises
    :class:`FenceConflictError` otherwise (nothing written). ``markers`` are other
    ``{app id: version}`` pairs recorded in the same commit and read back with ``watermark``
    (the engine records the origin sequence of the batch's last message under
    :func:`origin_marker` ``(app_id)``), not fenced. ``lineage`` (keyword) describes the batch
    for the commit's metadata: ``stream``, ``group``, ``partition``, ``first_seq``,
    ``last_seq`` (sequences of the stream read), ``last_origin_seq`` (or None); a sink records
    it with the commit (the Delta sink: ``custom_metadata``, ``cg.<name>``) or ignores it.
    """

    def watermark(self, app_id: str) -> int: ...

    def commit(self, table: pa.Table | None, app_id: str, version: int, expected: int,
               markers: Mapping[str, int] | None = None, *,
               lineage: Mapping[str, object] | None = None) -> None: ...


@runtime_checkable
class MaintainedSink(Protocol):
    """An optional sink method: ``maintain(partition, app_id)`` does the table's upkeep for one
    partition (compaction, state snapshots, retention) and returns figures for the run's
    metadata (``{name: int | float | str}``). The engine calls it while it holds the
    partition's lease, after the run's last commit, when the run committed something; it must
    not change a row or a watermark and should report failures in the figures (``error``)
    rather than raise (:meth:`cg_pipelines.sinks.delta.DeltaSink.maintain`)."""

    def maintain(self, partition: int, app_id: str) -> dict[str, int | float | str]: ...


def origin_marker(app_id: str) -> str:
    """The key under which a partition's commits record the origin stream sequence of their
    last message: ``<app_id>@origin``. A rebuild replays the origin stream up to it."""
    return f"{app_id}@origin"


@runtime_checkable
class StateSink(Sink, Protocol):
    """A sink that can serve per-key state: the last committed row of some keys.

    ``last_rows(key, keys, columns, order_by, partition)`` returns one row per key found (the
    greatest ``order_by``), with ``columns``; see
    :meth:`cg_pipelines.sinks.delta.DeltaSink.last_rows`. A processor that declares
    :class:`~cg_pipelines.core.state.KeyedState` needs one: the engine refuses any other sink
    before it reads anything.
    """

    def last_rows(
        self, key: str, keys: Sequence[object], columns: Sequence[str], order_by: str,
        partition: int | None = None,
    ) -> pa.Table: ...


class TableShape(Protocol):
    """What a sink's ``stats()`` tells a rebuild: the table's Arrow ``schema``."""

    @property
    def schema(self) -> pa.Schema: ...


@runtime_checkable
class ReplaceSink(StateSink, Protocol):
    """A sink a rebuild can use (:func:`~cg_pipelines.engine.rebuild.rebuild_partition`):
    it replaces a partition's rows in one fenced commit.

    ``write``: the table's write mode (:class:`~cg_pipelines.core.write.Append` or
    :class:`~cg_pipelines.core.write.Merge`); ``stats()``: the table's shape (its ``schema``);
    ``replace_partition(data, partition, app_id, expected, markers, lineage=...)``: replace
    ``partition``'s rows with ``data`` keeping ``app_id``'s watermark at ``expected``, fenced
    like ``commit``; returns the rows replaced; ``last_rows_written``: the rows the last
    replacement left (``None`` when the sink does not know). See
    :class:`~cg_pipelines.sinks.delta.DeltaSink`.
    """

    last_rows_written: int | None

    @property
    def write(self) -> Append | Merge: ...

    def stats(self, partition: int | None = None) -> TableShape: ...

    def replace_partition(
        self, data: pa.RecordBatchReader, partition: int, app_id: str, expected: int,
        markers: Mapping[str, int] | None = None, *,
        lineage: Mapping[str, object] | None = None,
    ) -> int: ...


def app_id_for(stream: str, group: str, partition: int) -> str:
    """The partition's watermark key in the sink: ``<stream>/<group>/<partition>``."""
    return f"{stream}/{group}/{partition}"


def with_partition_column(table: pa.Table | None, partition: int) -> pa.Table | None:
    """``table`` with :data:`PARTITION_COLUMN` (int64) set to ``partition`` on every row
    (appended, or checked when the transform kept it).

    Raises:
        ValueError: the table has the column with another partition's number.
    """
    if table is None:
        return None
    if PARTITION_COLUMN in table.column_names:
        col = table[PARTITION_COLUMN]
        if table.num_rows and not pc.all(pc.equal(col, partition)).as_py():
            raise ValueError(f"the transform's {PARTITION_COLUMN} column holds other "
                             f"partitions than {partition}")
        return table
    return table.append_column(pa.field(PARTITION_COLUMN, pa.int64(), nullable=False),
                               pa.array(np.full(table.num_rows, partition, np.int64)))


def origin_seq_of(headers: dict[str, str] | None) -> int | None:
    """The origin stream sequence of a sourced message, from its ``Nats-Stream-Source`` header
    (``<origin stream> <origin seq> <filter> <transform> <origin subject> <id>``, as
    nats-server 2.15 writes it), or None."""
    src = (headers or {}).get("Nats-Stream-Source")
    if not src:
        return None
    parts = src.split(" ")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


def user_headers(headers: dict[str, str] | None) -> dict[str, str] | None:
    """Headers without the server's ``Nats-*`` ones (stream source, pin id ...)."""
    user = {k: v for k, v in (headers or {}).items() if not k.startswith("Nats-")}
    return user or None


class PartitionHaltedError(CgError):
    """The ``halt`` policy stopped a partition at a message it could not process."""

    def __init__(self, seq: int, reason: str) -> None:
        super().__init__(f"halted at sequence {seq}: {reason}")
        self.seq, self.reason = seq, reason


RunStatus = Literal["drained", "limit", "held", "empty", "fenced", "halted", "handed_over",
                    "rebuilt"]
"""How a partition run ended (see :class:`RunResult`)."""


@dataclass(slots=True)
class RunResult:
    """Outcome of one partition run.

    ``status``: ``"drained"`` (backlog seen at start processed), ``"limit"`` (a message or time
    limit stopped it), ``"held"`` (another instance holds the partition; nothing done),
    ``"empty"`` (no backlog), ``"fenced"`` (a newer holder took over mid-run), ``"halted"``
    (the ``halt`` policy stopped at a bad message; see ``halted_at``), ``handed_over`` (the
    server names another instance as the partition's pinned holder), ``rebuilt`` (a rebuild
    replaced the partition's rows: ``messages_read`` origin messages read, ``rows_replaced``
    by ``rows_written``, from origin sequence ``origin_first_seq`` through ``origin_last_seq``).
    ``first_seq``/``last_seq``: the first and last **work-queue** sequence the run handled
    (``None``: none, as in a rebuild, which reads the origin stream only).
    ``nats_retries`` counts NATS steps retried while NATS was unreachable; ``repins`` counts
    times the run's pin was gone with no other holder (a restarted server forgets pins) and
    the run pinned itself again. ``maintenance``: the figures of the sink's ``maintain``
    hook (:class:`MaintainedSink`) when it ran (empty otherwise).
    """

    stream: str
    group: str
    partition: int
    status: RunStatus = "empty"
    first_seq: int | None = None
    last_seq: int | None = None
    processed: int = 0
    dead_lettered: int = 0
    duplicates_skipped: int = 0
    commits: int = 0
    fence_conflicts: int = 0
    nats_retries: int = 0
    repins: int = 0
    watermark: int = 0
    seconds: float = 0.0
    halted_at: int | None = None
    messages_read: int = 0
    rows_replaced: int = 0
    rows_written: int = 0
    origin_first_seq: int | None = None
    origin_last_seq: int | None = None
    detail: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    maintenance: dict[str, int | float | str] = field(default_factory=dict)

    @property
    def messages_per_second(self) -> float:
        return self.processed / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, object]:
        """A JSON-able dict (for metadata and logs), including ``messages_per_second``."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["messages_per_second"] = round(self.messages_per_second, 1)
        return d
