"""Processing steps over Arrow: decode a batch in one call, attach declared state, transform.

A batch reaches a processor as an Arrow table with
:data:`~cg_pipelines.core.record.RECORD_SCHEMA` (``seq``, ``subject``, ``time``, ``headers``,
``data``), in stream order. :func:`decode_batch` decodes the payloads with
:meth:`~cg_pipelines.core.decode.JsonDecoder.decode_column` (every payload either becomes a row
or a dead letter with its reason, whatever its bytes) and adds ``_seq`` (int64 origin stream
sequence), ``_subject`` (string, partition token stripped) and ``_time`` (timestamp ns UTC);
:func:`with_state` attaches the declared per-key state; the transform sees the good rows, in
stream order. The Spark step (:mod:`cg_pipelines.spark.processor`) shares all of it and runs
the transform on a Spark DataFrame instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cg_pipelines.core.batching import CostModel
from cg_pipelines.core.decode import JsonDecoder
from cg_pipelines.core.errors import StateError
from cg_pipelines.core.record import SEQ_COLUMN
from cg_pipelines.core.state import KeyedState, attach_state, keys_of
from cg_pipelines.engine.processor import BatchContext, DeadLetter, Processed, ProcessorBase

__all__ = [
    "META_FIELDS",
    "ArrowProcessor",
    "ArrowTransform",
    "Validate",
    "decode_batch",
    "decode_batches",
    "prepare_batches",
    "with_state",
]

META_FIELDS = [
    pa.field(SEQ_COLUMN, pa.int64(), nullable=False),
    pa.field("_subject", pa.string(), nullable=False),
    pa.field("_time", pa.timestamp("ns", tz="UTC"), nullable=False),
]

ArrowTransform = Callable[[pa.Table, BatchContext], pa.Table]
"""``transform(table, ctx) -> pa.Table`` over the decoded rows (see :func:`decode_batch`)."""

Validate = Callable[[pa.Table], Sequence[tuple[int, str]]]
"""``validate(table) -> [(row, reason), ...]``: record-level checks over the decoded rows
(payload fields and meta columns, e.g. that the subject matches the payload); each row listed
becomes a dead letter with its reason."""


def decode_batch(
    batch: pa.Table, decoder: JsonDecoder, validate: Validate | None = None
) -> tuple[pa.Table, list[DeadLetter]]:
    """Decode a batch (:data:`~cg_pipelines.core.record.RECORD_SCHEMA`) into an Arrow table of
    the decoded fields plus :data:`META_FIELDS`, in stream order, and its dead letters.

    ``_seq`` is the message's origin stream sequence (``origin_seq``; the batch's ``seq`` when
    it was read from the origin stream itself): the same number whether a partition is drained
    from the work queue or rebuilt from the origin stream. Dead letters name the batch's
    ``seq``. Every input message ends up in exactly one of the two.
    """
    table, _, dead = _decode(batch, decoder, validate)
    return table, [d for _, d in dead]


def decode_batches(
    batches: Sequence[pa.Table], decoder: JsonDecoder, validate: Validate | None = None
) -> list[tuple[pa.Table, list[DeadLetter]]]:
    """:func:`decode_batch` of each of ``batches`` (several partitions' batches of one run),
    in order, with ONE decode of all their payloads: what a decode costs per call, not per
    message, is paid once. Same results as one :func:`decode_batch` per batch (``validate``,
    a record-level check, sees the rows of all of them at once)."""
    if len(batches) < 2:
        return [decode_batch(b, decoder, validate) for b in batches]
    table, rows, dead = _decode(pa.concat_tables(batches), decoder, validate)
    ends = np.cumsum([b.num_rows for b in batches])
    cuts = np.searchsorted(rows, ends)  # rows are ascending: each batch's rows in one run
    owner = np.searchsorted(ends, np.array([i for i, _ in dead], np.int64), side="right")
    out: list[tuple[pa.Table, list[DeadLetter]]] = []
    start = 0
    for k, cut in enumerate(cuts):
        letters = [d for (_, d), o in zip(dead, owner, strict=True) if o == k]
        out.append((table.slice(start, int(cut) - start), letters))
        start = int(cut)
    return out


def _decode(batch: pa.Table, decoder: JsonDecoder, validate: Validate | None
            ) -> tuple[pa.Table, np.ndarray, list[tuple[int, DeadLetter]]]:
    """:func:`decode_batch`'s work: the decoded table, the input row of each of its rows
    (ascending), and the dead letters (sorted by sequence) with their input rows."""
    col = decoder.decode_column(batch["data"])
    rows = np.asarray(col.rows, np.int64)
    meta = batch.select(["seq", "subject", "time", "origin_seq"]).take(pa.array(rows))
    table = col.table
    seq = pc.coalesce(meta["origin_seq"], meta["seq"])
    for f, values in zip(META_FIELDS, (seq, meta["subject"], meta["time"]), strict=True):
        table = table.append_column(f, values.cast(f.type))
    seqs = batch["seq"]
    dead = [(i, DeadLetter(seqs[i].as_py(), reason)) for i, reason in col.dead]
    if validate is not None and table.num_rows:
        bad = {row: reason for row, reason in validate(table)}
        if bad:
            dead += [(int(rows[row]), DeadLetter(seqs[int(rows[row])].as_py(), reason))
                     for row, reason in sorted(bad.items())]
            keep = np.array([i for i in range(table.num_rows) if i not in bad], np.int64)
            table, rows = table.take(pa.array(keep)), rows[keep]
    return table, rows, sorted(dead, key=lambda d: d[1].seq)


def with_state(table: pa.Table, spec: KeyedState | None, ctx: BatchContext) -> pa.Table:
    """``table`` with the declared per-key state attached (``last_<column>`` columns, see
    :mod:`cg_pipelines.core.state`); ``table`` itself when ``spec`` is ``None``.

    Raises:
        StateError: state is declared but ``ctx`` carries no state reader (the processor was
            called outside the engine without one).
    """
    if spec is None:
        return table
    if ctx.state is None:
        raise StateError("the processor declares KeyedState but the batch context has no "
                         "state reader: run it through the engine (run_partition)")
    return attach_state(table, ctx.state.lookup(keys_of(table, spec.key)), spec)


def prepare_batches(
    batches: Sequence[tuple[pa.Table, BatchContext]],
    decoder: JsonDecoder,
    validate: Validate | None,
    state: KeyedState | None,
) -> list[tuple[pa.Table | None, list[DeadLetter]]]:
    """What a transform sees of each of ``batches`` (one per partition of a run, each with its
    own context): its good rows decoded (:func:`decode_batches`: one decode for all) with
    that partition's declared state attached (:func:`with_state`), or ``None`` when no row
    decoded; and its dead letters. In the order of ``batches``.

    Raises:
        StateError: as :func:`with_state`.
    """
    decoded = decode_batches([b for b, _ in batches], decoder, validate)
    return [(with_state(table, state, ctx) if table.num_rows else None, dead)
            for (table, dead), (_, ctx) in zip(decoded, batches, strict=True)]


class ArrowProcessor(ProcessorBase):
    """Processing step on Arrow (or pandas): :func:`decode_batch`, then the declared per-key
    state attached (:func:`with_state`), then ``transform(table, ctx)`` on the good rows.

    Args:
        decoder: decodes the payloads into the declared fields (rejects -> dead letters).
        transform: ``transform(table, ctx) -> pa.Table``, or with ``pandas=True``
            ``transform(df, ctx) -> pandas.DataFrame`` (the table converted with
            ``to_pandas()``; the result converted back with ``pa.Table.from_pandas``). Must be
            deterministic for the same rows and committed state.
        validate: optional record-level checks (:data:`Validate`).
        state: the per-key state the transform reads (``None``: none).
        pandas: hand the transform a pandas DataFrame instead of an Arrow table.
    """

    uses_spark = False

    def __init__(
        self,
        decoder: JsonDecoder,
        transform: ArrowTransform | Callable[..., object],
        *,
        validate: Validate | None = None,
        state: KeyedState | None = None,
        pandas: bool = False,
    ) -> None:
        self.decoder, self.transform, self.validate = decoder, transform, validate
        self.state, self.pandas = state, pandas
        self.cost_model = CostModel()  # the engine's batch sizing learns from it

    def process(self, batch: pa.Table, ctx: BatchContext) -> Processed:
        """Decode, attach state, transform; ``Processed(None, dead)`` when no row decodes."""
        return self.process_partitions([(batch, ctx)])[0]

    def process_partitions(self, batches: Sequence[tuple[pa.Table, BatchContext]]
                           ) -> list[Processed]:
        """Several partitions' batches: every payload decoded in ONE call
        (:func:`prepare_batches`), then each partition's rows through the transform with its
        own context, as :meth:`process` does."""
        prepared = prepare_batches(batches, self.decoder, self.validate, self.state)
        return [self._transformed(table, dead, ctx)
                for (table, dead), (_, ctx) in zip(prepared, batches, strict=True)]

    def _transformed(self, table: pa.Table | None, dead: list[DeadLetter], ctx: BatchContext
                     ) -> Processed:
        if table is None:
            return Processed(None, dead)
        if not self.pandas:
            return Processed(self.transform(table, ctx), dead)
        out = self.transform(table.to_pandas(), ctx)
        return Processed(pa.Table.from_pandas(out, preserve_index=False), dead)
