"""The bulk range-read parser (cg_pipelines.jetstream.rangeread) on byte strings.

The frame cutter must keep exactly the frames of the range-read inboxes and hand everything else
to nats-py's own parser, unchanged and in order, however the bytes are split into reads; the
header parser must give, for every hit, what nats-py's parser plus ``StoredMessage`` would
(sequence, subject, time, headers without the direct-get ones, payload).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pyarrow as pa
import pytest
from nats.aio.client import Client
from nats.errors import ProtocolError
from nats.protocol.parser import AWAITING_CONTROL_LINE, AWAITING_MSG_PAYLOAD, Parser

from cg_pipelines.jetstream.api import DIRECT_GET_HEADERS, parse_rfc3339_ns
from cg_pipelines.jetstream.errors import JetStreamError
from cg_pipelines.jetstream.rangeread import (
    FrameCutter,
    GenericReply,
    Reply,
    _Conn,
    _RangeParser,
    parse_status,
    reply_columns,
)

SID = b"7"
INBOX = b"_INBOX.abcdef.1"
SOURCE = ("O {n} flights.*.* {{{{Partition(8,1,2)}}}}.flights.{{{{Wildcard(1)}}}}"
          ".{{{{Wildcard(2)}}}} flights.AA.N1 ident1")


def dg_header(seq: int, subject: str, user: bytes = b"", *, stream: str = "O-g",
              stamp: str = "2026-11-23T11:45:30.797419678Z", pending: int = 0) -> bytes:
    """A direct-get reply header block as nats-server 2.15 writes it."""
    return (b"NATS/1.0\r\n" + user
            + f"Nats-Stream: {stream}\r\nNats-Subject: {subject}\r\nNats-Sequence: {seq}\r\n"
              f"Nats-Time-Stamp: {stamp}\r\nNats-Num-Pending: {pending}\r\n"
              f"Nats-Last-Sequence: {max(seq - 1, 0)}\r\n\r\n".encode())


def hmsg(subject: bytes, sid: bytes, header: bytes, payload: bytes,
         reply: bytes | None = None) -> bytes:
    r = reply + b" " if reply else b""
    return (b"HMSG %s %s %s%d %d\r\n" % (subject, sid, r, len(header), len(header) + len(payload))
            + header + payload + b"\r\n")


def msg(subject: bytes, sid: bytes, payload: bytes, reply: bytes | None = None) -> bytes:
    r = reply + b" " if reply else b""
    return b"MSG %s %s %s%d\r\n" % (subject, sid, r, len(payload)) + payload + b"\r\n"


def source_header(n: int) -> bytes:
    return f"Nats-Stream-Source: {SOURCE.format(n=n)}\r\n".encode()


EOB = hmsg(INBOX, SID, b"NATS/1.0 204 EOB\r\nNats-Num-Pending: 0\r\nNats-Last-Sequence: 3\r\n\r\n",
           b"")

# (name, bytes, is it one of the range-read frames)
PIECES: list[tuple[str, bytes, bool]] = [
    ("info", b'INFO {"server_id":"x","max_payload":1048576}\r\n', False),
    ("hit 1", hmsg(INBOX, SID, dg_header(1, "3.flights.AA.N1", source_header(11)),
                   b'{"a":1}'), True),
    ("ping", b"PING\r\n", False),
    ("other sub MSG", msg(b"foo.bar", b"3", b"hello\r\nHMSG x 7 1 2\r\n"), False),
    ("hit 2, binary payload", hmsg(INBOX, SID, dg_header(2, "3.flights.UA.N9", source_header(12)),
                                   b"bin\r\nHMSG _INBOX.abcdef.1 7 10 20\r\n\x00\xff"), True),
    ("pong", b"PONG\r\n", False),
    ("other sub HMSG with reply", hmsg(b"foo.baz", b"4", b"NATS/1.0\r\nX: y\r\n\r\n", b"pl",
                                       reply=b"_INBOX.r.2"), False),
    ("+OK", b"+OK\r\n", False),
    ("hit 3, empty payload, user headers",
     hmsg(INBOX, SID, dg_header(3, "3.flights.DL.N1", b"X-User: v 1\r\ntraceparent: 00-ab\r\n"
                                + source_header(13)), b""), True),
    ("-ERR", b"-ERR 'Permissions Violation for Subscription to \"x\"'\r\n", False),
    ("EOB", EOB, True),
]
WIRE = b"".join(p for _, p, _ in PIECES)
OTHERS = b"".join(p for _, p, mine in PIECES if not mine)


class FakeNC:
    """Records what nats-py's parser dispatches."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.stats = {"in_msgs": 0, "in_bytes": 0}

    async def _process_msg(self, sid, subject, reply, data, headers) -> None:
        self.events.append(("msg", sid, subject, reply, data, headers))

    async def _process_ping(self) -> None:
        self.events.append(("ping",))

    async def _process_pong(self) -> None:
        self.events.append(("pong",))

    async def _process_info(self, info) -> None:
        self.events.append(("info", info))

    async def _process_err(self, err) -> None:
        self.events.append(("err", err))


def nats_py_events(data: bytes) -> list[tuple]:
    nc = FakeNC()
    asyncio.run(Parser(nc).parse(data))
    return nc.events


def cut(chunks: list[bytes], sinks: dict[bytes, Reply]) -> tuple[FrameCutter, list[bytes]]:
    cutter = FrameCutter()
    spans: list[bytes] = []
    for c in chunks:
        spans.extend(cutter.feed(c, sinks))
    return cutter, spans


def splits(data: bytes) -> list[list[bytes]]:
    """The data in two reads at every offset, in three reads at a few, and byte by byte."""
    out = [[data[:i], data[i:]] for i in range(len(data) + 1)]
    out += [[data[:i], data[i:j], data[j:]] for i in range(0, len(data), 37)
            for j in range(i, len(data), 53)]
    out.append([data[i:i + 1] for i in range(len(data))])
    return out


# ------------------------------------------------------------------------------- the cutter


def test_whole_wire_at_once() -> None:
    r = Reply()
    cutter, spans = cut([WIRE], {SID: r})
    assert cutter.pending == 0
    assert b"".join(spans) == OTHERS
    assert len(r.datas) == 3
    assert r.datas == [b'{"a":1}', b"bin\r\nHMSG _INBOX.abcdef.1 7 10 20\r\n\x00\xff", b""]
    assert all(u.startswith(b"NATS/1.0\r\n") for u in r.users)
    assert r.users[2] == b"NATS/1.0\r\nX-User: v 1\r\ntraceparent: 00-ab\r\n" + source_header(13)
    assert all(s.startswith(b"Nats-Stream: O-g\r\n") and s.endswith(b"\r\n\r\n")
               for s in r.servers)
    assert r.status == 204 and r.description == "EOB"
    assert r.status_headers == {"Nats-Num-Pending": "0", "Nats-Last-Sequence": "3"}
    assert r.ended and r.error is None


def test_split_reads_give_the_same_frames() -> None:
    """The wire read in two pieces at every byte offset, in three at a sample of offsets,
    and byte by byte: the same frames each time (one test, one case per split)."""
    whole = Reply()
    cut([WIRE], {SID: whole})
    expected_events = nats_py_events(OTHERS)
    for chunks in splits(WIRE):
        where = "/".join(str(len(x)) for x in chunks)
        _check_split(chunks, whole, expected_events, where)


def _check_split(chunks: list[bytes], whole: Reply, expected_events: object, where: str
                 ) -> None:
    r = Reply()
    cutter, spans = cut(chunks, {SID: r})
    assert cutter.pending == 0, where
    assert (r.users, r.servers, r.datas) == (whole.users, whole.servers, whole.datas), where
    assert r.status == 204
    # Pass-through bytes: unchanged, in order, and whole protocol units (nats-py's parser
    # dispatches exactly what it would for the other frames read in one go).
    assert b"".join(spans) == OTHERS
    nc = FakeNC()
    p = Parser(nc)

    async def feed() -> None:
        for s in spans:
            await p.parse(s)
            assert not p.buf and p.state == AWAITING_CONTROL_LINE  # nothing half-parsed
    asyncio.run(feed())
    assert nc.events == expected_events, where


def test_without_sinks_everything_passes_through() -> None:
    for chunks in splits(WIRE)[::7]:
        _, spans = cut(chunks, {})
        assert b"".join(spans) == WIRE


def test_frames_of_several_inboxes() -> None:
    a, b = Reply(), Reply()
    wire = (hmsg(b"_INBOX.a", b"1", dg_header(5, "1.x"), b"A")
            + hmsg(b"_INBOX.b", b"2", dg_header(9, "2.y"), b"B")
            + hmsg(b"_INBOX.a", b"1", dg_header(6, "1.z"), b"AA"))
    _, spans = cut([wire], {b"1": a, b"2": b})
    assert spans == []
    assert a.datas == [b"A", b"AA"] and b.datas == [b"B"]


def test_status_frames() -> None:
    for block, code, desc in [
        (b"NATS/1.0 404 Message Not Found\r\n\r\n", 404, "Message Not Found"),
        (b"NATS/1.0 408 Bad Request\r\n\r\n", 408, "Bad Request"),
        (b"NATS/1.0 503\r\n\r\n", 503, ""),
        (b"NATS/1.0 204 EOB\r\nNats-Num-Pending: 5\r\nNats-Last-Sequence: 9\r\n\r\n", 204, "EOB"),
    ]:
        r = Reply()
        cut([hmsg(INBOX, SID, block, b"")], {SID: r})
        assert (r.status, r.description) == (code, desc)
        assert parse_status(block)[:2] == (code, desc)
    assert parse_status(b"NATS/1.0 204 EOB\r\nNats-Num-Pending: 5\r\n\r\n")[2] == {
        "Nats-Num-Pending": "5"}


def test_message_without_headers_or_with_reply_on_an_inbox_is_an_error() -> None:
    r = Reply()
    cut([msg(INBOX, SID, b"plain")], {SID: r})
    assert r.ended and isinstance(r.error, JetStreamError)
    assert "without headers" in r.error.description
    r = Reply()
    cut([hmsg(INBOX, SID, dg_header(1, "3.a"), b"x", reply=b"r.1")], {SID: r})
    assert r.ended and "reply subject" in r.error.description


def test_generic_collector_gets_every_frame() -> None:
    got: list[tuple] = []

    class Collect(GenericReply):
        __slots__ = ()

        def on_frame(self, parts, header, payload) -> None:
            got.append((parts, header, payload))

    wire = (hmsg(b"3.flights.AA.N1", SID, b"NATS/1.0\r\nA: b\r\n\r\n", b"p1",
                 reply=b"$JS.ACK.S.c.1.5.1.1700000000000000000.0")
            + msg(b"3.x", SID, b"p2") + hmsg(INBOX, SID, b"NATS/1.0 404 No Messages\r\n\r\n", b""))
    cut([wire[:17], wire[17:]], {SID: Collect()})
    assert [g[2] for g in got] == [b"p1", b"p2", b""]
    assert got[0][0][3] == b"$JS.ACK.S.c.1.5.1.1700000000000000000.0"
    assert got[1][1] is None
    assert got[2][1] == b"NATS/1.0 404 No Messages\r\n\r\n"


def test_malformed_control_line_goes_to_nats_py() -> None:
    r = Reply()
    good = hmsg(INBOX, SID, dg_header(1, "3.a"), b"x")
    bad = b"HMSG _INBOX.abcdef.1 7 notanumber 12\r\nrest"
    _, spans = cut([good + bad + b"PING\r\n"], {SID: r})
    assert r.datas == [b"x"]
    assert b"".join(spans) == bad + b"PING\r\n"
    with pytest.raises(ProtocolError):
        asyncio.run(Parser(FakeNC()).parse(b"".join(spans)))


def test_a_large_frame_is_collected_not_rejoined() -> None:
    payload = bytes(range(256)) * 4096  # 1 MiB, with \r\n and every byte value inside
    frame = hmsg(INBOX, SID, dg_header(1, "3.big"), payload)
    r = Reply()
    cutter = FrameCutter()
    step = 1000
    for i in range(0, len(frame) - step, step):
        assert cutter.feed(frame[i:i + step], {SID: r}) == []
        if i > 200:  # once the control line is known, reads are only collected
            assert cutter._need == len(frame) and len(cutter._chunks) >= 1
    cutter.feed(frame[(len(frame) - 1) // step * step:], {SID: r})
    assert r.datas == [payload] and cutter.pending == 0


def test_leftover_and_push_front() -> None:
    cutter = FrameCutter()
    frame = hmsg(INBOX, SID, dg_header(1, "3.a"), b"x")
    assert cutter.feed(frame[:30], {SID: Reply()}) == []
    assert cutter.pending == 30
    left = cutter.take_leftover()
    assert left == frame[:30] and cutter.pending == 0
    r = Reply()
    cutter.push_front(left)
    assert cutter.feed(frame[30:], {SID: r}) == [] and r.datas == [b"x"]


# ---------------------------------------------------------------------- the header parser


def expected_row(header: bytes, payload: bytes, drop_nats: bool) -> dict:
    """What nats-py's parser and StoredMessage make of a hit (the reference)."""
    hdrs = asyncio.run(Client()._process_headers(header))
    user = {k: v for k, v in hdrs.items() if k not in DIRECT_GET_HEADERS}
    if drop_nats:
        user = {k: v for k, v in user.items() if not k.startswith("Nats-")}
    src = hdrs.get("Nats-Stream-Source")
    origin = None
    if src is not None and len(src.split(" ")) > 1 and src.split(" ")[1].isdigit():
        origin = int(src.split(" ")[1])
    return {
        "seq": int(hdrs["Nats-Sequence"]),
        "subject": hdrs["Nats-Subject"],
        "time": parse_rfc3339_ns(hdrs["Nats-Time-Stamp"]),
        "headers": json.dumps(user) if user else None,
        "origin_seq": origin,
        "data": payload,
        "pending": int(hdrs["Nats-Num-Pending"]),
    }


USER_BLOCKS: list[bytes] = [
    b"",
    source_header(42),
    b"X-User: v 1\r\n" + source_header(43),
    source_header(44) + b"Nats-Msg-Id: m-1\r\n",
    b'Quote: say "hi" \\ back\r\n' + source_header(45),
    b'Nats-Stream-Source: O 46 "quoted" \\ x\r\n',
    "Unicode: café ☕\r\n".encode() + source_header(47),
    b"Bad-Utf8: \xff\xfe\r\n",
    b"Tab:\tvalue\t\r\n",
    b"Dup: one\r\nOther: x\r\nDup: two\r\n",
    b"Bad Name: skipped\r\nGood: kept\r\n",
    b"No-Colon-Line\r\nX: y\r\n",
    b"Empty:\r\n",
    b"Spaces:    padded value   \r\n",
    b"Nats-Subject: user-set\r\nX: 1\r\n",  # a user header with a direct-get name is dropped
    b"Nats-Stream-Source:   O 48 a b c\r\n",
    b"Nats-Stream-Source: O notanumber a b c\r\n",
    b"Nats-Stream-Source: O\r\n",
    b"Nats-Stream-Source: O 49\r\n",
    b"OnlyUser: x\r\n",
]


def frames_for(users: list[bytes], *, subject: str = "3.flights.AA.N1",
               stamps: list[str] | None = None) -> tuple[list[bytes], list[tuple[bytes, bytes]]]:
    rows = []
    for i, u in enumerate(users):
        stamp = stamps[i] if stamps else f"2026-11-23T11:45:30.{i:09d}Z"
        payload = b"p%d\r\n\x00" % i if i % 3 else b""
        rows.append((dg_header(100 + i, subject, u, stamp=stamp, pending=len(users) - i - 1),
                     payload))
    wire = b"".join(hmsg(INBOX, SID, h, p) for h, p in rows)
    return [wire], rows


def columns_of(r: Reply, **kw) -> list[dict]:
    cols = reply_columns(r.users, r.servers, r.datas, **kw)
    t = pa.table({
        "seq": cols.seq, "subject": cols.subject, "time": cols.time.cast(pa.int64()),
        "headers": cols.headers, "origin_seq": cols.origin_seq, "data": cols.data,
        "pending": cols.pending,
    })
    return t.to_pylist()


@pytest.mark.parametrize("drop_nats", [False, True])
def test_header_parser_matches_nats_py(drop_nats: bool) -> None:
    chunks, rows = frames_for(USER_BLOCKS)
    r = Reply()
    cut(chunks, {SID: r})
    got = columns_of(r, drop_nats_headers=drop_nats)
    want = [expected_row(h, p, drop_nats) for h, p in rows]
    assert got == want


@pytest.mark.parametrize("block", USER_BLOCKS)
@pytest.mark.parametrize("drop_nats", [False, True])
def test_header_parser_one_block(block: bytes, drop_nats: bool) -> None:
    """Each block alone (the bulk path and the per-row path take different batches)."""
    chunks, rows = frames_for([block, source_header(1)])
    r = Reply()
    cut(chunks, {SID: r})
    assert columns_of(r, drop_nats_headers=drop_nats) == [
        expected_row(h, p, drop_nats) for h, p in rows]


def test_sourced_fast_path_json() -> None:
    chunks, _ = frames_for([source_header(7)])
    r = Reply()
    cut(chunks, {SID: r})
    row = columns_of(r)[0]
    assert json.loads(row["headers"]) == {"Nats-Stream-Source": SOURCE.format(n=7)}
    assert row["headers"] == json.dumps({"Nats-Stream-Source": SOURCE.format(n=7)})
    assert row["origin_seq"] == 7
    assert columns_of(r, drop_nats_headers=True)[0]["headers"] is None


def test_time_stamps() -> None:
    stamps = ["2026-11-23T11:45:30Z", "2026-11-23T11:45:30.5Z", "2026-11-23T11:45:30.123456789Z",
              "2026-11-23T11:45:30.12345678Z", "1970-01-01T00:00:00Z",
              "2024-01-01T01:00:00+01:00"]
    chunks, rows = frames_for([b""] * len(stamps), stamps=stamps)
    r = Reply()
    cut(chunks, {SID: r})
    assert [row["time"] for row in columns_of(r)] == [parse_rfc3339_ns(s) for s in stamps]


def test_server_headers_in_another_order_take_the_slow_path() -> None:
    header = (b"NATS/1.0\r\nX: 1\r\nNats-Stream: O-g\r\nNats-Sequence: 5\r\n"
              b"Nats-Subject: 3.a.b\r\nNats-Time-Stamp: 2026-11-23T11:45:30.1Z\r\n"
              b"Nats-Num-Pending: 2\r\nNats-Last-Sequence: 4\r\n\r\n")
    r = Reply()
    cut([hmsg(INBOX, SID, header, b"d") + hmsg(INBOX, SID, dg_header(6, "3.c"), b"e")],
        {SID: r})
    got = columns_of(r)
    assert got[0] == expected_row(header, b"d", False)
    assert got[1]["seq"] == 6 and got[1]["subject"] == "3.c"


def test_hit_without_direct_get_headers_raises() -> None:
    r = Reply()
    cut([hmsg(INBOX, SID, b"NATS/1.0\r\nX: 1\r\n\r\n", b"d")], {SID: r})
    with pytest.raises(JetStreamError, match="Nats-Sequence"):
        reply_columns(r.users, r.servers, r.datas)


def test_prefix_strips_and_drops() -> None:
    wire = b"".join(hmsg(INBOX, SID, dg_header(i, s), b"%d" % i)
                    for i, s in enumerate(["3.a", "31.b", "3.c.d", "0.e", "3.f"], start=1))
    r = Reply()
    cut([wire], {SID: r})
    cols = reply_columns(r.users, r.servers, r.datas, prefix="3.")
    assert cols.seq.to_pylist() == [1, 3, 5]
    assert cols.subject.to_pylist() == ["a", "c.d", "f"]
    assert cols.data.to_pylist() == [b"1", b"3", b"5"]


# ------------------------------------------------------------- swapping the client's parser


class FakeClient(FakeNC):
    def __init__(self) -> None:
        super().__init__()
        self._ps = Parser(self)


def test_parser_takes_over_a_half_read_frame_and_hands_one_back() -> None:
    async def run() -> None:
        nc = FakeClient()
        prev = nc._ps
        other = hmsg(b"foo", b"3", b"NATS/1.0\r\nA: b\r\n\r\n", b"payload-1")
        mine = hmsg(INBOX, SID, dg_header(1, "3.a"), b"x")
        # nats-py's parser has read the control line and part of a message ...
        await prev.parse(other[:30])
        assert prev.state == AWAITING_MSG_PAYLOAD
        conn = _Conn()
        r = Reply()
        conn.sinks[SID] = r
        conn.enter(nc)
        assert isinstance(nc._ps, _RangeParser)
        # ... the range parser finishes it (nats-py dispatches it) and takes a hit.
        await nc._ps.parse(other[30:] + mine + b"PING\r\n" + other[:25])
        assert r.datas == [b"x"]
        assert [e[0] for e in nc.events] == ["msg", "ping"]
        assert nc.events[0][4] == b"payload-1"
        # Put back with half a frame held: nats-py's parser completes it.
        conn.leave()
        assert nc._ps is prev
        await nc._ps.parse(other[25:])
        assert [e[0] for e in nc.events] == ["msg", "ping", "msg"]
        assert nc.events[2][4] == b"payload-1"
        assert not prev.buf and prev.state == AWAITING_CONTROL_LINE

    asyncio.run(run())


def test_reset_fails_the_replies_in_flight() -> None:
    async def run() -> None:
        nc = FakeClient()
        conn = _Conn()
        r = Reply()
        r.done = asyncio.get_running_loop().create_future()
        conn.sinks[SID] = r
        conn.enter(nc)
        await nc._ps.parse(hmsg(INBOX, SID, dg_header(1, "3.a"), b"x")[:20])
        nc._ps.reset()  # what nats-py does on a lost connection
        assert r.done.done()
        with pytest.raises(JetStreamError, match="connection .* lost"):
            r.done.result()
        assert nc._ps.cutter.pending == 0
        conn.leave()

    asyncio.run(run())


def test_importing_the_module_patches_nothing() -> None:
    code = (
        "import nats.aio.client as c, nats.protocol.parser as p\n"
        "before = (dict(vars(c.Client)), dict(vars(p.Parser)), dict(vars(p)), dict(vars(c)))\n"
        "import cg_pipelines.jetstream.rangeread\n"
        "after = (dict(vars(c.Client)), dict(vars(p.Parser)), dict(vars(p)), dict(vars(c)))\n"
        "assert before == after, 'nats-py changed'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
