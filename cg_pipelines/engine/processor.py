"""The processor contract: what the engine hands the processing step and what it takes back.

A processor turns one batch of a partition's messages (an Arrow table with
:data:`~cg_pipelines.core.record.RECORD_SCHEMA`, in stream order) into rows to commit and
dead letters (:class:`Processed`). The engine calls it in a worker thread
(``asyncio.to_thread``) while the run holds the partition's lease, before the batch's fenced
commit; nothing of the batch is visible or acknowledged until that commit. Every hook the
engine and the Dagster integration read is declared on :class:`Processor`; subclass
:class:`ProcessorBase` for their defaults (:func:`with_defaults` gives a processor that only
has ``process`` the same defaults). Ready-made processors:
:class:`~cg_pipelines.engine.processing.ArrowProcessor` and
:class:`~cg_pipelines.spark.SparkProcessor`; a processor that can read a whole range on Spark
executors is a :class:`~cg_pipelines.engine.executor_read.RangeProcessor`.

Units: sequences are sequences of the stream read (``int``, first is 1); ``time_ns`` is the
store time in nanoseconds since the Unix epoch.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

import pyarrow as pa

from cg_pipelines.core.batching import CostModel
from cg_pipelines.core.record import RECORD_SCHEMA
from cg_pipelines.core.state import KeyedState
from cg_pipelines.sinks.base import TableSink

__all__ = [
    "BatchContext",
    "DeadLetter",
    "Processed",
    "Processor",
    "ProcessorBase",
    "Record",
    "StateReader",
    "records_to_arrow",
    "with_defaults",
]


@dataclass(frozen=True, slots=True)
class Record:
    """One message of a partition, as user code sees it.

    ``subject`` has the partition token stripped (the origin stream's subject); ``seq`` is the
    sequence in the stream read: the **work-queue** stream's (for static groups, the origin
    stream's); ``time_ns`` the store time in nanoseconds since the epoch; ``headers`` the user
    headers (:func:`~cg_pipelines.core.record.user_headers`); ``origin_seq`` the **origin**
    stream's sequence of a sourced message (None when the stream read is the origin). The
    decoded batch's and the output's column ``_seq``
    (:data:`~cg_pipelines.core.record.SEQ_COLUMN`) is the origin sequence: ``origin_seq``,
    else ``seq``.
    """

    seq: int
    subject: str
    data: bytes
    time_ns: int
    headers: dict[str, str] | None = None
    origin_seq: int | None = None


def records_to_arrow(records: Sequence[Record]) -> pa.Table:
    """A batch as an Arrow table with :data:`~cg_pipelines.core.record.RECORD_SCHEMA` (in the
    given order; headers as a JSON object string)."""
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
    """A message the processing step could not handle (by its sequence ``seq`` in the batch),
    and why (``reason``, one line; stored as the dead letter's ``Cg-Error`` header)."""

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


class StateReader(Protocol):
    """Per-key state for a batch (see :class:`~cg_pipelines.core.state.KeyedState`)."""

    def lookup(self, keys: Sequence[object]) -> pa.Table:
        """The last row of each key of ``keys`` that has one (newest first: the batches
        processed earlier in the run, else the sink), with the spec's ``read_columns``;
        keys without a row are absent.

        Raises:
            Storage errors of the sink's ``last_rows``: the batch fails, so does the run.
        """
        ...


@dataclass(frozen=True, slots=True)
class BatchContext:
    """What the processing step knows about the batch besides its records.

    ``app_id`` is the partition's watermark key in the sink (``<stream>/<group>/<partition>``);
    ``first_seq``/``last_seq`` the batch's first and last sequence (of the stream read; origin
    sequences in a rebuild); ``sink`` is where the batch will be committed; ``state`` serves
    the per-key state the processor declared (``None`` when it declared none); ``mode`` is
    ``"drain"`` or ``"rebuild"`` (a rebuild replays the partition's history from empty state).
    """

    stream: str
    group: str
    partition: int
    app_id: str
    first_seq: int
    last_seq: int
    sink: TableSink
    state: StateReader | None = None
    mode: str = "drain"


class Processor(Protocol):
    """The processing step: turns a batch (in stream order) into rows to commit.

    Attributes (hooks, read once per run):
        state: the per-key state the processor reads
            (:class:`~cg_pipelines.core.state.KeyedState`), ``None`` for none. The engine
            serves it from the sink
            (:meth:`~cg_pipelines.sinks.base.TableSink.last_rows`) and checks each output
            against it.
        uses_spark: the processor runs on Spark (the Dagster asset then requires the Spark
            resource and calls :meth:`bind`).
        cost_model: a :class:`~cg_pipelines.core.batching.CostModel` the engine's adaptive
            batch sizing learns into (``None``: a fresh one per run).
        read_options: extra ``jetstream`` source options for an executor read (e.g. TLS
            files; :class:`~cg_pipelines.engine.executor_read.RangeProcessor`).
    """

    state: KeyedState | None
    uses_spark: bool
    cost_model: CostModel | None
    read_options: Mapping[str, str | int | bool]

    def bind(self, spark: Any) -> Processor:
        """A copy of this processor that uses the Spark session ``spark``.

        Called: by the Dagster asset, once per run, before the engine starts, when
        :attr:`uses_spark` is true."""
        ...

    def process(self, batch: pa.Table, ctx: BatchContext) -> Processed:
        """The batch's rows to commit and its dead letters.

        Called: once per batch, in a worker thread, under the partition's lease, before the
        batch's dead letters are published and its fenced commit. The same batch may be
        processed again: after a crash or a fence conflict (by the next run), and under the
        ``halt`` policy (its part before the first dead letter, alone). So the output must be
        deterministic for the same batch and committed state.

        Args:
            batch: the messages, an Arrow table with
                :data:`~cg_pipelines.core.record.RECORD_SCHEMA`, in stream order; never empty.
            ctx: the batch's :class:`BatchContext` (``ctx.state`` serves the declared state).

        Returns:
            :class:`Processed`: every input sequence either reflected in its ``table`` or
            listed in its ``dead`` letters. The engine adds
            :data:`~cg_pipelines.sinks.base.PARTITION_COLUMN` to the table.

        Raises:
            Anything: the run fails before the batch's commit (nothing of it written or
            acknowledged) and the exception propagates. The engine raises
            :class:`~cg_pipelines.core.errors.ContractError` itself when the output
            dead-letters a sequence not in the batch, holds other partitions' rows, or
            (``halt``) the re-processed part gives dead letters;
            :class:`~cg_pipelines.core.contract.OutputContractError` when the table misses (or
            mistypes) a column the declared state needs.
        """
        ...

    def process_partitions(self, batches: Sequence[tuple[pa.Table, BatchContext]]
                           ) -> list[Processed]:
        """Several partitions' batches of one run over a range of partitions of a group
        (:func:`~cg_pipelines.engine.runner.run_partitions`), one :class:`Processed` per
        ``(batch, ctx)``, in order, each exactly what :meth:`process` would give it.

        Called: instead of :meth:`process` once per partition, when a batch of such a run
        holds messages of two or more partitions. Optional (:class:`ProcessorBase`'s default
        calls :meth:`process` for each): a processor overrides it to share work across the
        partitions, e.g. :class:`~cg_pipelines.engine.processing.ArrowProcessor` decodes every
        partition's payloads in one call (what costs per call, not per message, is then paid
        once per batch instead of once per partition).

        Raises:
            As :meth:`process`.
        """
        ...


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
        """The batch's rows to commit and its dead letters (the contract:
        :meth:`Processor.process`)."""

    def process_partitions(self, batches: Sequence[tuple[pa.Table, BatchContext]]
                           ) -> list[Processed]:
        """:meth:`process` for each ``(batch, ctx)``, in order (the contract:
        :meth:`Processor.process_partitions`)."""
        return [self.process(batch, ctx) for batch, ctx in batches]


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
        if hasattr(inner, "process_partitions"):
            self.process_partitions = inner.process_partitions  # type: ignore[method-assign]

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
