"""SparkProcessor: decode -> declared per-key state attached -> Spark transform (window over
_seq) -> Arrow.

The transform computes, per key, a running count and the previous value; state crosses batch
boundaries through the declared :class:`KeyedState` (the library attaches ``last_value`` and
``last_count`` from the sink's committed rows). Results are compared with a pandas reference
computed over the whole history.
"""

from __future__ import annotations

import json

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from cg_pipelines.core.decode import JsonDecoder, JsonField
from cg_pipelines.core.state import KeyedState, last_per_key
from cg_pipelines.engine.processor import BatchContext, Record, records_to_arrow
from cg_pipelines.engine.state import KeyStateCache
from cg_pipelines.spark.processor import SparkProcessor

DECODER = JsonDecoder(
    [JsonField("key", "string", nullable=False), JsonField("value", "int", required=False)]
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


STATE = KeyedState("key", ("value", "count"))


class TableSink:
    """A minimal state sink over a fixed Arrow table of committed rows (the real sink is
    Delta): ``last_rows`` filters it by key; ``watermark``/``commit`` are not used here."""

    def __init__(self, committed: pa.Table) -> None:
        self.committed = committed
        self.reads: list[list[object]] = []

    def watermark(self, app_id: str) -> int:
        return 0

    def commit(self, table, app_id: str, version: int, expected: int) -> None:
        raise AssertionError("the processing step never commits")

    def last_rows(self, key, keys, columns, order_by, partition=None, *,
                  app_id=None) -> pa.Table:
        self.reads.append(list(keys))
        t = self.committed.filter(pc.field(key).isin(list(keys))).select(list(columns))
        return last_per_key(t, key, order_by)


def running_count_and_prev(spark: SparkSession, df: DataFrame, ctx: BatchContext) -> DataFrame:
    w = Window.partitionBy("key").orderBy("_seq")
    return (
        df.withColumn("count", F.coalesce("last_count", F.lit(0)) + F.row_number().over(w))
        .withColumn("prev", F.when(F.row_number().over(w) == 1, F.col("last_value"))
                    .otherwise(F.lag("value").over(w)))
        .select("key", "value", "count", "prev", "_seq", "_time")
    )


def records(events: list[tuple[int, bytes]]) -> pa.Table:
    return records_to_arrow([Record(seq, f"orders.{seq}", data, T0 + seq * 1_000_001)
                             for seq, data in events])


def ev(key: str, value: int) -> bytes:
    return json.dumps({"key": key, "value": value}).encode()


def reference(history: list[tuple[int, str, int]]) -> pd.DataFrame:
    """Per key, in seq order: running count and previous value (pandas)."""
    df = pd.DataFrame(history, columns=["_seq", "key", "value"]).sort_values("_seq")
    g = df.groupby("key", sort=False)
    df["count"] = g.cumcount() + 1
    df["prev"] = g["value"].shift(1).astype("Int64")
    return df[["key", "value", "count", "prev", "_seq"]].reset_index(drop=True)


def ctx_for(sink: TableSink, first: int, last: int) -> BatchContext:
    """A batch context whose state reads go through a per-run cache over ``sink``."""
    cache = KeyStateCache(STATE, lambda keys: sink.last_rows(
        STATE.key, keys, STATE.read_columns, STATE.order_by))
    return BatchContext("S", "g", 0, "S/g/0", first, last, sink, cache)  # type: ignore[arg-type]


def as_frame(table: pa.Table) -> pd.DataFrame:
    df = table.select(["key", "value", "count", "prev", "_seq"]).to_pandas()
    df["prev"] = df["prev"].astype("Int64")
    return df.reset_index(drop=True)


# Two batches; keys a and b continue from batch 1 into batch 2, c first appears in batch 2.
BATCH1 = [(1, "a", 10), (2, "b", 20), (3, "a", 11), (5, "a", 12), (6, "b", 21)]
BATCH2 = [(7, "b", 22), (8, "c", 30), (9, "a", 13), (11, "c", 31), (12, "a", 14), (14, "b", 23)]


def test_first_batch_without_state_equals_reference(spark) -> None:
    proc = SparkProcessor(DECODER, running_count_and_prev, state=STATE, spark=spark)
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
    proc = SparkProcessor(DECODER, running_count_and_prev, state=STATE, spark=spark)
    out = proc.process(records([(s, ev(k, v)) for s, k, v in BATCH2]), ctx_for(sink, 7, 14))
    assert out.dead == []
    want = reference(BATCH1 + BATCH2)
    want = want[want["_seq"] >= 7].reset_index(drop=True)
    pd.testing.assert_frame_equal(as_frame(out.table), want)
    # The carried state: a continues at count 4 after 12, b at 3 after 21; c starts fresh.
    by_seq = {r["_seq"]: (r["count"], r["prev"]) for r in out.table.to_pylist()}
    assert by_seq[9] == (4, 12) and by_seq[7] == (3, 21) and by_seq[8] == (1, None)
    # State was read once, for exactly the batch's keys (not the whole table).
    assert len(sink.reads) == 1 and sorted(sink.reads[0]) == ["a", "b", "c"]


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
    proc = SparkProcessor(DECODER, running_count_and_prev, state=STATE, spark=spark)
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
    proc = SparkProcessor(DECODER, running_count_and_prev, state=STATE, spark=None)
    sink = TableSink(OUT_SCHEMA.empty_table())
    out = proc.process(records([(1, b"nope"), (2, b"")]), ctx_for(sink, 1, 2))
    assert out.table is None and [d.seq for d in out.dead] == [1, 2]
    assert proc._spark is None  # no session was started for it
    assert sink.reads == []  # nor state read


def test_bind_gives_a_copy_with_the_session(spark) -> None:
    proc = SparkProcessor(DECODER, running_count_and_prev, state=STATE)
    bound = proc.bind(spark)
    assert bound.spark is spark and proc._spark is None and bound.state is STATE


def test_declared_state_without_a_reader_is_an_error(spark) -> None:
    proc = SparkProcessor(DECODER, running_count_and_prev, state=STATE, spark=spark)
    ctx = BatchContext("S", "g", 0, "S/g/0", 1, 1, TableSink(OUT_SCHEMA.empty_table()))
    with pytest.raises(RuntimeError, match="no state reader"):
        proc.process(records([(1, ev("a", 1))]), ctx)


def _partition_ctx(sink: TableSink, p: int, first: int, last: int) -> BatchContext:
    cache = KeyStateCache(STATE, lambda keys: sink.last_rows(
        STATE.key, keys, STATE.read_columns, STATE.order_by))
    return BatchContext("S", "g", p, f"S/g/{p}", first, last, sink, cache)  # type: ignore[arg-type]


def test_key_local_transforms_every_partition_in_one_call(spark) -> None:
    # Three partitions of one group (keys never shared), committed state for a and b, a bad
    # payload in one: ONE transform call gives each partition what its own call gives.
    committed = pa.table({"key": ["a", "b"], "value": [9, 19], "count": [3, 1],
                          "_seq": [0, 0]})
    sink = TableSink(committed)
    events = {0: [(1, ev("a", 10)), (4, ev("a", 11)), (7, b"{bad")],
              1: [(2, ev("b", 20)), (5, ev("d", 40)), (8, ev("b", 21))],
              2: [(3, ev("c", 30)), (6, ev("c", 31))]}
    items = [(records(e), _partition_ctx(sink, p, e[0][0], e[-1][0])) for p, e in events.items()]
    calls: list[int] = []

    def counted(spark, df, ctx):
        calls.append(ctx.partition)
        return running_count_and_prev(spark, df, ctx)

    fused = SparkProcessor(DECODER, counted, state=STATE, spark=spark, key_local=True)
    got = fused.process_partitions(items)
    assert calls == [0]  # one Spark job for the three partitions
    alone = SparkProcessor(DECODER, counted, state=STATE, spark=spark)
    want = [alone.process(b, _partition_ctx(sink, c.partition, c.first_seq, c.last_seq))
            for b, c in items]
    assert calls == [0, 0, 1, 2]
    for g, w in zip(got, want, strict=True):
        assert g.dead == w.dead
        pd.testing.assert_frame_equal(as_frame(g.table), as_frame(w.table))
    assert [d.seq for d in got[0].dead] == [7]
    assert as_frame(got[0].table)["count"].tolist() == [4, 5]  # a continues from its state


def test_a_key_local_transform_must_keep_seq(spark) -> None:
    from cg_pipelines.core.errors import ContractError

    sink = TableSink(OUT_SCHEMA.empty_table())
    items = [(records([(1, ev("a", 1))]), _partition_ctx(sink, 0, 1, 1)),
             (records([(2, ev("b", 2))]), _partition_ctx(sink, 1, 2, 2))]
    proc = SparkProcessor(DECODER, lambda s, df, c: df.select("key"), state=STATE,
                          spark=spark, key_local=True)
    with pytest.raises(ContractError, match="must keep '_seq'"):
        proc.process_partitions(items)
