"""The processing step of a co-partitioned run: several named inputs in, one table out.

A co-partitioned run (:func:`~cg_pipelines.engine.join.run_copartitioned`) drains partition
``p`` of several consumer groups at once, e.g. ``impressions`` and ``clicks`` keyed by the same
auction id (the stream-join case of KIP-315, ``../shared/seeds/``). Each batch hands the
processor one Arrow table per input (:data:`~cg_pipelines.core.record.RECORD_SCHEMA`, in that
input's stream order; an input with nothing in the batch gets an empty table), and takes back
one output table and each input's dead letters (:class:`JoinProcessed`). The output and every
input's watermark then commit together (:meth:`~cg_pipelines.sinks.base.TableSink.commit`).

State shared across the inputs is declared as :class:`~cg_pipelines.core.state.KeyedState`
keyed by the join key: each input's decoded rows get the key's last committed output row
attached (``last_<column>``), exactly as for one input (:func:`~cg_pipelines.engine.
processing.with_state`). With a :class:`~cg_pipelines.core.write.Merge` table keyed by the
join key, the committed row IS the join state (an impression waiting for its click is its row
with the click columns null), so the state stays bounded by the keys the table keeps.

Ready-made: :class:`ArrowJoinProcessor` (Arrow or pandas); on Spark,
:class:`cg_pipelines.spark.join.SparkJoinProcessor`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from cg_pipelines.core.decode import JsonDecoder
from cg_pipelines.core.errors import UsageError
from cg_pipelines.core.state import KeyedState
from cg_pipelines.engine.processing import Validate, decode_batch, with_state
from cg_pipelines.engine.processor import BatchContext, DeadLetter, StateReader
from cg_pipelines.sinks.base import TableSink

__all__ = [
    "ArrowJoinProcessor",
    "attach_join_state",
    "JoinContext",
    "JoinProcessed",
    "JoinProcessor",
    "JoinTransform",
    "decode_inputs",
]


@dataclass(frozen=True, slots=True)
class JoinContext:
    """What the processing step knows about a co-partitioned batch besides its records.

    ``ranges`` maps each input name to the first and last sequence of its batch (of that
    input's work-queue stream), or None when the input had nothing in this batch; ``app_ids``
    maps each input name to its watermark key (``<stream>/<group>/<partition>``); ``state``
    serves the declared per-key state (None: none declared); ``mode`` is ``"drain"``.
    """

    partition: int
    ranges: Mapping[str, tuple[int, int] | None]
    app_ids: Mapping[str, str]
    sink: TableSink
    state: StateReader | None = None
    mode: str = "drain"

    def batch_context(self, name: str) -> BatchContext:
        """A single-input :class:`~cg_pipelines.engine.processor.BatchContext` for input
        ``name`` (e.g. to reuse a single-input helper on one side)."""
        first, last = self.ranges.get(name) or (0, 0)
        stream, group, _ = self.app_ids[name].rsplit("/", 2)
        return BatchContext(stream, group, self.partition, self.app_ids[name], first, last,
                            self.sink, self.state, self.mode)


@dataclass(slots=True)
class JoinProcessed:
    """Output of a co-partitioned batch: ``table`` (rows to commit, or None) and ``dead``
    (``{input name: [DeadLetter, ...]}``, by the sequence in that input's batch). Every
    message of every input must be either reflected in the table (or deliberately left out of
    it) or listed as a dead letter of its input: none is dropped silently."""

    table: pa.Table | None
    dead: dict[str, list[DeadLetter]] = field(default_factory=dict)


class JoinProcessor(ABC):
    """The processing step of a co-partitioned run.

    Attributes:
        inputs: the input names this processor expects (the run's
            :class:`~cg_pipelines.engine.join.JoinInput` names must be exactly these).
        state: per-key state shared by the inputs (:class:`KeyedState`), or None.
        uses_spark: the processor runs on Spark (the Dagster asset binds it to the session).
    """

    inputs: tuple[str, ...] = ()
    state: KeyedState | None = None
    uses_spark: bool = False

    def bind(self, spark: Any) -> JoinProcessor:
        """This processor for the Spark session ``spark`` (default: itself)."""
        return self

    @abstractmethod
    def process_inputs(self, batches: Mapping[str, pa.Table], ctx: JoinContext
                       ) -> JoinProcessed:
        """The batch's output rows and each input's dead letters.

        Called: once per batch, in a worker thread, while the run holds every input's lease,
        before the dead letters are published and the one fenced commit. A batch may be
        processed again (after a crash or a fence), so the output must be deterministic for
        the same batches and committed state.

        Args:
            batches: ``{input name: records}``, each an Arrow table with
                :data:`~cg_pipelines.core.record.RECORD_SCHEMA` in stream order, possibly
                empty (never all empty).
            ctx: the :class:`JoinContext`.

        Raises:
            Anything: the run fails before the commit (nothing written or acknowledged).
        """


JoinTransform = Callable[[dict[str, pa.Table], JoinContext], pa.Table]
"""``transform({input name: decoded rows}, ctx) -> pa.Table``: decoded rows as in
:func:`~cg_pipelines.engine.processing.decode_batch` (the payload fields plus ``_seq``,
``_subject``, ``_time``), with the declared state attached to each input's rows."""


def decode_inputs(
    batches: Mapping[str, pa.Table], decoders: Mapping[str, JsonDecoder],
    validate: Mapping[str, Validate] | None = None,
) -> tuple[dict[str, pa.Table], dict[str, list[DeadLetter]]]:
    """Decode each input's batch with its decoder (and optional record checks): the decoded
    tables and the dead letters, both keyed by input name (see
    :func:`~cg_pipelines.engine.processing.decode_batch`).

    Raises:
        UsageError: an input without a decoder.
    """
    missing = sorted(set(batches) - set(decoders))
    if missing:
        raise UsageError(f"no decoder for input(s) {missing}; decoders: {sorted(decoders)}")
    tables: dict[str, pa.Table] = {}
    dead: dict[str, list[DeadLetter]] = {}
    for name, batch in batches.items():
        tables[name], dead[name] = decode_batch(batch, decoders[name],
                                                (validate or {}).get(name))
    return tables, dead


class ArrowJoinProcessor(JoinProcessor):
    """Co-partitioned processing on Arrow (or pandas): each input decoded with its decoder
    (rejects become that input's dead letters), the declared state attached to each input's
    rows by the join key, then ``transform(tables, ctx)``.

    Args:
        decoders: ``{input name: JsonDecoder}``; the keys are the processor's inputs.
        transform: ``transform({name: pa.Table}, ctx) -> pa.Table`` (:data:`JoinTransform`),
            or with ``pandas=True`` ``transform({name: DataFrame}, ctx) -> DataFrame``.
            Deterministic for the same rows and committed state.
        state: the per-key state (its ``key`` must be a decoded column of every input).
        validate: optional record checks per input name.
        pandas: hand the transform pandas DataFrames.

    Raises:
        UsageError: fewer than two inputs.
    """

    def __init__(
        self, decoders: Mapping[str, JsonDecoder],
        transform: JoinTransform | Callable[..., Any], *,
        state: KeyedState | None = None, validate: Mapping[str, Validate] | None = None,
        pandas: bool = False,
    ) -> None:
        if len(decoders) < 2:
            raise UsageError(f"a join needs at least two inputs, got {sorted(decoders)}")
        self.inputs = tuple(decoders)
        self.decoders, self.transform, self.validate = dict(decoders), transform, validate
        self.state, self.pandas = state, pandas

    def process_inputs(self, batches: Mapping[str, pa.Table], ctx: JoinContext
                       ) -> JoinProcessed:
        """Decode, attach state, transform; ``JoinProcessed(None, dead)`` when no row of any
        input decodes."""
        tables, dead = decode_inputs(batches, self.decoders, self.validate)
        if not any(t.num_rows for t in tables.values()):
            return JoinProcessed(None, dead)
        tables = {n: attach_join_state(t, self.state, ctx, n) for n, t in tables.items()}
        if not self.pandas:
            return JoinProcessed(self.transform(tables, ctx), dead)
        out = self.transform({n: t.to_pandas() for n, t in tables.items()}, ctx)
        return JoinProcessed(pa.Table.from_pandas(out, preserve_index=False), dead)


def attach_join_state(table: pa.Table, spec: KeyedState | None, ctx: JoinContext,
                      name: str) -> pa.Table:
    """Input ``name``'s decoded rows with the declared state attached (its
    ``last_<column>`` columns, :func:`~cg_pipelines.engine.processing.with_state`).

    Raises:
        UsageError: the state's key is not a column of the input's decoded rows.
    """
    if spec is None:
        return table
    if spec.key not in table.column_names:
        raise UsageError(f"join state key {spec.key!r} is not a decoded column of input "
                         f"{name!r} (columns: {table.column_names})")
    return with_state(table, spec, ctx.batch_context(name))
