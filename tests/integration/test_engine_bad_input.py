"""Bad message payloads through the ordered engine, end to end (issue 6, "Bad input").

The real legs pipeline (the Arrow legs processor: :data:`~flights.data.DECODER`
plus :func:`~flights.data.validate_subject`) drains one partition that holds real
flights of one aircraft (N146PQ, flying for 9E then EV) interleaved with one bad message per
kind, each built from a good payload of that same aircraft:

Among them the three payloads of issue 16 that used to stall a partition for good (an integer
beyond 64 bits, a lone surrogate, JSON nested 100,000 deep).

- under ``dlq``: each bad message is dead-lettered exactly once (a rerun adds none) with its
  payload, subject and a reason naming the problem; the good ones commit in order (the legs
  equal the pandas reference); the work queue ends empty;
- under ``halt``: each run stops at the next bad message with its reason, commits only what
  precedes it and leaves the bad message first in the work queue (nothing lost, nothing
  skipped); an operator removes it, and the next run goes on to the next one.

The group partitions on the whole subject (filter ``<stream>.>``), so subjects with too few or
too many tokens reach the processor. A group partitioning on ``<stream>.*.*`` (the flights
filter) never sources them: they stay in the origin stream only, which is checked too.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
import pytest
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from cg_pipelines.core.config import (
    ElasticConfig,
    PartitioningFilter,
    dlq_stream_name,
    work_queue_stream_name,
)
from cg_pipelines.engine.options import EngineOptions
from cg_pipelines.engine.runner import run_partition
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.sinks.delta import DeltaSink
from flights.data import event_payloads, load_flights, subjects
from flights.legs import legs_arrow_processor
from flights.reference import compare_legs, reference_legs
from tests.support.wait import wait_for

TAIL = "N146PQ"
GOOD = 16
FAST = dict(ack_wait_s=1.5, priority_timeout_s=1.5, hold_wait_s=6.0)


@dataclass(frozen=True)
class Msg:
    subject: str
    data: bytes
    reason: str | None = None  # text the dead letter's reason must contain (None: good)
    kind: str = "good"


@dataclass(frozen=True)
class Case:
    kind: str
    make: Callable[[str, str, dict], tuple[str, bytes]]  # (stream, "carrier.tailnum",
    # good payload) -> (subject, data)
    reason: str


def _json(d: dict) -> bytes:
    return json.dumps(d).encode()


CASES = [
    Case("malformed JSON", lambda s, t, p: (f"{s}.{t}", b'{"carrier": "9E",'),
         "malformed JSON"),
    Case("not an object", lambda s, t, p: (f"{s}.{t}", b"[1, 2]"),
         "payload must be a JSON object, got list"),
    Case("wrong type", lambda s, t, p: (f"{s}.{t}", _json({**p, "flight": str(p["flight"])})),
         "field 'flight' must be int, got str"),
    Case("float for int", lambda s, t, p: (f"{s}.{t}", _json({**p, "dep_delay": 1.5})),
         "field 'dep_delay' must be int, got float"),
    Case("null not allowed", lambda s, t, p: (f"{s}.{t}", _json({**p, "distance": None})),
         "field 'distance' must not be null"),
    Case("missing field", lambda s, t, p: (
        f"{s}.{t}", _json({k: v for k, v in p.items() if k != "tailnum"})),
        "missing field 'tailnum'"),
    Case("not UTF-8", lambda s, t, p: (f"{s}.{t}", b'{"carrier": "\xff\xfe"}'),
         "payload is not valid UTF-8 (byte 13)"),
    Case("empty", lambda s, t, p: (f"{s}.{t}", b""), "empty payload"),
    Case("too few tokens", lambda s, t, p: (f"{s}.{p['tailnum']}", _json(p)),
         "has too few tokens (2, expected 3: <prefix>.<carrier>.<tailnum>)"),
    Case("too many tokens", lambda s, t, p: (f"{s}.{t}.x", _json(p)),
         "has too many tokens (4, expected 3"),
    Case("subject of another key", lambda s, t, p: (f"{s}.{p['carrier']}.N0OTHER", _json(p)),
         "does not end with the payload's carrier.tailnum"),
    # issue 16: payloads that pass a plain json.loads and used to crash the whole batch
    Case("integer beyond 64 bits", lambda s, t, p: (f"{s}.{t}", _json({**p, "flight": 10**30})),
         "field 'flight' must be a 64-bit int, got a 31-digit integer"),
    Case("lone surrogate", lambda s, t, p: (
        f"{s}.{t}", _json(p).replace(b'"origin": "', b'"origin": "\\ud800', 1)),
        "field 'origin' is not valid Unicode (lone surrogate at character 0)"),
    Case("nested 100,000 deep", lambda s, t, p: (
        f"{s}.{t}", _json(p)[:-1] + b', "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        "JSON nested deeper than 64 levels"),
]


@pytest.fixture(scope="module")
def aircraft() -> pd.DataFrame:
    """The first GOOD real flights of one aircraft, in publish order."""
    df = load_flights()
    out = df[df["tailnum"] == TAIL].head(GOOD).reset_index(drop=True)
    assert set(out["carrier"]) == {"9E", "EV"}
    return out


def _messages(stream: str, flights: pd.DataFrame) -> list[Msg]:
    """A bad message before each of the first len(CASES) good ones, then the rest."""
    subs = [s.replace("flights.", f"{stream}.", 1) for s in subjects(flights)]
    payloads = event_payloads(flights)
    out: list[Msg] = []
    for i, (subject, data) in enumerate(zip(subs, payloads, strict=True)):
        if i < len(CASES):
            case = CASES[i]
            tail = subject.split(".", 1)[1]
            bad_subject, bad_data = case.make(stream, tail, json.loads(data))
            out.append(Msg(bad_subject, bad_data, case.reason, case.kind))
        out.append(Msg(subject, data))
    return out


async def _setup(js: JetStreamContext, stream: str, msgs: list[Msg]) -> JetStreamAPI:
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    # "g": the whole subject hashed (every subject under the stream reaches partition 0).
    await admin.create_elastic(js, stream, "g", ElasticConfig(
        1, (PartitioningFilter(f"{stream}.>"),), members=("m1",)))
    # "f": the flights filter; subjects of another depth are not sourced into its work queue.
    await admin.create_elastic(js, stream, "f", ElasticConfig(
        1, (PartitioningFilter(f"{stream}.*.*", (2,)),), members=("m1",)))
    for m in msgs:  # one at a time: the stream's order is the list's
        await js.publish(m.subject, m.data)
    api = JetStreamAPI.from_js(js)
    three = sum(1 for m in msgs if len(m.subject.split(".")) == 3)
    for wq, n in ((work_queue_stream_name(stream, "g"), len(msgs)),
                  (work_queue_stream_name(stream, "f"), three)):
        async def queued(wq: str = wq, n: int = n) -> bool:
            return int((await api.stream_info(wq))["state"]["messages"]) >= n
        await wait_for(queued, 60, f"{wq} to hold {n} messages", interval=0.05)
    # Not mappable by "f"'s transform: kept in the origin stream only (not lost, not queued).
    origin = await api.stream_info(stream)
    assert int(origin["state"]["messages"]) == len(msgs)
    f_wq = await api.stream_info(work_queue_stream_name(stream, "f"), subjects_filter=">")
    assert int(f_wq["state"]["messages"]) == three == len(msgs) - 2
    f_subjects = {s.split(".", 1)[1] for s in f_wq["state"]["subjects"]}
    assert not {m.subject for m in msgs if len(m.subject.split(".")) != 3} & f_subjects
    return api


async def _wq_messages(api: JetStreamAPI, stream: str) -> int:
    return int((await api.stream_info(work_queue_stream_name(stream, "g")))["state"]["messages"])


async def test_every_bad_payload_is_dead_lettered_once_with_its_reason(
        nc, js, unique_name, tmp_path, aircraft) -> None:
    stream = unique_name
    msgs = _messages(stream, aircraft)
    api = await _setup(js, stream, msgs)
    sink = DeltaSink(str(tmp_path / "legs"))
    opts = EngineOptions(batch_max_msgs=5, read_chunk=3, **FAST)  # batches split the cases
    r = await run_partition(nc, stream, "g", 0, legs_arrow_processor(), sink, opts)
    assert r.status == "drained", r
    assert (r.processed, r.dead_lettered) == (GOOD, len(CASES)), r
    # The good ones: committed in order, legs equal to the reference (per-key state intact).
    table = sink.read().sort_by("_seq")
    good_seqs = [i + 1 for i, m in enumerate(msgs) if m.reason is None]
    assert table["_seq"].to_pylist() == good_seqs
    rows, mismatches, desc = compare_legs(table, reference_legs(aircraft))
    assert (rows, mismatches) == (GOOD, 0), desc
    assert await _wq_messages(api, stream) == 0
    # The bad ones: each in the DLQ once, in stream order, bytes and subject kept, reason named.
    dlq = dlq_stream_name(stream, "g")
    stored = await api.direct_get_batch(dlq, 1, f"{dlq}.>", 100)
    bad = [(i + 1, m) for i, m in enumerate(msgs) if m.reason is not None]
    assert [int(d.headers["Cg-Sequence"]) for d in stored] == [seq for seq, _ in bad]
    for d, (_, m) in zip(stored, bad, strict=True):
        assert d.data == m.data, m.kind
        assert d.headers["Cg-Subject"] == m.subject, m.kind
        assert d.headers["Cg-Origin-Stream"] == stream and d.headers["Cg-Partition"] == "0"
        assert m.reason is not None and m.reason in d.headers["Cg-Error"], (
            m.kind, d.headers["Cg-Error"])
    # Exactly once: a rerun finds nothing and dead-letters nothing more.
    again = await run_partition(nc, stream, "g", 0, legs_arrow_processor(), sink, opts)
    assert again.status == "empty" and again.dead_lettered == 0
    assert len(await api.direct_get_batch(dlq, 1, f"{dlq}.>", 100)) == len(CASES)


async def test_halt_stops_at_each_bad_payload_with_its_reason(
        nc, js, unique_name, tmp_path, aircraft) -> None:
    stream = unique_name
    msgs = _messages(stream, aircraft)
    api = await _setup(js, stream, msgs)
    wq = work_queue_stream_name(stream, "g")
    sink = DeltaSink(str(tmp_path / "legs"))
    app_id = f"{stream}/g/0"
    opts = EngineOptions(batch_max_msgs=5, read_chunk=3, dead_letter_policy="halt", **FAST)
    bad = [(i + 1, m) for i, m in enumerate(msgs) if m.reason is not None]
    for n, (seq, m) in enumerate(bad):
        r = await run_partition(nc, stream, "g", 0, legs_arrow_processor(), sink, opts)
        assert r.status == "halted" and r.halted_at == seq, (m.kind, r)
        assert r.detail.startswith(f"halted at sequence {seq}: "), r.detail
        assert m.reason is not None and m.reason in r.detail, (m.kind, r.detail)
        # Only what precedes it is committed; it and everything after stay queued, in order.
        assert sink.watermark(app_id) == seq - 1
        before = [i + 1 for i, x in enumerate(msgs[:seq - 1]) if x.reason is None]
        committed = sink.read().sort_by("_seq")["_seq"].to_pylist() if before else []
        assert committed == before
        first = await api.direct_get_batch(wq, 1, ">", 1)
        assert first[0].seq == seq and first[0].data == m.data
        assert await _wq_messages(api, stream) == len(msgs) - seq + 1
        if n == 0:  # a rerun halts there again (the message is not skipped)
            again = await run_partition(nc, stream, "g", 0, legs_arrow_processor(), sink, opts)
            assert again.status == "halted" and again.halted_at == seq
        await js.delete_msg(wq, seq)  # the operator removes it (it is still in the origin)
    dlq = dlq_stream_name(stream, "g")
    assert await api.direct_get_batch(dlq, 1, f"{dlq}.*", 100) == []  # halt dead-letters none
    # only the last halt's note (for `cg halt skip`) is kept: one per partition
    (note,) = await api.direct_get_batch(dlq, 1, f"{dlq}.halted.>", 100)
    assert note.headers["Cg-Sequence"] == str(bad[-1][0]) and note.data == b""
    assert bad[-1][1].reason is not None and bad[-1][1].reason in note.headers["Cg-Error"]
    r = await run_partition(nc, stream, "g", 0, legs_arrow_processor(), sink, opts)
    assert r.status == "drained" and r.dead_lettered == 0, r
    rows, mismatches, desc = compare_legs(sink.read(), reference_legs(aircraft))
    assert (rows, mismatches) == (GOOD, 0), desc
    assert await _wq_messages(api, stream) == 0
    assert int((await api.stream_info(stream))["state"]["messages"]) == len(msgs)
