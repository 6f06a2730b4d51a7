"""SparkProcessor: decode -> Spark transform (window over _seq + committed per-key state) -> Arrow.

The transform computes, per key, a running count and the previous value; state crosses batch
boundaries through ``last_rows_by_key`` over the sink's committed rows. Results are compared
with a pandas reference computed over the whole history.
"""

from __future__ import annotations

import json

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from cg_pipelines.core.decode import Field, JsonDecoder
from cg_pipelines.engine.model import BatchContext, Record
from cg_pipelines.spark.job import SparkProcessor, last_rows_by_key

DECODER = JsonDecoder(
    [Field("key", "string", nullable=False), Field("value", "int", required=False)]
)
T0 = 1_795_225_848_670_763_861  # ns since the epoch (sub-µs digits on purpose)

OUT_SCHEMA = pa.schema([
    pa.field("key", pa.string()),
    pa.field("value", pa.int64()),
    pa.field("count", pa.int64()),
    pa.field("prev", pa.int64()),
    pa.field("_seq", pa.int64()),
    pa.field("_time", pa.timestamp("us", tz="UTC")),
])


class TableSink:
    """A minimal committed-rows holder: ``read`` filters a fixed Arrow table (the real sink is
    Delta); ``watermark``/``commit`` are not used by the processing step."""

    def __init__(self, committed: pa.Table) -> None:
        self.committed = committed
        self.reads: list[object] = []

    def watermark(self, app_id: str) -> int:
        return 0

    def commit(self, table, app_id: str, version: int, expected: int) -> None:
        raise AssertionError("the processing step never commits")

    def read(self, columns=None, filter=None) -> pa.Table:  # noqa: A002 - the protocol's name
        self.reads.append(filter)
        t = self.committed if filter is None else self.committed.filter(filter)
        return t.select(columns) if columns is not None else t


class NoReadSink:
    def watermark(self, app_id: str) -> int:
        return 0

    def commit(self, table, app_id: str, version: int, expected: int) -> None:
        raise AssertionError


def running_count_and_prev(spark: SparkSession, df: DataFrame, ctx: BatchContext) -> DataFrame:
    keys = [r.key for r in df.select("key").distinct().collect()]
    prior = last_rows_by_key(ctx, "key", keys, columns=["key", "value", "count", "_seq"],
                             schema=OUT_SCHEMA)
    prior_df = spark.createDataFrame(
        prior.select(["key", "value", "count"]).rename_columns(["key", "p_value", "p_count"])
    )
    w = Window.partitionBy("key").orderBy("_seq")
    return (
        df.join(F.broadcast(prior_df), "key", "left")
        .withColumn("count", F.coalesce("p_count", F.lit(0)) + F.row_number().over(w))
        .withColumn("prev", F.when(F.row_number().over(w) == 1, F.col("p_value"))
                    .otherwise(F.lag("value").over(w)))
        .select("key", "value", "count", "prev", "_seq", "_time")
    )


def records(events: list[tuple[int, bytes]]) -> list[Record]:
    return [Record(seq, f"orders.{seq}", data, T0 + seq * 1_000_001) for seq, data in events]


def ev(key: str, value: int) -> bytes:
    return json.dumps({"key": key, "value": value}).encode()


def reference(history: list[tuple[int, str, int]]) -> pd.DataFrame:
    """Per key, in seq order: running count and previous value (pandas)."""
    df = pd.DataFrame(history, columns=["_seq", "key", "value"]).sort_values("_seq")
    g = df.groupby("key", sort=False)
    df["count"] = g.cumcount() + 1
    df["prev"] = g["value"].shift(1).astype("Int64")
    return df[["key", "value", "count", "prev", "_seq"]].reset_index(drop=True)


def ctx_for(sink: object, first: int, last: int) -> BatchContext:
    return BatchContext("S", "g", 0, "S/g/0", first, last, sink)  # type: ignore[arg-type]


def as_frame(table: pa.Table) -> pd.DataFrame:
    df = table.select(["key", "value", "count", "prev", "_seq"]).to_pandas()
    df["prev"] = df["prev"].astype("Int64")
    return df.reset_index(drop=True)


# Two batches; keys a and b continue from batch 1 into batch 2, c first appears in batch 2.
BATCH1 = [(1, "a", 10), (2, "b", 20), (3, "a", 11), (5, "a", 12), (6, "b", 21)]
BATCH2 = [(7, "b", 22), (8, "c", 30), (9, "a", 13), (11, "c", 31), (12, "a", 14), (14, "b", 23)]


def test_first_batch_without_state_equals_reference(spark) -> None:
    proc = SparkProcessor(DECODER, running_count_and_prev, spark=spark)
    sink = TableSink(OUT_SCHEMA.empty_table())
    out = proc.process(records([(s, ev(k, v)) for s, k, v in BATCH1]), ctx_for(sink, 1, 6))
    assert out.dead == []
    pd.testing.assert_frame_equal(as_frame(out.table), reference(BATCH1))
    # Rows come back in stream order; _time kept as UTC timestamps (µs: ns truncated).
    assert out.table.column("_seq").to_pylist() == [1, 2, 3, 5, 6]
    assert out.table.schema.field("_time").type == pa.timestamp("us", tz="UTC")
    assert out.table.column("_time").cast("int64").to_pylist() == [
        (T0 + s * 1_000_001) // 1000 for s, _, _ in BATCH1
    ]


def test_batch_with_prior_state_equals_reference(spark) -> None:
    # What batch 1 committed (as the pandas reference says), plus rows of an unrelated key.
    ref1 = reference(BATCH1)
    committed_rows = [{**r, "_time": None}
                      for r in ref1.astype(object).where(ref1.notna(), None).to_dict("records")]
    committed_rows.append({"key": "zz", "value": 0, "count": 99, "prev": None, "_seq": 0,
                           "_time": None})
    committed = pa.Table.from_pylist(committed_rows, schema=OUT_SCHEMA)
    sink = TableSink(committed)
    proc = SparkProcessor(DECODER, running_count_and_prev, spark=spark)
    out = proc.process(records([(s, ev(k, v)) for s, k, v in BATCH2]), ctx_for(sink, 7, 14))
    assert out.dead == []
    want = reference(BATCH1 + BATCH2)
    want = want[want["_seq"] >= 7].reset_index(drop=True)
    pd.testing.assert_frame_equal(as_frame(out.table), want)
    # The carried state: a continues at count 4 after 12, b at 3 after 21; c starts fresh.
    by_seq = {r["_seq"]: (r["count"], r["prev"]) for r in out.table.to_pylist()}
    assert by_seq[9] == (4, 12) and by_seq[7] == (3, 21) and by_seq[8] == (1, None)
    # State was read with a key filter, not the whole table.
    assert len(sink.reads) == 1 and sink.reads[0] is not None


def test_dead_letters_reported_and_good_rows_processed_in_order(spark) -> None:
    events = [
        (1, ev("a", 1)),
        (2, b"{not json"),
        (3, ev("b", 5)),
        (4, b""),
        (5, json.dumps({"key": "a"}).encode()),            # value optional -> null
        (6, json.dumps({"value": 3}).encode()),            # key missing
        (7, json.dumps({"key": "a", "value": "x"}).encode()),
        (8, b"\xff\xfe"),
        (9, ev("a", 2)),
        (10, b"[1, 2]"),
        (11, ev("b", 6)),
    ]
    sink = TableSink(OUT_SCHEMA.empty_table())
    proc = SparkProcessor(DECODER, running_count_and_prev, spark=spark)
    out = proc.process(records(events), ctx_for(sink, 1, 11))
    reasons = {d.seq: d.reason for d in out.dead}
    assert sorted(reasons) == [2, 4, 6, 7, 8, 10]
    assert reasons[2].startswith("malformed JSON")
    assert reasons[4] == "empty payload"
    assert reasons[6] == "missing field 'key'"
    assert reasons[7] == "field 'value' must be int, got str"
    assert "UTF-8" in reasons[8]
    assert reasons[10] == "payload must be a JSON object, got list"
    got = [(r["_seq"], r["key"], r["value"], r["count"], r["prev"])
           for r in out.table.to_pylist()]
    assert got == [
        (1, "a", 1, 1, None),
        (3, "b", 5, 1, None),
        (5, "a", None, 2, 1),
        (9, "a", 2, 3, None),  # previous value of a was null (seq 5)
        (11, "b", 6, 2, 5),
    ]
    # Every input sequence is either in the table or dead-lettered.
    assert sorted(out.table.column("_seq").to_pylist() + list(reasons)) == list(range(1, 12))


def test_all_bad_batch_does_not_touch_spark() -> None:
    proc = SparkProcessor(DECODER, running_count_and_prev, spark=None)
    out = proc.process(records([(1, b"nope"), (2, b"")]), ctx_for(NoReadSink(), 1, 2))
    assert out.table is None and [d.seq for d in out.dead] == [1, 2]
    assert proc._spark is None  # no session was started for it


# -- last_rows_by_key (pure Arrow) -----------------------------------------------------------


def test_last_rows_by_key_picks_greatest_order_col() -> None:
    committed = pa.table({
        "key": ["a", "b", "a", "c", "b", "a"],
        "_seq": [5, 2, 9, 4, 7, 1],
        "v": [50, 20, 90, 40, 70, 10],
    })
    sink = TableSink(committed)
    got = last_rows_by_key(ctx_for(sink, 10, 20), "key", ["b", "a", "a", "missing"])
    assert got.to_pylist() == [{"key": "a", "_seq": 9, "v": 90},
                               {"key": "b", "_seq": 7, "v": 70}]
    # The sink was asked for exactly those keys.
    assert committed.filter(sink.reads[0]).num_rows == 5
    # Another ordering column.
    got = last_rows_by_key(ctx_for(sink, 10, 20), "key", ["a"], order_col="v", columns=["key", "v"])
    assert got.to_pylist() == [{"key": "a", "v": 90}]


def test_last_rows_by_key_empty_cases() -> None:
    schema = pa.schema([("key", pa.string()), ("_seq", pa.int64())])
    assert last_rows_by_key(ctx_for(NoReadSink(), 1, 1), "key", ["a"]).num_rows == 0
    got = last_rows_by_key(ctx_for(NoReadSink(), 1, 1), "key", ["a"], schema=schema)
    assert got.schema == schema and got.num_rows == 0
    sink = TableSink(pa.table({"key": ["a"], "_seq": [1]}))
    assert last_rows_by_key(ctx_for(sink, 1, 1), "key", []).num_rows == 0
    assert sink.reads == []
    assert last_rows_by_key(ctx_for(sink, 1, 1), "key", ["q"]).num_rows == 0
    with pytest.raises(KeyError, match="_seq"):
        last_rows_by_key(ctx_for(TableSink(pa.table({"key": ["a"]})), 1, 1), "key", ["a"])


def test_filter_expression_is_dataset_compatible() -> None:
    # The sink may hand the filter to pyarrow.dataset: it must be an Expression.
    sink = TableSink(pa.table({"key": ["a"], "_seq": [1]}))
    last_rows_by_key(ctx_for(sink, 1, 1), "key", ["a"])
    assert isinstance(sink.reads[0], pc.Expression)
