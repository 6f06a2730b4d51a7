"""The Spark processing step of a partition run, and helpers for Spark transforms.

- :class:`SparkProcessor` implements the engine's :class:`~cg_pipelines.engine.model.Processor`:
  records are decoded per record (:func:`~cg_pipelines.engine.processing.decode_batch`: a
  rejected payload becomes a dead letter with its reason), the good rows go to Spark as one
  DataFrame built from Arrow, the user's transform runs on it, and the result comes back to the
  driver as an Arrow table for the engine's fenced commit.
- :func:`last_rows_by_key`: the committed rows of some keys, last one per key — per-key state
  that crosses batch boundaries (a key's previous event).
- :func:`read_range_with_spark`: a sequence range of a stream as a DataFrame, read on the
  executors by the ``jetstream`` data source (:mod:`cg_pipelines.spark.datasource`).

Types across the Arrow <-> Spark boundary: ``int64`` <-> long, ``string`` <-> string,
``float64`` <-> double, ``bool`` <-> boolean, ``timestamp[ns, tz=UTC]`` -> timestamp (Spark keeps
**microseconds**: nanoseconds are truncated) -> ``timestamp[us, tz=UTC]`` in the result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession

from cg_pipelines.core.decode import JsonDecoder
from cg_pipelines.engine.model import BatchContext, Processed, Record
from cg_pipelines.engine.processing import decode_batch
from cg_pipelines.spark.datasource import SOURCE_NAME, register_jetstream_source
from cg_pipelines.spark.session import get_spark

__all__ = [
    "SparkProcessor",
    "SparkTransform",
    "last_rows_by_key",
    "read_range_with_spark",
]

SparkTransform = Callable[[SparkSession, DataFrame, BatchContext], DataFrame]
"""``transform(spark, df, ctx) -> DataFrame``: ``df`` holds the decoded fields plus ``_seq``
(long), ``_subject`` (string) and ``_time`` (timestamp UTC) of the batch's good rows."""


class SparkProcessor:
    """Processing step that runs a Spark transform on each batch.

    Args:
        decoder: decodes each payload into the declared fields (rejects -> dead letters).
        transform: ``transform(spark, df, ctx) -> DataFrame``; must be deterministic for the
            same rows and committed state (a batch can be re-processed after a fence conflict).
            Spark does not keep row order through shuffles: order inside the transform with
            window functions over ``_seq``.
        spark: the session to use; default :func:`~cg_pipelines.spark.session.get_spark`
            (started lazily on the first non-empty batch).
        validate: optional ``validate(record, row)`` raising
            :class:`~cg_pipelines.core.decode.BadMessage` for record-level checks.
        order_by: when the result has this column, the returned Arrow table is sorted by it
            (stable, ascending), so the committed rows come in stream order; ``None`` keeps
            Spark's order.

    ``process`` returns ``Processed(None, dead)`` when no record decodes (Spark is not
    touched), else ``Processed(table, dead)`` with the transform's result as an Arrow table.
    """

    def __init__(
        self,
        decoder: JsonDecoder,
        transform: SparkTransform,
        *,
        spark: SparkSession | None = None,
        validate: Callable[[Record, dict], None] | None = None,
        order_by: str | None = "_seq",
    ) -> None:
        self.decoder = decoder
        self.transform = transform
        self._spark = spark
        self.validate = validate
        self.order_by = order_by

    @property
    def spark(self) -> SparkSession:
        """The session (started on first access when none was given)."""
        if self._spark is None:
            self._spark = get_spark()
        return self._spark

    def to_dataframe(self, table: pa.Table) -> DataFrame:
        """An Arrow table as a Spark DataFrame (``spark.createDataFrame(table)``: the Arrow
        batches are streamed to the JVM as is; column types and nullability are kept,
        timestamps become Spark timestamps in UTC)."""
        return self.spark.createDataFrame(table)

    def process(self, records: Sequence[Record], ctx: BatchContext) -> Processed:
        """Decode, transform on Spark, return the result as Arrow.

        Raises:
            Whatever the transform or Spark raises (e.g. ``pyspark.errors.AnalysisException``);
            the engine then commits nothing for the batch.
        """
        table, dead = decode_batch(records, self.decoder, self.validate)
        if table.num_rows == 0:
            return Processed(None, dead)
        df = self.to_dataframe(table)
        out = self.transform(self.spark, df, ctx).toArrow()
        if self.order_by is not None and self.order_by in out.column_names:
            out = out.sort_by(self.order_by)
        return Processed(out, dead)


def _empty(schema: pa.Schema | None, columns: Sequence[str] | None) -> pa.Table:
    if schema is None:
        return pa.table({})
    if columns is not None:
        schema = pa.schema([schema.field(c) for c in columns])
    return schema.empty_table()


def last_rows_by_key(
    ctx: BatchContext,
    key: str,
    keys: Sequence[Any],
    order_col: str = "_seq",
    *,
    columns: Sequence[str] | None = None,
    schema: pa.Schema | None = None,
) -> pa.Table:
    """The last committed row of each of ``keys`` (by ``order_col``), read from ``ctx.sink``.

    Calls ``ctx.sink.read(columns=columns, filter=pc.field(key).isin(keys))`` (a
    pyarrow.compute expression over the committed table) and keeps, per key, the row with the
    greatest ``order_col`` (on ties, the later row of the read). Keys without committed rows
    are absent.

    Args:
        key: key column name. keys: key values (duplicates allowed; Python values of the
            column's type).
        order_col: ordering column, default ``"_seq"`` (the stream sequence).
        columns: columns to read (must include ``key`` and ``order_col``); default all.
        schema: schema of the empty table returned when nothing can be read (see below);
            without it that table has no columns.

    Returns:
        One row per key found, sorted by key. An empty table when ``keys`` is empty or the
        sink has no ``read`` method (a sink that cannot serve state).

    Raises:
        KeyError: ``key`` or ``order_col`` missing from what the sink returned.
        Whatever ``sink.read`` raises.
    """
    read = getattr(ctx.sink, "read", None)
    if not keys or read is None:
        return _empty(schema, columns)
    flt = pc.field(key).isin(list(dict.fromkeys(keys)))
    table: pa.Table = read(columns=list(columns) if columns is not None else None, filter=flt)
    for c in (key, order_col):
        if c not in table.column_names:
            raise KeyError(f"column {c!r} not in the sink's table ({table.column_names})")
    if table.num_rows == 0:
        return table
    ordered = table.sort_by([(order_col, "ascending")])
    idx = ordered.append_column("__row", pa.array(range(ordered.num_rows), pa.int64()))
    last = idx.group_by(key, use_threads=False).aggregate([("__row", "max")])
    picked = ordered.take(last["__row_max"])
    return picked.sort_by([(key, "ascending")])


def read_range_with_spark(
    spark: SparkSession,
    servers: str,
    stream: str,
    subject: str,
    first_seq: int,
    last_seq: int,
    partitions: int = 1,
    **options: str | int | bool,
) -> DataFrame:
    """Messages ``first_seq <= seq <= last_seq`` of ``stream`` matching ``subject``, read on
    the executors by the ``jetstream`` data source in ``partitions`` contiguous sub-ranges.

    Extra ``options`` go to the source (``strip_partition=True``, ``batch=2000``,
    ``max_bytes``, ``timeout``, ``user``/``password``/``token``/``creds``/``tls_ca`` ...).
    Schema: :data:`~cg_pipelines.spark.datasource.SPARK_RECORD_SCHEMA`. Rows are in sequence
    order within each input partition only: use ``orderBy("seq")`` for stream order.

    Raises:
        ValueError: bad options (at planning, i.e. on the first action or schema analysis).
    """
    register_jetstream_source(spark)
    reader = (
        spark.read.format(SOURCE_NAME)
        .option("servers", servers)
        .option("stream", stream)
        .option("subject", subject)
        .option("first_seq", first_seq)
        .option("last_seq", last_seq)
        .option("partitions", partitions)
    )
    for k, v in options.items():
        reader = reader.option(k, str(v).lower() if isinstance(v, bool) else v)
    return reader.load()
