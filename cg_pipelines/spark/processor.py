"""The Spark processing step of a partition run.

:class:`SparkProcessor` implements the engine's :class:`~cg_pipelines.engine.processor.Processor`:
the batch is decoded in one call (:func:`~cg_pipelines.engine.processing.decode_batch`: a rejected
payload becomes a dead letter with its reason), the declared per-key state is attached in Arrow
(:func:`~cg_pipelines.engine.processing.with_state`: ``last_<column>`` columns, no Spark job),
the good rows go to Spark as one DataFrame built from Arrow, the user's transform runs on it, and
the result comes back to the driver as an Arrow table for the engine's fenced commit.
:func:`read_range_with_spark` reads a sequence range of a stream as a DataFrame on the executors
(the ``jetstream`` data source, :mod:`cg_pipelines.spark.datasource`).

:meth:`SparkProcessor.process_range` is the executor-read path of a large backlog (the engine's
``EngineOptions.executor_read_min_msgs``): the range is read by the data source on the
executors, decoded there by the same strict decoder (``mapInArrow`` running
:func:`~cg_pipelines.engine.processing.decode_batch`, so rows and dead-letter reasons are those
of ``process``), cached, and summed up in one job (messages, last sequence, its origin sequence,
the dead rows and, with declared state, the batch's keys, which are all the driver receives);
the declared state is read on the driver (``ctx.state.lookup``) and broadcast-joined as the
``last_<column>`` columns; then the transform runs and its result comes back as Arrow.

Types across the Arrow <-> Spark boundary: ``int64`` <-> long, ``string`` <-> string,
``float64`` <-> double, ``bool`` <-> boolean, ``timestamp[ns, tz=UTC]`` -> timestamp (Spark keeps
**microseconds**: nanoseconds are truncated) -> ``timestamp[us, tz=UTC]`` in the result.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_type, to_arrow_schema, to_arrow_type
from pyspark.sql.types import (
    BinaryType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from cg_pipelines.core.batching import CostModel
from cg_pipelines.core.decode import JsonDecoder
from cg_pipelines.core.errors import (
    ColumnNotFoundError,
    ContractError,
    InvariantError,
    StateError,
    UsageError,
)
from cg_pipelines.core.record import RECORD_SCHEMA, SEQ_COLUMN
from cg_pipelines.core.state import KeyedState
from cg_pipelines.engine.executor_read import RangeProcessed
from cg_pipelines.engine.processing import Validate, decode_batch, prepare_batches
from cg_pipelines.engine.processor import BatchContext, DeadLetter, Processed, ProcessorBase
from cg_pipelines.spark.datasource import SOURCE_NAME, register_jetstream_source
from cg_pipelines.spark.session import get_spark

__all__ = [
    "SparkProcessor",
    "SparkTransform",
    "read_range_with_spark",
]

SparkTransform = Callable[[SparkSession, DataFrame, BatchContext], DataFrame]
"""``transform(spark, df, ctx) -> DataFrame``: ``df`` holds the decoded fields, ``_seq`` (long),
``_subject`` (string), ``_time`` (timestamp UTC) of the batch's good rows, and the declared
state as ``last_<column>`` columns."""


@dataclasses.dataclass(frozen=True)
class _RangeFacts:
    """What one job over a decoded range found: ``n`` messages, the ``first`` and ``last``
    work-queue sequences and the last one's ``origin`` sequence (None: no message), the
    ``dead`` rows (Arrow, sorted by ``seq``, with ``reason``) and the good rows' state ``keys``."""

    n: int
    first: int | None
    last: int | None
    origin: int | None
    dead: pa.Table
    keys: list[object]


class SparkProcessor(ProcessorBase):
    """Processing step that runs a Spark transform on each batch.

    Args:
        decoder: decodes each payload into the declared fields (rejects -> dead letters).
        transform: ``transform(spark, df, ctx) -> DataFrame``; must be deterministic for the
            same rows and committed state (a batch can be re-processed after a fence conflict).
            Spark does not keep row order through shuffles: order inside the transform with
            window functions over ``_seq``.
        state: the per-key state the transform reads (:class:`~cg_pipelines.core.state.
            KeyedState`), attached to ``df`` as ``last_<column>`` columns.
        spark: the session; usually left out and bound per run with :meth:`bind` (the Dagster
            integration binds its :class:`~cg_pipelines.dagster.SparkResource`'s session).
            Unbound, the first batch with rows starts
            :func:`~cg_pipelines.spark.session.get_spark`'s default local session.
        validate: optional record-level checks
            (:data:`~cg_pipelines.engine.processing.Validate`).
        order_by: when the result has this column, the returned Arrow table is sorted by it
            (stable, ascending), so the committed rows come in stream order; ``None`` keeps
            Spark's order.
        schema: when given, the result is cast to it (column order, types, nullability: Spark
            reports computed columns as nullable).
        read_options: extra ``jetstream`` source options for :meth:`process_range` (the
            executor read): ``partitions`` (input partitions; default the session's default
            parallelism), ``batch`` (messages per direct-get request, default
            :data:`RANGE_READ_BATCH`), the TLS files
            ``tls_ca``/``tls_cert``/``tls_key`` when the engine's connection uses TLS, or
            ``servers`` and credentials when executors reach NATS by another address than the
            driver. They win over what the engine derives, except the range itself.
        key_local: the transform computes each key's rows from that key's rows and state
            alone (window functions partitioned by the key, no aggregate over the batch) and
            keeps ``_seq``. Then a run over several partitions of a group (a key never spans
            two) transforms all their rows in ONE Spark job per batch
            (:meth:`process_partitions`), not one job per partition: each partition's rows
            decoded and given its own state first, the result handed back to each partition
            by ``_seq``. That one call's ``ctx`` is the first partition's, with
            ``first_seq``/``last_seq`` spanning every partition's batch: such a transform must
            not depend on ``ctx.partition`` or ``ctx.app_id``. Raises
            :class:`~cg_pipelines.core.errors.ContractError` when the result lacks ``_seq`` or
            holds a ``_seq`` of no input row. ``False`` (default): one call per partition,
            exactly as a one-partition run.

    ``process`` returns ``Processed(None, dead)`` when no record decodes (Spark is not
    touched), else ``Processed(table, dead)`` with the transform's result as an Arrow table.
    """

    uses_spark = True

    def __init__(
        self,
        decoder: JsonDecoder,
        transform: SparkTransform,
        *,
        state: KeyedState | None = None,
        spark: SparkSession | None = None,
        validate: Validate | None = None,
        order_by: str | None = SEQ_COLUMN,
        schema: pa.Schema | None = None,
        read_options: Mapping[str, str | int | bool] | None = None,
        key_local: bool = False,
    ) -> None:
        self.decoder = decoder
        self.transform = transform
        self.state = state
        self._spark = spark
        self.validate = validate
        self.order_by = order_by
        self.schema = schema
        self.read_options = dict(read_options or {})
        self.key_local = key_local
        self.cost_model = CostModel()  # shared by bound copies: batch sizing learns across runs

    def bind(self, spark: SparkSession) -> SparkProcessor:
        """A copy of this processor that uses ``spark`` (this one is left unchanged)."""
        bound = copy.copy(self)
        bound._spark = spark
        return bound

    @property
    def spark(self) -> SparkSession:
        """The bound session (a default local one is started when none was bound)."""
        if self._spark is None:
            self._spark = get_spark()
        return self._spark

    def to_dataframe(self, table: pa.Table) -> DataFrame:
        """An Arrow table as a Spark DataFrame (``spark.createDataFrame(table)``: the Arrow
        batches are streamed to the JVM as is; column types and nullability are kept,
        timestamps become Spark timestamps in UTC)."""
        return self.spark.createDataFrame(table)

    def process(self, batch: pa.Table, ctx: BatchContext) -> Processed:
        """Decode, attach state, transform on Spark, return the result as Arrow.

        Raises:
            Whatever the transform or Spark raises (e.g. ``pyspark.errors.AnalysisException``);
            the engine then commits nothing for the batch.
        """
        [(table, dead)] = prepare_batches([(batch, ctx)], self.decoder, self.validate,
                                          self.state)
        if table is None:
            return Processed(None, dead)
        out = self.transform(self.spark, self.to_dataframe(table), ctx).toArrow()
        return Processed(self._finish(out), dead)

    def process_partitions(self, batches: Sequence[tuple[pa.Table, BatchContext]]
                           ) -> list[Processed]:
        """Several partitions' batches of one run: with ``key_local``, every partition's
        payloads decoded in one call (:func:`~cg_pipelines.engine.processing.prepare_batches`),
        each given its own state, and ONE transform (one Spark job) over all their rows, the
        result split back by ``_seq``; without it, :meth:`process` per partition.

        Raises:
            ContractError: (``key_local``) the result lacks ``_seq`` or holds a ``_seq`` of no
                input row.
            As :meth:`process`.
        """
        if not self.key_local or len(batches) < 2:
            return [self.process(b, c) for b, c in batches]
        prepared = prepare_batches(batches, self.decoder, self.validate, self.state)
        parts = [(i, table) for i, (table, _) in enumerate(prepared) if table is not None]
        if not parts:
            return [Processed(None, dead) for _, dead in prepared]
        first = batches[parts[0][0]][1]
        ctx = dataclasses.replace(first, first_seq=min(c.first_seq for _, c in batches),
                                  last_seq=max(c.last_seq for _, c in batches))
        joined = pa.concat_tables([t for _, t in parts], promote_options="default")
        out = self.transform(self.spark, self.to_dataframe(joined), ctx).toArrow()
        if SEQ_COLUMN not in out.column_names:
            raise ContractError(f"a key_local transform must keep {SEQ_COLUMN!r}; its result "
                                f"has {out.column_names}")
        # each result row's partition: the one whose input row has its _seq
        owner = np.repeat([i for i, _ in parts], [t.num_rows for _, t in parts])
        at = pc.index_in(out[SEQ_COLUMN].cast(pa.int64()),
                         value_set=joined[SEQ_COLUMN].cast(pa.int64()))
        if at.null_count:
            raise ContractError(f"a key_local transform returned {at.null_count} row(s) whose "
                                f"{SEQ_COLUMN!r} is no input row's")
        side = owner[at.to_numpy(zero_copy_only=False)]
        results: list[Processed] = []
        for i, (table, dead) in enumerate(prepared):
            if table is None:
                results.append(Processed(None, dead))
                continue
            results.append(Processed(self._finish(out.filter(pa.array(side == i))), dead))
        return results

    def _finish(self, out: pa.Table) -> pa.Table:
        if self.order_by is not None and self.order_by in out.column_names:
            out = out.sort_by(self.order_by)
        if self.schema is not None:
            out = out.select(self.schema.names).cast(self.schema)
        return out

    # ---------------------------------------------------------------------- executor read

    def process_range(self, source: Mapping[str, str], ctx: BatchContext) -> RangeProcessed:
        """Read, decode and transform a whole sequence range on the executors (the engine's
        executor read, :class:`~cg_pipelines.engine.executor_read.RangeProcessor`).

        ``source`` holds the ``jetstream`` source options the engine derived (servers and
        credentials, the work-queue stream, ``subject`` ``<p>.>``, ``first_seq``,
        ``last_seq``, ``strip_partition``); :attr:`read_options` are added over them (not over
        the range). The result is, message for message, what :meth:`process` gives for the
        same messages in one batch: the same decoder and ``validate`` run on the executors
        (``mapInArrow``
        over :func:`~cg_pipelines.engine.processing.decode_batch`), ``_seq`` is the origin
        sequence, the declared state is attached as ``last_<column>`` (broadcast join; the
        same values as :func:`~cg_pipelines.core.state.attach_state`), the transform sees
        the same columns with the same types and nullability. Spark jobs: one that reads,
        decodes and caches the range and returns its facts, dead rows and keys; the
        transform's. The transform's ``ctx`` has the first and last sequence read.

        The decoder and ``validate`` are pickled to the executors' Python workers:
        ``validate`` must be importable there (a function of an installed package or of the
        working directory), as for any Spark UDF.

        Raises:
            Whatever the read (a job failure naming the NATS error), the transform or Spark
            raise; the engine then commits nothing.
        """
        spark = self.spark
        register_jetstream_source(spark)
        opts = {**source, **{k: (str(v).lower() if isinstance(v, bool) else str(v))
                             for k, v in self.read_options.items()}}
        opts.update({k: source[k] for k in _RANGE_KEYS if k in source})  # never the range
        if "partitions" not in opts:
            opts["partitions"] = str(_default_parallelism(spark))
        opts.setdefault("batch", str(RANGE_READ_BATCH))
        schema = _decoded_spark_schema(self.decoder)
        step = _ExecutorDecode(self.decoder, self.validate,
                               to_arrow_schema(schema, timezone="UTC"))
        t = time.monotonic()
        raw = spark.read.format(SOURCE_NAME).options(**opts).load()
        decoded = raw.mapInArrow(step, schema).persist(StorageLevel.MEMORY_AND_DISK)
        try:
            facts = self._range_facts(decoded)
            read_s = time.monotonic() - t
            t = time.monotonic()
            messages = facts.n
            dead_table = facts.dead
            dead = [DeadLetter(q, r) for q, r in zip(dead_table["seq"].to_pylist(),
                                                     dead_table["reason"].to_pylist(),
                                                     strict=True)]
            dead_records = dead_table.drop_columns(["reason"]).select(RECORD_SCHEMA.names).cast(
                RECORD_SCHEMA)
            out: pa.Table | None = None
            if messages > len(dead):
                df = decoded.filter(F.col(_DEAD).isNull()).select(
                    *[f.name for f in self.decoder.arrow_schema], SEQ_COLUMN, "_subject", "_time")
                df = self._attach_state(spark, df, facts.keys, ctx)
                sub = dataclasses.replace(ctx, first_seq=facts.first or ctx.first_seq,
                                          last_seq=facts.last or ctx.last_seq)
                out = self._finish(self.transform(spark, df, sub).toArrow())
            return RangeProcessed(
                Processed(out, dead), dead_records, messages, facts.first, facts.last,
                facts.origin, {"read_executors": read_s, "process": time.monotonic() - t})
        finally:
            decoded.unpersist()

    def _range_facts(self, decoded: DataFrame) -> _RangeFacts:
        """One job over the decoded range (it reads, decodes and caches it): messages, first
        and last work-queue sequence, the last one's origin sequence, the dead rows (Arrow,
        sorted by sequence, with ``reason``) and, with declared state, the good rows' keys."""
        dead_row = F.struct(
            F.col(_WQ_SEQ).alias("seq"), F.col("_subject").alias("subject"),
            F.col("_time").alias("time"), F.col(_HEADERS).alias("headers"),
            F.col(_DATA).alias("data"), F.col(_ORIGIN).alias("origin_seq"),
            F.col(_DEAD).alias("reason"))
        aggs = [F.count(F.lit(1)).alias("n"), F.min(_WQ_SEQ).alias("first"),
                F.max(_WQ_SEQ).alias("last"), F.max_by(_ORIGIN, _WQ_SEQ).alias("origin"),
                F.collect_list(F.when(F.col(_DEAD).isNotNull(), dead_row)).alias("dead")]
        key = self.state.key if self.state is not None else None
        names = [*self.decoder.arrow_schema.names, SEQ_COLUMN, "_subject", "_time"]
        if key is not None and key in names:
            aggs.append(F.collect_set(F.when(F.col(_DEAD).isNull(), F.col(key))).alias("keys"))
        row = decoded.agg(*aggs).toArrow()
        dead_type = row.schema.field("dead").type.value_type
        dead_list = row["dead"].combine_chunks()
        if len(dead_list):
            dead = pa.Table.from_struct_array(dead_list.flatten())
        else:
            dead = pa.Table.from_struct_array(pa.array([], dead_type))
        dead = dead.sort_by("seq")
        keys: list[object] = []
        if "keys" in row.column_names and len(row["keys"]):
            keys = sorted(row["keys"].combine_chunks().flatten().drop_null().to_pylist(),
                          key=lambda v: (str(type(v)), v))
        return _RangeFacts(int(row["n"][0].as_py() or 0), row["first"][0].as_py(),
                           row["last"][0].as_py(), row["origin"][0].as_py(), dead, keys)

    def _attach_state(self, spark: SparkSession, df: DataFrame, keys: list[object],
                      ctx: BatchContext) -> DataFrame:
        """``df`` with the declared state attached as ``prefix + column`` (see
        :func:`~cg_pipelines.core.state.attach_state`: null where a key has no state), by a
        broadcast left join with the keys' last rows (read through ``ctx.state``)."""
        spec = self.state
        if spec is None:
            return df
        if ctx.state is None:
            raise StateError("the processor declares KeyedState but the batch context has no "
                             "state reader: run it through the engine (run_partition)")
        if spec.key not in df.columns:
            raise ColumnNotFoundError(f"state key {spec.key!r} not in the batch's columns "
                                      f"{df.columns}")
        clash = [n for n in spec.attached_names if n in df.columns]
        if clash:
            raise UsageError(f"state columns {clash} clash with the batch's own columns: choose "
                             "another KeyedState.prefix")
        state = ctx.state.lookup(keys)
        columns = df.columns
        types = {f.name: f.type for f in state.schema}
        typed = [(c, n) for c, n in zip(spec.columns, spec.attached_names, strict=True)
                 if state.num_rows and not pa.types.is_null(types.get(c, pa.null()))]
        if typed:
            key_type = to_arrow_type(df.schema[spec.key].dataType, timezone="UTC")
            right = pa.table({_STATE_KEY: state[spec.key].cast(key_type),
                              **{n: state[c] for c, n in typed}})
            sdf = spark.createDataFrame(right)
            df = df.join(F.broadcast(sdf), df[spec.key] == sdf[_STATE_KEY], "left")
        out = []
        for c, n in zip(spec.columns, spec.attached_names, strict=True):
            if (c, n) in typed:
                out.append(F.col(n))
            else:
                out.append(F.lit(None).cast(from_arrow_type(types.get(c, pa.null()))).alias(n))
        return df.select(*[df[c] for c in columns], *out)


RANGE_READ_BATCH = 50_000
"""Messages per direct-get request of :meth:`SparkProcessor.process_range`'s read (unless
``read_options`` say ``batch``): an executor reads about 35k msg/s with 2,000 per request and
80k with 20,000-50,000 (bench/spark_read.py; each request is capped at 16 MiB anyway)."""

_WQ_SEQ, _ORIGIN, _DEAD, _HEADERS, _DATA = (
    "__cg_wq_seq", "__cg_origin_seq", "__cg_dead", "__cg_headers", "__cg_data")
_STATE_KEY = "__cg_state_key"
_RANGE_KEYS = ("stream", "subject", "first_seq", "last_seq", "strip_partition")
_PLACEHOLDER = {pa.string(): "", pa.int64(): 0, pa.float64(): 0.0, pa.bool_(): False}


def _default_parallelism(spark: SparkSession) -> int:
    try:
        return max(1, int(spark.sparkContext.defaultParallelism))
    except Exception:  # Spark Connect has no SparkContext
        return 2


def _decoded_spark_schema(decoder: JsonDecoder) -> StructType:
    """What the executors' decode step emits for every message: the decoded fields (types and
    nullability as :func:`~cg_pipelines.engine.processing.decode_batch` gives them; a dead
    row holds placeholders in the non-nullable ones), ``_seq``, ``_subject``, ``_time``, then
    the work-queue sequence, the origin sequence, the dead-letter reason (null for a good row)
    and, for dead rows only, the user headers and the payload."""
    fields = [StructField(f.name, from_arrow_type(f.type), f.nullable)
              for f in decoder.arrow_schema]
    return StructType([
        *fields,
        StructField(SEQ_COLUMN, LongType(), False),
        StructField("_subject", StringType(), False),
        StructField("_time", TimestampType(), False),
        StructField(_WQ_SEQ, LongType(), False),
        StructField(_ORIGIN, LongType(), True),
        StructField(_DEAD, StringType(), True),
        StructField(_HEADERS, StringType(), True),
        StructField(_DATA, BinaryType(), True),
    ])


def _user_headers_json(raw: str | None) -> str | None:
    """A headers JSON object without the server's ``Nats-*`` headers (as the engine's driver
    read leaves them out), or None when none are left."""
    if not raw:
        return None
    user = {k: v for k, v in json.loads(raw).items() if not k.startswith("Nats-")}
    return json.dumps(user) if user else None


def _chunked(col: pa.Array | pa.ChunkedArray, type_: pa.DataType) -> pa.ChunkedArray:
    col = col if isinstance(col, pa.ChunkedArray) else pa.chunked_array([col], type=col.type)
    return col if col.type == type_ else col.cast(type_)


class _ExecutorDecode:
    """The ``mapInArrow`` step of :meth:`SparkProcessor.process_range` (picklable): each record
    batch of the ``jetstream`` source through :func:`~cg_pipelines.engine.processing.
    decode_batch`, every message out as a good row or a dead row (with its reason)."""

    def __init__(self, decoder: JsonDecoder, validate: Validate | None, schema: pa.Schema
                 ) -> None:
        self.decoder, self.validate, self.schema = decoder, validate, schema

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            if batch.num_rows:
                yield from self.decode(pa.Table.from_batches([batch])).to_batches()

    def decode(self, records: pa.Table) -> pa.Table:
        good, dead = decode_batch(records, self.decoder, self.validate)
        reasons = {d.seq: d.reason for d in dead}
        is_dead = pc.is_in(records["seq"], value_set=pa.array(list(reasons), pa.int64()))
        good_in, dead_in = records.filter(pc.invert(is_dead)), records.filter(is_dead)
        if good_in.num_rows != good.num_rows or dead_in.num_rows != len(reasons):
            raise InvariantError("decode_batch did not give every message as a row or a dead "
                                 "letter exactly once")
        fields = self.decoder.arrow_schema
        m, n = good.num_rows, dead_in.num_rows
        good_cols = [*(good[f.name] for f in fields), good[SEQ_COLUMN], good["_subject"],
                     good["_time"], good_in["seq"], good_in["origin_seq"],
                     pa.nulls(m, pa.string()), pa.nulls(m, pa.string()), pa.nulls(m, pa.binary())]
        placeholders = [pa.nulls(n, f.type) if f.nullable else
                        pa.array([_PLACEHOLDER[f.type]] * n, f.type) for f in fields]
        dead_cols = [*placeholders, pc.coalesce(dead_in["origin_seq"], dead_in["seq"]),
                     dead_in["subject"], dead_in["time"], dead_in["seq"], dead_in["origin_seq"],
                     pa.array([reasons[q] for q in dead_in["seq"].to_pylist()], pa.string()),
                     pa.array([_user_headers_json(h) for h in dead_in["headers"].to_pylist()],
                              pa.string()),
                     dead_in["data"]]
        return pa.concat_tables([
            pa.Table.from_arrays([_chunked(c, f.type) for c, f in zip(cols, self.schema,
                                                                     strict=True)],
                                 schema=self.schema)
            for cols in (good_cols, dead_cols) if len(cols[-1])])


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
        UsageError: bad options (at planning, i.e. on the first action or schema analysis).
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
