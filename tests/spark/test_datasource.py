"""The ``jetstream`` Spark data source against a real nats-server."""

from __future__ import annotations

import asyncio
import json

import nats
import pytest
from nats.js.api import StreamConfig
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import to_arrow_schema

from cg_pipelines.core.record import RECORD_SCHEMA
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.spark.datasource import (
    ARROW_READ_SCHEMA,
    SPARK_RECORD_SCHEMA,
    SeqRange,
    SourceOptions,
    split_range,
)
from cg_pipelines.spark.processor import read_range_with_spark

STREAM = "DS"
N = 400
PARTS = 4


# -- pure helpers (no server, no Spark) ------------------------------------------------------


def test_split_range_contiguous_and_even() -> None:
    assert split_range(1, 10, 3) == [SeqRange(1, 4), SeqRange(5, 7), SeqRange(8, 10)]
    assert split_range(5, 6, 4) == [SeqRange(5, 5), SeqRange(6, 6)]  # capped to the width
    assert split_range(7, 6, 2) == []
    for first, last, parts in [(1, 100, 7), (13, 14, 1), (3, 1000, 4)]:
        rs = split_range(first, last, parts)
        assert rs[0].first == first and rs[-1].last == last
        assert all(a.last + 1 == b.first for a, b in zip(rs, rs[1:], strict=False))
        widths = {r.last - r.first + 1 for r in rs}
        assert max(widths) - min(widths) <= 1
    with pytest.raises(ValueError, match="partitions"):
        split_range(1, 2, 0)


def test_options_parse_and_errors() -> None:
    s = SourceOptions.parse({"servers": "nats://h:1", "stream": "S", "first_seq": "5",
                             "STRIP_PARTITION": "true", "password": "pw"})
    assert (s.first_seq, s.last_seq, s.subject, s.partitions, s.strip_partition) == (
        5, None, ">", 1, True)
    assert "pw" not in repr(s)
    with pytest.raises(ValueError, match="'stream' is required"):
        SourceOptions.parse({"servers": "nats://h:1"})
    with pytest.raises(ValueError, match="'last_seq' must be an integer"):
        SourceOptions.parse({"servers": "x", "stream": "S", "last_seq": "ten"})
    with pytest.raises(ValueError, match="'partitions' must be >= 1"):
        SourceOptions.parse({"servers": "x", "stream": "S", "partitions": "0"})


def test_arrow_schema_is_what_pyspark_expects() -> None:
    # PySpark compares the first batch's schema with this, exactly (types and nullability).
    assert to_arrow_schema(SPARK_RECORD_SCHEMA, timezone="UTC").equals(ARROW_READ_SCHEMA)
    assert ARROW_READ_SCHEMA.names == RECORD_SCHEMA.names


# -- against nats-server ---------------------------------------------------------------------


async def _publish(url: str) -> list[tuple[int, str, bytes, dict | None]]:
    """N messages over partitions 0..3 (subjects ``<p>.k<i%5>``); some with headers."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await js.add_stream(
            StreamConfig(name=STREAM, subjects=[f"{p}.>" for p in range(PARTS)],
                         allow_direct=True)
        )
        out = []
        for i in range(N):
            subject = f"{(i * 7) % PARTS}.k{i % 5}"
            data = f'{{"i":{i}}}'.encode()
            headers = {"n": str(i), "kind": "x"} if i % 9 == 0 else None
            ack = await js.publish(subject, data, headers=headers)
            out.append((ack.seq, subject, data, headers))
        return out
    finally:
        await nc.close()


async def _driver_read(url: str, subject: str, first: int) -> list:
    nc = await nats.connect(url)
    try:
        api = JetStreamAPI(nc)
        return await api.direct_get_batch(STREAM, first, subject, 10_000)
    finally:
        await nc.close()


@pytest.fixture(scope="module")
def published(nats_url: str) -> list[tuple[int, str, bytes, dict | None]]:
    return asyncio.run(_publish(nats_url))


def test_read_sub_range_in_three_partitions(spark, nats_url, published) -> None:
    first, last = 37, 301
    df = read_range_with_spark(spark, nats_url, STREAM, "2.>", first, last, 3)
    assert df.schema == SPARK_RECORD_SCHEMA

    tagged = (df.withColumn("pid", F.spark_partition_id())
                .withColumn("pos", F.monotonically_increasing_id()))
    rows = tagged.orderBy("seq").collect()

    expected = [(s, subj, d) for s, subj, d, _ in published
                if first <= s <= last and subj.startswith("2.")]
    assert len(expected) > 30
    assert [(r.seq, r.subject, bytes(r.data)) for r in rows] == expected

    # Same headers as a driver-side direct get (JSON object of the user headers, or null).
    stored = {m.seq: m for m in asyncio.run(_driver_read(nats_url, "2.>", first))}
    for r in rows:
        want = stored[r.seq].headers
        assert (json.loads(r.headers) if r.headers is not None else None) == want
    assert any(r.headers is not None for r in rows)

    # Each input partition is one contiguous sub-range, read in sequence order.
    by_pid: dict[int, list] = {}
    for r in sorted(rows, key=lambda r: r.pos):
        by_pid.setdefault(r.pid, []).append(r.seq)
    assert sorted(by_pid) == [0, 1, 2]
    for seqs in by_pid.values():
        assert seqs == sorted(seqs)
    assert max(by_pid[0]) < min(by_pid[1]) and max(by_pid[1]) < min(by_pid[2])


def test_exact_times_and_headers_via_arrow(spark, nats_url, published) -> None:
    df = read_range_with_spark(spark, nats_url, STREAM, "1.>", 1, N, 2, strip_partition=True)
    table = df.orderBy("seq").toArrow()
    stored = asyncio.run(_driver_read(nats_url, "1.>", 1))
    assert table.column("seq").to_pylist() == [m.seq for m in stored]
    assert table.column("subject").to_pylist() == [m.subject.split(".", 1)[1] for m in stored]
    us = table.column("time").cast("int64").to_pylist()
    assert us == [m.time_ns // 1000 for m in stored]
    assert table.schema.field("time").type == ARROW_READ_SCHEMA.field("time").type


def test_defaults_read_whole_stream(spark, nats_url, published) -> None:
    from cg_pipelines.spark.datasource import register_jetstream_source

    register_jetstream_source(spark)
    df = (spark.read.format("jetstream").option("servers", nats_url).option("stream", STREAM)
          .option("partitions", 4).option("batch", 37).load())
    assert [r.seq for r in df.select("seq").orderBy("seq").collect()] == list(range(1, N + 1))
    # A range past the stream's end (or empty) reads nothing.
    assert read_range_with_spark(spark, nats_url, STREAM, ">", N + 1, N + 50, 2).count() == 0
    assert read_range_with_spark(spark, nats_url, STREAM, ">", 9, 8, 2).count() == 0


def test_missing_stream_fails_clearly(spark, nats_url) -> None:
    df = read_range_with_spark(spark, nats_url, "NOPE", ">", 1, 10, 1, timeout=2,
                               password="s3cret-pw")
    with pytest.raises(Exception, match="NOPE") as err:
        df.collect()
    assert "s3cret-pw" not in str(err.value)
