"""The legs processing step: per-aircraft legs in event order, on Spark or on Arrow/pandas.

Both transforms compute the columns of :data:`~flights.data.LEGS_SCHEMA` for one
batch of a partition, per tail number in stream-sequence (``_seq``) order. A batch holds an
arbitrary slice of each of its aircraft's events, so each aircraft's state after its last
committed leg (``leg_number``, ``dest``, ``arr_delay``, ``arr_minute``, ``cum_distance``) is
declared as :data:`LEG_STATE`; the library attaches it to every row of the batch as
``last_<column>`` (null for an aircraft with no committed leg) and the batch continues from
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

import numpy as np
import pandas as pd
import pyarrow as pa
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from cg_pipelines.core.state import KeyedState
from cg_pipelines.engine.processing import ArrowProcessor
from cg_pipelines.engine.processor import BatchContext
from cg_pipelines.spark.processor import SparkProcessor
from flights.data import DECODER, EPOCH, LEGS_SCHEMA, validate_subject

__all__ = [
    "LEG_STATE",
    "legs_arrow_processor",
    "legs_arrow_transform",
    "legs_processor",
    "legs_transform",
]

LEG_STATE = KeyedState(
    key="tailnum",
    columns=("leg_number", "dest", "arr_delay", "arr_minute", "cum_distance"),
    order_by="_seq",
    schema=pa.schema([
        pa.field("tailnum", pa.string()), pa.field("_seq", pa.int64()),
        pa.field("leg_number", pa.int64()), pa.field("dest", pa.string()),
        pa.field("arr_delay", pa.int64()), pa.field("arr_minute", pa.int64()),
        pa.field("cum_distance", pa.int64()),
    ]),
)
"""Per-aircraft state carried across batches: the last committed leg's columns, attached to a
batch as ``last_leg_number``, ``last_dest``, ``last_arr_delay``, ``last_arr_minute``,
``last_cum_distance``."""

_DAY = 1440
_EPOCH_SQL = EPOCH.strftime("%Y-%m-%d")


# ------------------------------------------------------------------------------ Spark


def _prev(col: str, first: Column, w: Window, state_col: str) -> Column:
    """The previous leg's ``col``: the committed state on the batch's first row of a tail
    number, else the previous row of the batch."""
    return F.when(first, F.col(state_col)).otherwise(F.lag(col).over(w))


def legs_transform(spark: SparkSession, df: DataFrame, ctx: BatchContext) -> DataFrame:
    """The legs of one batch, on Spark (a :data:`~cg_pipelines.spark.SparkTransform`).

    ``df`` holds the decoded payload fields, ``_seq`` and the :data:`LEG_STATE` columns
    (``last_*``); per tail number, window functions ordered by ``_seq`` number the batch's legs
    and look one leg back, and the batch's first leg of each tail number takes its "previous
    leg" from the ``last_*`` columns.

    Returns:
        A DataFrame with the columns of :data:`~flights.data.LEGS_SCHEMA`, in order (row order
        unspecified: the processor sorts by ``_seq``).
    """
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

    rows = df.select("*", dep.cast("long").alias("dep_minute"),
                     arr.cast("long").alias("arr_minute"))
    prev_dest = _prev("dest", first, w, "last_dest")
    computed = {
        "leg_number": F.coalesce(F.col("last_leg_number"), F.lit(0)) + rn,
        "prev_dest": prev_dest,
        "prev_dest_matches_origin": prev_dest == F.col("origin"),
        "prev_arr_delay": _prev("arr_delay", first, w, "last_arr_delay"),
        "ground_minutes": F.col("dep_minute") - _prev("arr_minute", first, w, "last_arr_minute"),
        "cum_distance": (F.coalesce(F.col("last_cum_distance"), F.lit(0))
                         + F.sum("distance").over(upto)),
    }
    spark_types = {pa.int64(): "long", pa.string(): "string", pa.bool_(): "boolean"}
    return rows.select([
        computed.get(f.name, F.col(f.name)).cast(spark_types[f.type]).alias(f.name)
        for f in LEGS_SCHEMA
    ])


def legs_processor() -> SparkProcessor:
    """The Spark processing step for the ``legs`` consumer group.

    Decodes with :data:`~flights.data.DECODER` and checks each record's subject against its
    payload (:func:`~flights.data.validate_subject`): a payload that fails either is a dead
    letter. Declares :data:`LEG_STATE`; the result is cast to :data:`~flights.data.LEGS_SCHEMA`
    (Spark reports every computed column as nullable) and sorted by ``_seq``. The session comes
    from the run (the Dagster Spark resource binds it). ``key_local``: the transform's windows
    are per tail number, the key the group partitions on, so a run over several partitions
    transforms them in one Spark job per batch.
    """
    return SparkProcessor(DECODER, legs_transform, state=LEG_STATE, validate=validate_subject,
                          schema=LEGS_SCHEMA, key_local=True)


# ------------------------------------------------------------------------------ Arrow / pandas


def legs_arrow_transform(table: pa.Table, ctx: BatchContext) -> pa.Table:
    """The legs of one batch with pandas (an
    :data:`~cg_pipelines.engine.processing.ArrowTransform`).

    Same computation and result as :func:`legs_transform`: rows sorted by ``_seq`` and grouped
    by tail number (cumulative count, shift, cumulative sum), continued from the
    :data:`LEG_STATE` columns (``last_*``).

    Returns:
        A table with :data:`~flights.data.LEGS_SCHEMA`, sorted by ``_seq``.
    """
    if table.num_rows == 0:
        return LEGS_SCHEMA.empty_table()
    ints = {pa.int64(): pd.Int64Dtype(), pa.bool_(): pd.BooleanDtype()}
    df = table.to_pandas(types_mapper=ints.get)
    df = df.sort_values("_seq", kind="mergesort", ignore_index=True)
    df["tailnum"] = df["tailnum"].astype(object)

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
    df["leg_number"] = df["last_leg_number"].fillna(0) + g.cumcount() + 1

    def prev(col: str) -> pd.Series:
        shifted = g[col].shift(1)
        return shifted.where(~first, df[f"last_{col}"])

    prev_dest = prev("dest").astype(object)
    df["prev_dest"] = prev_dest.where(prev_dest.notna(), None)
    df["prev_arr_delay"] = prev("arr_delay").astype("Int64")
    prev_arr = prev("arr_minute").astype("Int64")
    df["ground_minutes"] = df["dep_minute"] - prev_arr
    matches = pd.array(df["prev_dest"].to_numpy() == df["origin"].to_numpy(), dtype="boolean")
    matches[df["prev_dest"].isna().to_numpy()] = pd.NA
    df["prev_dest_matches_origin"] = matches
    df["cum_distance"] = df["last_cum_distance"].fillna(0) + g["distance"].cumsum()

    return pa.Table.from_pandas(df[LEGS_SCHEMA.names], schema=LEGS_SCHEMA, preserve_index=False)


def legs_arrow_processor() -> ArrowProcessor:
    """The Arrow (no Spark) processing step for the ``legs`` consumer group: same decoding,
    subject check and result as :func:`legs_processor`."""
    return ArrowProcessor(DECODER, legs_arrow_transform, validate=validate_subject,
                          state=LEG_STATE)
