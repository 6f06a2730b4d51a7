"""The executor read (``EngineOptions.executor_read_min_msgs``) against a real nats-server, local
Spark and real Delta tables.

One origin stream feeds two elastic groups with the same shape, so both work queues hold the
same messages at the same sequences. Group ``d`` is drained on the driver (batches read by the
engine, decoded there, handed to Spark as Arrow); group ``x`` with the executor read (the range
read, decoded and transformed on the executors, one commit). Both must give the same table
(values, schema, row order by ``_seq``), the same dead letters with the same reasons and
headers, and the same watermark and origin marker. Keys' state crosses from driver-committed
batches into the executor batch through the Delta table.
"""

from __future__ import annotations

import asyncio
import json
import sys

import pyarrow as pa
import pytest
from nats.js.api import StreamConfig
from pyspark import cloudpickle
from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter, dlq_stream_name
from cg_pipelines.core.decode import JsonDecoder, JsonField
from cg_pipelines.core.record import RECORD_SCHEMA
from cg_pipelines.core.state import KeyedState, last_per_key
from cg_pipelines.core.subjects import partition_for
from cg_pipelines.engine.executor_read import RangeProcessor, executor_connect_options
from cg_pipelines.engine.options import EngineOptions
from cg_pipelines.engine.processor import BatchContext
from cg_pipelines.engine.runner import run_partition
from cg_pipelines.engine.state import KeyStateCache
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.rangeread import read_range
from cg_pipelines.sinks.base import app_id_for, origin_marker
from cg_pipelines.sinks.delta import DeltaSink
from cg_pipelines.spark.processor import SparkProcessor

PARTS = 2
P = 0  # the partition drained
FAST = dict(ack_wait_s=3.0, priority_timeout_s=3.0, hold_wait_s=6.0)

DECODER = JsonDecoder([JsonField("key", "string", nullable=False),
                       JsonField("n", "int", nullable=False),
                       JsonField("note", "string", required=False)])
STATE = KeyedState("key", ("n", "count"), schema=pa.schema([
    ("key", pa.string()), ("_seq", pa.int64()), ("n", pa.int64()), ("count", pa.int64())]))


def running(spark: SparkSession, df: DataFrame, ctx: BatchContext) -> DataFrame:
    """Per key, in ``_seq`` order: running count (continuing the committed one) and the
    previous ``n`` (the committed one for the batch's first row of a key)."""
    w = Window.partitionBy("key").orderBy("_seq")
    rn = F.row_number().over(w)
    return df.select(
        "key", "n", "note", "_seq", "_subject", "_time",
        (F.coalesce("last_count", F.lit(0)) + rn).alias("count"),
        F.when(rn == 1, F.col("last_n")).otherwise(F.lag("n").over(w)).alias("prev_n"))


# The executor read ships the decoder and validate to the Python workers, which cannot import
# this test module: pickle its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def validate_odd(table: pa.Table) -> list[tuple[int, str]]:
    """A record-level check: a ``note`` of "reject" is a dead letter."""
    return [(i, "note says reject") for i, v in enumerate(table["note"].to_pylist())
            if v == "reject"]


def processor(**kw) -> SparkProcessor:
    return SparkProcessor(DECODER, running, state=STATE, validate=validate_odd, **kw)


def keys_of_partition(p: int, n: int) -> list[str]:
    return [k for k in (f"k{i}" for i in range(500)) if partition_for([k], PARTS) == p][:n]


BAD = [
    b"{not json",
    b"",
    json.dumps({"key": "KEY"}).encode(),  # n missing
    json.dumps({"key": "KEY", "n": "x"}).encode(),
    b"\xff\xfe",
    b"[1, 2]",
    json.dumps({"key": "KEY", "n": 1.5}).encode(),
    json.dumps({"key": "KEY", "n": 3, "note": "reject"}).encode(),  # validate rejects
]


def events(n: int) -> list[tuple[str, bytes, dict[str, str] | None]]:
    """Keyed events over both partitions (partition 0's keys most), malformed payloads mixed in
    (some with a user header)."""
    mine, other = keys_of_partition(P, 7), keys_of_partition(1 - P, 3)
    out: list[tuple[str, bytes, dict[str, str] | None]] = []
    counters: dict[str, int] = {}
    for i in range(n):
        key = other[i % 3] if i % 5 == 4 else mine[(i * 31 + i // 7) % 7]
        if i % 97 == 13:
            bad = BAD[(i // 97) % len(BAD)].replace(b"KEY", key.encode())
            out.append((key, bad, {"X-Trace": f"t{i}"} if i % 2 else None))
            continue
        counters[key] = counters.get(key, 0) + 1
        note = "big" if i % 11 == 0 else None
        out.append((key, json.dumps({"key": key, "n": counters[key] * 10 + i % 7,
                                     "note": note}).encode(), None))
    return out


async def setup(js, stream: str, evs) -> JetStreamAPI:
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    for group in ("d", "x"):
        await admin.create_elastic(js, stream, group, ElasticConfig(
            PARTS, (PartitioningFilter(f"{stream}.*", (1,)),), members=("m1",)))
    acks = [await js.publish_async(f"{stream}.{k}", data, headers=h) for k, data, h in evs]
    await asyncio.gather(*acks)
    api = JetStreamAPI.from_js(js)
    for group in ("d", "x"):
        for _ in range(400):
            if (await api.stream_info(f"{stream}-{group}"))["state"]["messages"] >= len(evs):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"{stream}-{group} did not receive {len(evs)} messages")
    return api


async def dead_letters(api: JetStreamAPI, stream: str, group: str) -> list[tuple]:
    """The group's dead letters: (sequence, subject, error, partition, user headers, payload)."""
    name = dlq_stream_name(stream, group)
    msgs = await api.direct_get_batch(name, 1, ">", 1000)
    out = []
    for m in msgs:
        h = m.headers or {}
        user = {k: v for k, v in h.items() if not k.startswith(("Cg-", "Nats-"))}
        out.append((int(h["Cg-Sequence"]), h["Cg-Subject"], h["Cg-Error"], h["Cg-Partition"],
                    user, m.data))
    return sorted(out)


def table(sink: DeltaSink) -> pa.Table:
    return sink.read().sort_by("_seq")


async def test_executor_read_equals_driver_path(nc, js, unique_name, tmp_path, spark) -> None:
    stream = unique_name
    evs = events(1200)
    api = await setup(js, stream, evs)
    driver_sink, exec_sink = DeltaSink(str(tmp_path / "d")), DeltaSink(str(tmp_path / "x"))

    schemas: dict[str, list] = {"d": [], "x": []}

    def spy(group: str) -> SparkProcessor:
        def transform(spark: SparkSession, df: DataFrame, ctx: BatchContext) -> DataFrame:
            schemas[group].append([(f.name, f.dataType, f.nullable) for f in df.schema.fields])
            return running(spark, df, ctx)
        return SparkProcessor(DECODER, transform, state=STATE, validate=validate_odd,
                              spark=spark)

    # Driver path: many small batches (state crosses each boundary through the table).
    rd = await run_partition(nc, stream, "d", P, spy("d"), driver_sink,
                             EngineOptions(batch_max_msgs=97, **FAST))
    assert rd.status == "drained" and rd.commits > 3
    assert "read_executors" not in rd.timings

    # Executor path: first driver batches of 150 messages (to the limit), then the rest as ONE
    # executor batch whose keys continue from the committed state.
    r1 = await run_partition(nc, stream, "x", P, processor(spark=spark), exec_sink,
                             EngineOptions(batch_max_msgs=150, max_messages=150,
                                           executor_read_min_msgs=10**6, **FAST))
    assert r1.status == "limit" and r1.commits >= 1 and "read_executors" not in r1.timings
    steps: list[tuple[str, dict]] = []
    px = spy("x")
    assert isinstance(px, RangeProcessor)
    rx = await run_partition(nc, stream, "x", P, px, exec_sink,
                             EngineOptions(batch_max_msgs=97, executor_read_min_msgs=100,
                                           **FAST),
                             hook=lambda s, i: steps.append((s, i)))
    assert rx.status == "drained", rx.detail
    assert rx.commits == 1 and len(schemas["x"]) == 1
    assert "read_executors" in rx.timings and "read" not in rx.timings
    assert [i.get("executors") for s, i in steps if s == "read"] == [True]
    assert [s for s, _ in steps if s != "leased"][:5] == [
        "read", "processed", "committed", "purged", "acked"]

    # The same table: values, types, nullability, row order by _seq. (_time is the store time
    # in each group's own work queue: the same message's two copies were sourced moments apart.)
    got, want = table(exec_sink), table(driver_sink)
    assert got.schema == want.schema
    assert got.num_rows == want.num_rows > 600
    assert got.drop_columns(["_time"]).to_pylist() == want.drop_columns(["_time"]).to_pylist()
    skew = [abs((a - b).total_seconds()) for a, b in zip(
        got["_time"].to_pylist(), want["_time"].to_pylist(), strict=True)]
    assert max(skew) < 10
    assert r1.processed + rx.processed == rd.processed
    # The transform saw the same columns, types and nullability as on the driver path.
    assert schemas["x"][0] == schemas["d"][0]

    # The same dead letters, with the same reasons, subjects and user headers.
    dd, dx = await dead_letters(api, stream, "d"), await dead_letters(api, stream, "x")
    assert len(dd) >= 6 and dd == dx
    assert rd.dead_lettered == r1.dead_lettered + rx.dead_lettered == len(dd)
    assert {r[2] for r in dd} >= {"note says reject", "empty payload",
                                  "payload must be a JSON object, got list"}
    assert any(r[4] == {"X-Trace": r[4].get("X-Trace")} and r[4] for r in dd)

    # The same watermark and origin marker; both work queues' partitions are empty.
    for suffix in ("", "@origin"):
        w_d = driver_sink.watermark(f"{stream}/d/{P}" + suffix)
        w_x = exec_sink.watermark(f"{stream}/x/{P}" + suffix)
        assert w_d == w_x > 0
    assert exec_sink.watermark(origin_marker(f"{stream}/x/{P}")) == max(
        got["_seq"].to_pylist() + [r[0] for r in dx])
    assert rx.watermark == rd.watermark
    for group in ("d", "x"):
        left = await api.stream_info(f"{stream}-{group}", subjects_filter=f"{P}.>")
        assert not (left["state"].get("subjects") or {})


def plain(spark: SparkSession, df: DataFrame, ctx: BatchContext) -> DataFrame:
    """No state: the decoded columns and one computed from them."""
    return df.select("key", "n", "note", "_seq", "_subject", (F.col("n") * 2).alias("n2"))


async def test_below_threshold_driver_path_and_stateless_executor_read(
        nc, js, unique_name, tmp_path, spark) -> None:
    """Below the threshold the driver path is used; a processor without state and without
    ``validate`` gives the same table and dead letters through the executor read."""
    stream = unique_name
    evs = events(300)
    api = await setup(js, stream, evs)
    below, above = DeltaSink(str(tmp_path / "below")), DeltaSink(str(tmp_path / "above"))
    r = await run_partition(nc, stream, "d", P, SparkProcessor(DECODER, plain, spark=spark),
                            below, EngineOptions(batch_max_msgs=1000,
                                                 executor_read_min_msgs=10_000, **FAST))
    assert r.status == "drained" and r.commits == 1
    assert "read_executors" not in r.timings and "read" in r.timings
    rx = await run_partition(nc, stream, "x", P, SparkProcessor(DECODER, plain, spark=spark),
                             above, EngineOptions(executor_read_min_msgs=1, **FAST))
    assert rx.status == "drained" and rx.commits == 1 and "read_executors" in rx.timings
    assert table(above).to_pylist() == table(below).to_pylist()
    assert table(above).schema == table(below).schema
    assert await dead_letters(api, stream, "x") == await dead_letters(api, stream, "d")
    assert rx.dead_lettered == r.dead_lettered > 0
    # The executors reach this server as the engine does.
    assert executor_connect_options(nc) == {"servers": nc.servers[0].geturl()}


async def test_fenced_and_failed_executor_batches_commit_nothing(nc, js, unique_name, tmp_path,
                                                                 spark) -> None:
    """A newer holder commits while the executor batch is processed: the fence refuses this
    run's commit, nothing is purged or acked; a transform that fails leaves everything too.
    The next run (executor read again) drains the partition exactly once."""
    stream = unique_name
    evs = events(600)
    api = await setup(js, stream, evs)
    sink, ref_sink = DeltaSink(str(tmp_path / "t")), DeltaSink(str(tmp_path / "ref"))
    app_id = f"{stream}/x/{P}"
    opts = EngineOptions(executor_read_min_msgs=50, **FAST)
    before = (await api.stream_info(f"{stream}-x"))["state"]["messages"]

    def broken(spark: SparkSession, df: DataFrame, ctx: BatchContext) -> DataFrame:
        raise RuntimeError("transform failed")

    with pytest.raises(RuntimeError, match="transform failed"):
        await run_partition(nc, stream, "x", P, SparkProcessor(DECODER, broken, state=STATE,
                                                               validate=validate_odd,
                                                               spark=spark), sink, opts)
    assert sink.watermark(app_id) == 0
    assert (await api.stream_info(f"{stream}-x"))["state"]["messages"] == before

    def zombie_maker(step: str, info: dict) -> None:
        if step == "processed":  # another holder commits first (a stale watermark for us)
            sink.commit(pa.table({"key": pa.array([], pa.string())}), {app_id: (0, 1)})

    r = await run_partition(nc, stream, "x", P, processor(spark=spark), sink, opts,
                            hook=zombie_maker)
    assert r.status == "fenced" and r.commits == 0 and r.fence_conflicts == 1
    assert (await api.stream_info(f"{stream}-x"))["state"]["messages"] == before
    assert sink.watermark(app_id) == 1

    # Reset the fake holder's watermark by starting over in a fresh table; the next run of
    # the partition drains it exactly once (executor read), as the driver path does.
    sink = DeltaSink(str(tmp_path / "t2"))
    r = await run_partition(nc, stream, "x", P, processor(spark=spark), sink, opts)
    assert r.status == "drained" and r.commits == 1 and "read_executors" in r.timings
    rd = await run_partition(nc, stream, "d", P, processor(spark=spark), ref_sink,
                             EngineOptions(batch_max_msgs=200, **FAST))
    assert rd.status == "drained"
    assert (table(sink).drop_columns(["_time"]).to_pylist()
            == table(ref_sink).drop_columns(["_time"]).to_pylist())
    assert sink.watermark(app_id) == ref_sink.watermark(f"{stream}/d/{P}")


SUBJECT_STATE = KeyedState("_subject", ("count",))


def per_subject(spark: SparkSession, df: DataFrame, ctx: BatchContext) -> DataFrame:
    """State keyed on a meta column: a running count per subject."""
    w = Window.partitionBy("_subject").orderBy("_seq")
    return df.select("_subject", "key", "n", "_seq",
                     (F.coalesce("last_count", F.lit(0)) + F.row_number().over(w))
                     .alias("count"))


async def test_process_range_equals_process_message_for_message(nc, js, unique_name,
                                                                 spark) -> None:
    """The processor alone on one range: ``process`` over the engine's driver read and
    ``process_range`` over the executors' read give the same rows and dead letters, with state
    keyed on ``_subject`` (a meta column) that some keys have and some do not, and the range's
    facts (messages, last sequence, its origin sequence, dead records)."""
    stream = unique_name
    evs = events(400)
    await setup(js, stream, evs)
    wq = f"{stream}-x"
    got = await read_range(nc, wq, 1, filter_subject=f"{P}.>", prefix=f"{P}.",
                           drop_nats_headers=True)
    records = got.table(origin=True).cast(RECORD_SCHEMA)
    subjects = sorted(set(records["subject"].to_pylist()))
    committed = pa.table({"_subject": subjects[::2], "_seq": [0] * len(subjects[::2]),
                          "count": [100 * (i + 1) for i in range(len(subjects[::2]))]})

    def ctx(first: int, last: int) -> BatchContext:
        cache = KeyStateCache(SUBJECT_STATE, lambda keys: last_per_key(committed.filter(
            pa.compute.is_in(committed["_subject"], pa.array(list(keys), pa.string()))),
            "_subject", "_seq"))
        return BatchContext(stream, "x", P, app_id_for(stream, "x", P), first, last,
                            None, cache)  # type: ignore[arg-type]

    proc = SparkProcessor(DECODER, per_subject, state=SUBJECT_STATE, validate=validate_odd,
                          spark=spark, read_options={"partitions": 3, "batch": 50})
    first, last = records["seq"][0].as_py(), records["seq"][-1].as_py()
    want = proc.process(records, ctx(first, last))
    source = {**executor_connect_options(nc), "stream": wq, "subject": f"{P}.>",
              "first_seq": "1", "last_seq": str(last + 10), "strip_partition": "true"}
    have = proc.process_range(source, ctx(1, last + 10))

    assert have.processed.table.schema == want.table.schema
    assert have.processed.table.to_pylist() == want.table.to_pylist()
    counts = [r["count"] for r in want.table.to_pylist()]
    assert min(counts) == 1 and max(counts) > 100  # keys with and without committed state
    assert have.processed.dead == want.dead and len(want.dead) >= 3
    assert (have.messages, have.first_seq, have.last_seq) == (records.num_rows, first, last)
    assert have.last_origin_seq == records["origin_seq"][-1].as_py() is not None
    dead = records.filter(pa.compute.is_in(records["seq"], pa.array([d.seq for d in want.dead])))
    assert have.dead_records.drop_columns(["time"]).to_pylist() == dead.drop_columns(
        ["time"]).to_pylist()
    assert have.dead_records["time"].cast("int64").to_pylist() == [
        t // 1000 * 1000 for t in dead["time"].cast("int64").to_pylist()]
    assert set(have.timings) == {"read_executors", "process"}
