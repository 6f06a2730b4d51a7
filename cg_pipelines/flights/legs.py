"""The legs processing step: per-aircraft legs in event order, on Spark or on Arrow/pandas.

Both transforms compute the columns of :data:`~cg_pipelines.flights.data.LEGS_SCHEMA` for one
batch of a partition, per tail number in stream-sequence (``_seq``) order. A batch holds an
arbitrary slice of each of its aircraft's events, so each aircraft's state after its last
committed leg (``leg_number``, ``dest``, ``arr_delay``, ``arr_minute``, ``cum_distance``) is
read from the committed table at the start of the batch (:func:`read_leg_state`, through
:func:`~cg_pipelines.spark.job.last_rows_by_key` on ``ctx.sink``) and the batch continues from
it. The result therefore does not depend on how the stream is split into batches — provided
the engine's contract holds (per-key order, no loss, no duplicates, each batch committed
before the next one starts).

Definitions (minutes since 2013-01-01 00:00 on the local clock; ``d`` = day index):

* ``dep_minute = d*1440 + (sched_dep_time div 100)*60 + sched_dep_time % 100 + dep_delay``;
* ``arr_minute = base + k*1440`` with ``base = d*1440 + (arr_time div 100)*60 + arr_time %
  100`` and ``k = max(0, ceil((dep_minute - base) / 1440))``, the smallest ``k >= 0`` with
  ``arr_minute >= dep_minute`` (the reference adds 1440 in a loop instead);
* ``ground_minutes = dep_minute - previous arr_minute`` (clock readings of different zones:
  may be negative).

The Spark and the Arrow transforms give identical tables (same schema, same values).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from cg_pipelines.engine.model import BatchContext, Processed, Record
from cg_pipelines.engine.processing import ArrowProcessor
from cg_pipelines.flights.data import DECODER, EPOCH, LEGS_SCHEMA, validate_subject
from cg_pipelines.spark.job import SparkProcessor, last_rows_by_key

__all__ = [
    "STATE_SCHEMA",
    "LegsSparkProcessor",
    "legs_arrow_processor",
    "legs_arrow_transform",
    "legs_processor",
    "legs_transform",
    "read_leg_state",
]

STATE_SCHEMA = pa.schema(
    [
        pa.field("tailnum", pa.string()),
        pa.field("leg_number", pa.int64()),
        pa.field("dest", pa.string()),
        pa.field("arr_delay", pa.int64()),
        pa.field("arr_minute", pa.int64()),
        pa.field("cum_distance", pa.int64()),
    ]
)
"""Per-aircraft state carried across batches: the last committed leg's columns."""

_STATE_COLUMNS = STATE_SCHEMA.names
_DAY = 1440
_EPOCH_SQL = EPOCH.strftime("%Y-%m-%d")


def read_leg_state(ctx: BatchContext, keys: Sequence[str]) -> pa.Table:
    """The last committed leg (greatest ``leg_number``) of each of ``keys``.

    Reads ``ctx.sink`` through :func:`~cg_pipelines.spark.job.last_rows_by_key`. Tail numbers
    without committed legs (and every key when the table does not exist yet or the sink
    cannot be read) are absent.

    Returns:
        A table with :data:`STATE_SCHEMA`, one row per key found, sorted by ``tailnum``.
    """
    state = last_rows_by_key(
        ctx, "tailnum", list(keys), order_col="leg_number",
        columns=_STATE_COLUMNS, schema=STATE_SCHEMA,
    )
    if state.num_rows == 0:
        return STATE_SCHEMA.empty_table()
    return state.select(_STATE_COLUMNS).cast(STATE_SCHEMA)


# ------------------------------------------------------------------------------ Spark


def _prev(col: str, first: Column, w: Window, state_col: str) -> Column:
    """The previous leg's ``col``: the committed state on the batch's first row of a tail
    number, else the previous row of the batch."""
    return F.when(first, F.col(state_col)).otherwise(F.lag(col).over(w))


def legs_transform(spark: SparkSession, df: DataFrame, ctx: BatchContext) -> DataFrame:
    """The legs of one batch, on Spark (a :data:`~cg_pipelines.spark.job.SparkTransform`).

    ``df`` holds the decoded payload fields and ``_seq``; per tail number, window functions
    ordered by ``_seq`` number the batch's legs and look one leg back, and the batch's first
    leg of each tail number takes its "previous leg" from :func:`read_leg_state` (collected
    keys -> committed state -> broadcast left join).

    Returns:
        A DataFrame with the columns of :data:`~cg_pipelines.flights.data.LEGS_SCHEMA`, in
        order (row order unspecified: the processor sorts by ``_seq``).
    """
    keys = sorted(r[0] for r in df.select("tailnum").distinct().collect())
    state = read_leg_state(ctx, keys)
    renamed = state.rename_columns([c if c == "tailnum" else f"s_{c}" for c in _STATE_COLUMNS])
    sdf = spark.createDataFrame(renamed)

    w = Window.partitionBy("tailnum").orderBy("_seq")
    upto = w.rowsBetween(Window.unboundedPreceding, Window.currentRow)
    rn = F.row_number().over(w)
    first = rn == 1

    days = F.datediff(
        F.make_date(F.col("year").cast("int"), F.col("month").cast("int"),
                    F.col("day").cast("int")),
        F.lit(_EPOCH_SQL).cast("date"),
    ).cast("long") * _DAY
    sched = F.col("sched_dep_time")
    dep = days + F.expr("sched_dep_time div 100") * 60 + sched % 100 + F.col("dep_delay")
    base = days + F.expr("arr_time div 100") * 60 + F.col("arr_time") % 100
    steps = F.greatest(F.lit(0).cast("long"), F.floor((dep - base + (_DAY - 1)) / _DAY))
    arr = F.when(dep.isNotNull() & F.col("arr_time").isNotNull(),
                 base + steps.cast("long") * _DAY)

    joined = df.join(F.broadcast(sdf), on="tailnum", how="left").select(
        "*", dep.cast("long").alias("dep_minute"), arr.cast("long").alias("arr_minute"),
    )
    prev_dest = _prev("dest", first, w, "s_dest")
    computed = {
        "leg_number": F.coalesce(F.col("s_leg_number"), F.lit(0)) + rn,
        "prev_dest": prev_dest,
        "prev_dest_matches_origin": prev_dest == F.col("origin"),
        "prev_arr_delay": _prev("arr_delay", first, w, "s_arr_delay"),
        "ground_minutes": F.col("dep_minute") - _prev("arr_minute", first, w, "s_arr_minute"),
        "cum_distance": (F.coalesce(F.col("s_cum_distance"), F.lit(0))
                         + F.sum("distance").over(upto)),
    }
    spark_types = {pa.int64(): "long", pa.string(): "string", pa.bool_(): "boolean"}
    return joined.select([
        computed.get(f.name, F.col(f.name)).cast(spark_types[f.type]).alias(f.name)
        for f in LEGS_SCHEMA
    ])


def _conform(table: pa.Table) -> pa.Table:
    """``table`` with exactly :data:`LEGS_SCHEMA` (column order, types, nullability)."""
    return table.select(LEGS_SCHEMA.names).cast(LEGS_SCHEMA)


class LegsSparkProcessor(SparkProcessor):
    """A :class:`~cg_pipelines.spark.job.SparkProcessor` running :func:`legs_transform` whose
    result is cast to :data:`~cg_pipelines.flights.data.LEGS_SCHEMA` (Spark reports every
    computed column as nullable; the table's non-null columns stay non-null) and sorted by
    ``_seq``."""

    def process(self, records: Sequence[Record], ctx: BatchContext) -> Processed:
        out = super().process(records, ctx)
        if out.table is not None:
            out.table = _conform(out.table)
        return out


def legs_processor(spark: SparkSession | None = None) -> SparkProcessor:
    """The Spark processing step for the ``legs`` consumer group.

    Decodes with :data:`~cg_pipelines.flights.data.DECODER` and checks each record's subject
    against its payload (:func:`~cg_pipelines.flights.data.validate_subject`): a payload that
    fails either is a dead letter. ``spark``: the session (default: started lazily by
    :func:`~cg_pipelines.spark.session.get_spark`).
    """
    return LegsSparkProcessor(DECODER, legs_transform, spark=spark, validate=validate_subject)


# ------------------------------------------------------------------------------ Arrow / pandas


def legs_arrow_transform(table: pa.Table, ctx: BatchContext) -> pa.Table:
    """The legs of one batch with pandas (an
    :data:`~cg_pipelines.engine.processing.ArrowTransform`).

    Same computation and result as :func:`legs_transform`: rows sorted by ``_seq`` and grouped
    by tail number (cumulative count, shift, cumulative sum), continued from
    :func:`read_leg_state`.

    Returns:
        A table with :data:`~cg_pipelines.flights.data.LEGS_SCHEMA`, sorted by ``_seq``.
    """
    if table.num_rows == 0:
        return LEGS_SCHEMA.empty_table()
    ints = {pa.int64(): pd.Int64Dtype(), pa.bool_(): pd.BooleanDtype()}
    df = table.to_pandas(types_mapper=ints.get)
    df = df.sort_values("_seq", kind="mergesort", ignore_index=True)
    df["tailnum"] = df["tailnum"].astype(object)

    state = read_leg_state(ctx, pd.unique(df["tailnum"]).tolist())
    st = state.to_pandas(types_mapper=ints.get).set_index("tailnum")
    prior = st.reindex(df["tailnum"]).reset_index(drop=True)

    dates = pd.to_datetime(df[["year", "month", "day"]].astype("int64"))
    days = pd.Series((dates - EPOCH).dt.days.to_numpy(np.int64) * _DAY, dtype="Int64")
    sched = df["sched_dep_time"]
    dep = days + (sched // 100) * 60 + sched % 100 + df["dep_delay"]
    arr_time = df["arr_time"]
    base = days + (arr_time // 100) * 60 + arr_time % 100
    steps = (-((base - dep) // _DAY)).clip(lower=0)  # ceil((dep - base) / 1440), at least 0
    df["dep_minute"] = dep
    df["arr_minute"] = base + steps * _DAY

    g = df.groupby("tailnum", sort=False)
    first = (g.cumcount() == 0).to_numpy()
    df["leg_number"] = prior["leg_number"].fillna(0) + g.cumcount() + 1

    def prev(col: str, state_col: str) -> pd.Series:
        shifted = g[col].shift(1)
        return shifted.where(~first, prior[state_col])

    prev_dest = prev("dest", "dest").astype(object)
    df["prev_dest"] = prev_dest.where(prev_dest.notna(), None)
    df["prev_arr_delay"] = prev("arr_delay", "arr_delay").astype("Int64")
    prev_arr = prev("arr_minute", "arr_minute").astype("Int64")
    df["ground_minutes"] = df["dep_minute"] - prev_arr
    matches = pd.array(df["prev_dest"].to_numpy() == df["origin"].to_numpy(), dtype="boolean")
    matches[df["prev_dest"].isna().to_numpy()] = pd.NA
    df["prev_dest_matches_origin"] = matches
    df["cum_distance"] = prior["cum_distance"].fillna(0) + g["distance"].cumsum()

    return pa.Table.from_pandas(df[LEGS_SCHEMA.names], schema=LEGS_SCHEMA, preserve_index=False)


def legs_arrow_processor() -> ArrowProcessor:
    """The Arrow (no Spark) processing step for the ``legs`` consumer group: same decoding,
    subject check and result as :func:`legs_processor`."""
    return ArrowProcessor(DECODER, legs_arrow_transform, validate=validate_subject)
