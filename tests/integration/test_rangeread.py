"""Range reads (cg_pipelines.jetstream.rangeread) against a real nats-server.

The bulk path must return what the per-message path (``JetStreamAPI.direct_get_batch``) returns
for sourced work-queue messages (sequence, subject, time, data, headers), filtered and
unfiltered, bounded by ``last_seq``/``max_msgs``/``max_bytes``; reads may run concurrently on one
connection without disturbing its other traffic, the client's own parser is back in place after
each read, and a lost server or a stalled reply ends the read with a typed error.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator

import nats
import nats.errors
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.protocol.parser import Parser

from cg_pipelines.jetstream import rangeread
from cg_pipelines.jetstream.api import JetStreamAPI, StoredMessage
from cg_pipelines.jetstream.errors import (
    JetStreamUnavailableError,
    RequestTimeoutError,
)
from cg_pipelines.jetstream.rangeread import RangeBatch, read_range
from cg_pipelines.local.nats_server import NatsServer

pytestmark = pytest.mark.integration

TRANSFORM = "{{Partition(8,1,2)}}.flights.{{Wildcard(1)}}.{{Wildcard(2)}}"
CARRIERS = ["AA", "UA", "DL", "B6", "WN"]


@pytest_asyncio.fixture(loop_scope="session")
async def api(nc: Client) -> AsyncIterator[JetStreamAPI]:
    async with JetStreamAPI(nc, timeout=10.0) as a:
        yield a


async def make_work_queue(api: JetStreamAPI, nc: Client, name: str, n: int) -> str:
    """Origin stream ``name`` with ``n`` messages (some with headers of their own, some empty or
    binary) and the work queue ``<name>-g`` sourcing it into 8 partitions; returns the latter."""
    await api.create_stream({"name": name, "subjects": [f"{name}.>"], "storage": "file"})
    js = nc.jetstream(timeout=10)
    futs = []
    for i in range(n):
        subject = f"{name}.{CARRIERS[i % 5]}.N{i % 37}"
        payload = b"" if i % 11 == 0 else (b"bin\r\nHMSG x 1 2\r\n\x00" if i % 13 == 0
                                          else json.dumps({"i": i, "pad": "x" * (i % 50)}).encode())
        headers = None
        if i % 7 == 0:
            headers = {"X-Trace": f"t-{i}", "Quote": 'say "hi"'}
        elif i % 17 == 0:
            headers = {"Nats-Msg-Id": f"id-{i}"}
        futs.append(await js.publish_async(subject, payload, headers=headers))
    await asyncio.gather(*futs)
    wq = f"{name}-g"
    await api.create_stream({
        "name": wq, "retention": "workqueue", "storage": "file", "discard": "new",
        "allow_direct": True,
        "sources": [{"name": name, "subject_transforms": [
            {"src": f"{name}.*.*", "dest": TRANSFORM.replace("flights", name)}]}],
    })
    deadline = time.monotonic() + 30
    while (await api.stream_info(wq))["state"]["messages"] < n:
        assert time.monotonic() < deadline, "the work queue did not fill up"
        await asyncio.sleep(0.05)
    return wq


async def all_stored(api: JetStreamAPI, stream: str, flt: str, last: int | None = None
                     ) -> list[StoredMessage]:
    """The reference: every message matching ``flt`` via direct_get_batch (chunks of 50)."""
    out: list[StoredMessage] = []
    seq = 1
    while True:
        msgs = await api.direct_get_batch(stream, seq, flt, 50)
        out.extend(m for m in msgs if last is None or m.seq <= last)
        if not msgs or msgs[-1].num_pending == 0 or (last is not None and msgs[-1].seq >= last):
            return out
        seq = msgs[-1].seq + 1


def rows(b: RangeBatch) -> list[dict]:
    t = b.table(origin=True)
    out = t.to_pylist()
    for r, ns in zip(out, b.time.cast("int64").to_pylist(), strict=True):
        r["time"] = ns
    return out


def expected(msgs: list[StoredMessage], prefix: str | None) -> list[dict]:
    out = []
    for m in msgs:
        if prefix and not m.subject.startswith(prefix):
            continue
        src = (m.headers or {}).get("Nats-Stream-Source")
        out.append({
            "seq": m.seq,
            "subject": m.subject[len(prefix):] if prefix else m.subject,
            "time": m.time_ns,
            "headers": json.dumps(m.headers) if m.headers else None,
            "data": m.data,
            "origin_seq": int(src.split(" ")[1]) if src else None,
        })
    return out


@pytest_asyncio.fixture(loop_scope="session", scope="session")
async def wq(nats_server: NatsServer) -> AsyncIterator[str]:
    """One work queue of 600 messages for the read-only tests."""
    conn = await nats.connect(nats_server.url)
    try:
        async with JetStreamAPI(conn, timeout=10.0) as a:
            yield await make_work_queue(a, conn, "RR", 600)
    finally:
        await conn.close()


# ------------------------------------------------------------------------------ equivalence


@pytest.mark.parametrize("partition", [0, 3, 7])
@pytest.mark.parametrize("filtered", [True, False])
async def test_same_messages_as_direct_get_batch(nc, api, wq, partition, filtered) -> None:
    prefix = f"{partition}."
    want = expected(await all_stored(api, wq, ">"), prefix)
    assert want, "partition without messages"
    b = await read_range(nc, wq, 1, filter_subject=f"{prefix}>" if filtered else ">",
                         prefix=prefix, max_msgs=10_000)
    assert rows(b) == want
    assert b.ended and b.next_seq > want[-1]["seq"]
    assert b.requests == 1
    # Every message is sourced: origin_seq is set and headers keep Nats-Stream-Source.
    assert all(r["origin_seq"] for r in rows(b))
    assert all("Nats-Stream-Source" in json.loads(r["headers"]) for r in rows(b))


async def test_whole_stream_without_prefix(nc, api, wq) -> None:
    want = expected(await all_stored(api, wq, ">"), None)
    b = await read_range(nc, wq, 1, filter_subject=">", max_msgs=10_000)
    assert rows(b) == want and len(b) == 600


async def test_drop_nats_headers_is_what_the_engine_keeps(nc, api, wq) -> None:
    msgs = await all_stored(api, wq, "2.>")
    b = await read_range(nc, wq, 1, filter_subject="2.>", prefix="2.", drop_nats_headers=True)
    want = []
    for m in msgs:
        user = {k: v for k, v in (m.headers or {}).items() if not k.startswith("Nats-")}
        want.append(json.dumps(user) if user else None)
    assert b.headers.to_pylist() == want
    assert any(h is not None for h in want) and any(h is None for h in want)


async def test_plain_path_gives_the_same_batch(nc, wq) -> None:
    for flt in ("5.>", ">"):
        kw = dict(filter_subject=flt, prefix="5.", max_msgs=40, last_seq=500)
        fast = await read_range(nc, wq, 3, **kw)
        plain = await read_range(nc, wq, 3, fast=False, **kw)
        assert rows(fast) == rows(plain)
        assert (fast.ended, fast.next_seq, fast.num_pending) == (
            plain.ended, plain.next_seq, plain.num_pending)


async def test_other_nats_py_version_falls_back(nc, wq, monkeypatch) -> None:
    want = await read_range(nc, wq, 1, filter_subject="1.>", prefix="1.")
    monkeypatch.setattr(rangeread.nats_client, "__version__", "2.17.0")
    assert not rangeread.fast_path_available(nc)
    got = await read_range(nc, wq, 1, filter_subject="1.>", prefix="1.")
    assert rows(got) == rows(want)
    with pytest.raises(ValueError, match="2.16"):
        await read_range(nc, wq, 1, filter_subject="1.>", prefix="1.", fast=True)


# ----------------------------------------------------------------------------------- bounds


@pytest.mark.parametrize("filtered", [True, False])
async def test_ranges_bounded_by_last_seq_and_max_msgs(nc, api, wq, filtered) -> None:
    prefix = "4."
    flt = "4.>" if filtered else ">"
    everything = expected(await all_stored(api, wq, ">"), prefix)
    last = everything[len(everything) // 2]["seq"]
    # max_msgs: consecutive ranges cover the partition up to last_seq exactly once.
    got: list[dict] = []
    seq = 1
    batches = []
    while True:
        b = await read_range(nc, wq, seq, filter_subject=flt, prefix=prefix, max_msgs=7,
                             last_seq=last, request_batch=5)
        batches.append(b)
        assert len(b) <= 7
        got.extend(rows(b))
        if b.ended:
            break
        assert len(b) == 7 and b.next_seq == b.seq[-1].as_py() + 1
        seq = b.next_seq
    assert got == [r for r in everything if r["seq"] <= last]
    assert batches[-1].next_seq == last + 1
    # A range that ends exactly at last_seq.
    b = await read_range(nc, wq, 1, filter_subject=flt, prefix=prefix, last_seq=last)
    assert rows(b)[-1]["seq"] == last and b.ended and b.next_seq == last + 1


def _upto_budget(sizes: list[int], budget: int) -> int:
    """How many messages a byte budget takes: up to the one whose payload reaches it."""
    total = 0
    for k, size in enumerate(sizes, start=1):
        total += size
        if total >= budget:
            return k
    return len(sizes)


async def test_max_bytes(nc, api, wq) -> None:
    everything = expected(await all_stored(api, wq, "6.>"), "6.")
    sizes = [len(r["data"]) for r in everything]
    for start, budget in ((0, sum(sizes[:5]) - 1), (0, sum(sizes[:9])), (1, 1), (3, 10**9)):
        k = _upto_budget(sizes[start:], budget)
        b = await read_range(nc, wq, everything[start]["seq"], filter_subject="6.>",
                             prefix="6.", max_bytes=budget)
        assert rows(b) == everything[start:start + k]
        assert len(b) >= 1
        assert b.ended == (start + k == len(everything))
        assert b.next_seq == everything[start + k - 1]["seq"] + 1 or b.ended


async def test_empty_ranges(nc, api, wq) -> None:
    last = (await api.stream_info(wq))["state"]["last_seq"]
    for kw in (dict(filter_subject="3.>", prefix="3."), dict(filter_subject=">", prefix="3.")):
        b = await read_range(nc, wq, last + 1, **kw)
        assert len(b) == 0 and b.ended and b.num_pending is None and b.next_seq == last + 1
        assert b.table().num_rows == 0 and b.table().schema.names == [
            "seq", "subject", "time", "headers", "data"]
    b = await read_range(nc, wq, 1, filter_subject="3.>", prefix="3.", last_seq=0 + 1)
    assert b.ended and all(s <= 1 for s in b.seq.to_pylist())
    b = await read_range(nc, wq, 1, filter_subject="9.>", prefix="9.")  # no such partition
    assert len(b) == 0 and b.ended


async def test_bad_arguments(nc, wq) -> None:
    for kw in (dict(max_msgs=0), dict(max_bytes=0), dict(request_batch=0)):
        with pytest.raises(ValueError):
            await read_range(nc, wq, 1, filter_subject=">", **kw)
    with pytest.raises(ValueError):
        await read_range(nc, wq, 0, filter_subject=">")


# ------------------------------------------------------------------------- the connection


async def test_concurrent_reads_on_one_connection(nc, api, wq) -> None:
    ps = nc._ps
    kws = [dict(filter_subject=f"{p}.>", prefix=f"{p}.") for p in range(8)]
    kws += [dict(filter_subject=">", prefix=f"{p}.", request_batch=64) for p in range(8)]
    sequential = [rows(await read_range(nc, wq, 1, **kw)) for kw in kws]
    concurrent = await asyncio.gather(*(read_range(nc, wq, 1, **kw) for kw in kws))
    assert [rows(b) for b in concurrent] == sequential
    assert nc._ps is ps and type(ps) is Parser


async def test_other_traffic_during_a_read(nc, nats_server, unique_name) -> None:
    """A subscription and a request on the reading connection work while a large range is
    being read, and the client's parser is the same object afterwards."""
    api = JetStreamAPI(nc, timeout=10)
    wq = await make_work_queue(api, nc, unique_name, 3000)
    responder = await nats.connect(nats_server.url)
    try:
        async def pong(m) -> None:
            await m.respond(b"pong:" + m.data)

        await responder.subscribe(f"svc.{unique_name}", cb=pong)
        await responder.flush()
        got: list[bytes] = []

        async def collect(m) -> None:
            got.append(m.data)

        sub = await nc.subscribe(f"events.{unique_name}", cb=collect)
        ps = nc._ps
        read = asyncio.create_task(read_range(nc, wq, 1, filter_subject=">", max_msgs=3000))
        seen_installed = False
        for i in range(20):
            await nc.publish(f"events.{unique_name}", b"e%d" % i)
            reply = await nc.request(f"svc.{unique_name}", b"%d" % i, timeout=5)
            assert reply.data == b"pong:%d" % i
            seen_installed |= isinstance(nc._ps, rangeread._RangeParser)
            await asyncio.sleep(0)
        b = await read
        await nc.flush()
        assert len(b) == 3000 and b.ended
        assert got == [b"e%d" % i for i in range(20)]
        assert nc._ps is ps and not ps.buf
        assert seen_installed or read.done()
        await sub.unsubscribe()
        # The connection keeps working with the plain parser.
        assert (await nc.request(f"svc.{unique_name}", b"x", timeout=5)).data == b"pong:x"
    finally:
        await responder.close()
        await api.close()


async def test_parser_restored_after_an_error(nc, wq) -> None:
    ps = nc._ps
    with pytest.raises(JetStreamUnavailableError):
        await read_range(nc, "NO-SUCH-STREAM", 1, filter_subject=">", timeout_s=5)
    assert nc._ps is ps


async def test_stalled_reply_times_out(nc, unique_name) -> None:
    """A responder that sends hits but never the end-of-batch status: RequestTimeoutError."""
    stream = unique_name

    async def fake(m) -> None:
        hdrs = {"Nats-Stream": stream, "Nats-Subject": "3.a", "Nats-Sequence": "1",
                "Nats-Time-Stamp": "2026-01-01T00:00:00Z", "Nats-Num-Pending": "5",
                "Nats-Last-Sequence": "0"}
        await nc.publish(m.reply, b"x", headers=hdrs)

    sub = await nc.subscribe(f"$JS.API.DIRECT.GET.{stream}", cb=fake)
    ps = nc._ps
    try:
        t = time.monotonic()
        with pytest.raises(RequestTimeoutError):
            await read_range(nc, stream, 1, filter_subject="3.>", timeout_s=0.5)
        assert 0.4 < time.monotonic() - t < 5
        assert nc._ps is ps
    finally:
        await sub.unsubscribe()


async def _streaming(conn: Client, read: asyncio.Task) -> None:
    """Wait until the first hits of the read in flight have arrived."""
    deadline = time.monotonic() + 10
    while not any(r.datas for r in rangeread._conn(conn).sinks.values()):
        assert not read.done(), "the read finished before the test could interrupt it"
        assert time.monotonic() < deadline
        await asyncio.sleep(0)


async def test_server_stall_and_restart_mid_read(tmp_path) -> None:
    """The server stops sending in the middle of a range (SIGSTOP): RequestTimeoutError; it dies
    in the middle of one (SIGKILL): JetStreamUnavailableError at once; never a short batch. The
    client's parser is back after each, and reads work again after the restart."""
    srv = NatsServer(tmp_path / "store", port=0).start()
    try:
        conn = await nats.connect(srv.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        api = JetStreamAPI(conn, timeout=10)
        wq = await make_work_queue(api, conn, "RS", 20_000)
        ps = conn._ps
        pid = srv.pid
        assert pid is not None

        read = asyncio.create_task(read_range(conn, wq, 1, filter_subject=">",
                                              max_msgs=20_000, timeout_s=1.0))
        await _streaming(conn, read)
        os.kill(pid, signal.SIGSTOP)
        try:
            t = time.monotonic()
            with pytest.raises(RequestTimeoutError):
                await read
            assert time.monotonic() - t < 5
        finally:
            os.kill(pid, signal.SIGCONT)
        assert conn._ps is ps

        read = asyncio.create_task(read_range(conn, wq, 1, filter_subject=">",
                                              max_msgs=20_000, timeout_s=30))
        await _streaming(conn, read)
        os.kill(pid, signal.SIGKILL)
        t = time.monotonic()
        with pytest.raises(JetStreamUnavailableError, match="connection"):
            await read
        assert time.monotonic() - t < 5  # the lost connection ends it, not the timeout
        assert conn._ps is ps

        srv.stop()
        srv.start()
        deadline = time.monotonic() + 20
        while not conn.is_connected:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        b = await read_range(conn, wq, 1, filter_subject="0.>", prefix="0.", timeout_s=10)
        assert b.ended and len(b) > 0
        assert conn._ps is ps
        await api.close()

        # The connection is closed by its owner in the middle of a read.
        read = asyncio.create_task(read_range(conn, wq, 1, filter_subject=">",
                                              max_msgs=20_000, timeout_s=30))
        await _streaming(conn, read)
        await conn.close()
        t = time.monotonic()
        with pytest.raises(nats.errors.ConnectionClosedError):
            await read
        assert time.monotonic() - t < 5
    finally:
        srv.stop()
