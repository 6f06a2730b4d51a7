"""Fast range reads of a stream (batched direct get) parsed in bulk into Arrow columns.

An elastic group's batch run reads one partition's range of the work-queue stream
``<stream>-<group>`` (subjects ``<p>.<origin subject>``) without consuming it (DESIGN §5,
step 2). A consumer cannot do that (the partition's lease consumer already holds the filter
``<p>.>`` and a work-queue stream refuses overlapping consumers), so the range is read with
batched direct gets: ``$JS.API.DIRECT.GET.<stream>`` with ``{"seq", "next_by_subj", "batch",
"max_bytes"}``. :func:`read_range` does that and returns a :class:`RangeBatch` of Arrow arrays,
without a nats-py ``Msg``, a dict or a dataclass per message on the way.

Wire format (nats-server 2.15.1, checked): each hit is an ``HMSG`` to the request's reply inbox
whose header block is the stored message's own headers followed by the direct-get ones the
server appends, in this order::

    NATS/1.0\\r\\n
    <the message's own headers, e.g. Nats-Stream-Source: ORIGIN 17 flt dest subj ident>\\r\\n
    Nats-Stream: <stream>\\r\\n
    Nats-Subject: <subject>\\r\\n
    Nats-Sequence: <seq>\\r\\n
    Nats-Time-Stamp: <RFC 3339, nanoseconds, UTC>\\r\\n
    Nats-Num-Pending: <matching messages after this one, at request time>\\r\\n
    Nats-Last-Sequence: <the previous hit's sequence, 0 for the first>\\r\\n
    \\r\\n

and the reply ends with a status frame ``NATS/1.0 204 EOB`` (``Nats-Num-Pending``,
``Nats-Last-Sequence`` headers), or ``NATS/1.0 404 Message Not Found`` alone when nothing at or
after ``seq`` matches; a sourced message's ``Nats-Stream-Source`` value is ``<origin stream>
<origin seq> <source filter> <transform destination> <origin subject>[ <ident>]``.

How it is fast: while at least one range read is in flight on a connection, that connection's
protocol parser (``nc._ps``, nats-py 2.16) is replaced *on that client instance only* by
:class:`_RangeParser`. Its :class:`FrameCutter` cuts complete frames out of each socket read
with ``bytes.find`` and slicing (offsets into one buffer per read, never a delete from the front
of a buffer), keeps the frames of the range-read reply inboxes (three byte strings per hit: the
message's own header lines, the direct-get header lines, the payload) and hands every other
frame, unchanged and in order, to nats-py's own parser (subscriptions, requests, PING/PONG, INFO,
-ERR behave as before). Partial frames and parser state are carried over both ways when the
parser is installed and put back, and it is put back as soon as no range read is in flight.
Every :data:`COLUMNIZE_EVERY` hits, while the rest of the reply is still arriving, the waiting
task turns the collected hits into Arrow arrays in bulk (``split_pattern`` and casts for the
direct-get headers, a vectorised check for the common own-headers block ``Nats-Stream-Source:
...``; only other own headers take nats-py's header parser, message by message), so the client's
parsing overlaps the server's sending. Importing this module changes nothing: no nats-py class
or module is patched. With another nats-py version (or a parser this module does not know on the
client) :func:`read_range` falls back to :meth:`JetStreamAPI.direct_get_batch` and builds the
same arrays.

Choosing the read (``bench/range_read.py``, nats-server 2.15.1 on the same 2-core machine,
200,000 sourced messages, 8 partitions): one request per range (``batch`` = the range size,
20,000) beats chunks of 2,000 sent one after another (each request costs the server a fixed
setup, and the server idles during the round trips) and chunks pipelined by sequence windows (no
faster, and a batched direct get has no upper sequence bound, so windows over-read on sparse
partitions). Filter on the server (``next_by_subj="<p>.>"``): an unfiltered read (``">"``)
sends every partition's messages and costs the server and the client per *sent* message, so it
only pays (by a few per cent) when the partition holds nearly all (>~90 %) of the range. The
server's own cost dominates: about 10-15 µs of server CPU per sourced message (its direct-get
header generation for messages that carry headers), against about 4-5 µs of client CPU here.

Errors: a request without an answer, or whose reply stalls before its end-of-batch status, for
``timeout_s`` seconds raises :class:`RequestTimeoutError`; no responders (stream missing or
``allow_direct`` off) and a connection lost during a read raise
:class:`JetStreamUnavailableError`; a connection closed by its owner raises nats-py's
``ConnectionClosedError``; other statuses raise :func:`error_from_status`'s typed error. A
range is never truncated silently: either it ends at one of the limits documented on
:func:`read_range`, or the call raises.
"""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import nats.errors
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from nats.aio import client as nats_client
from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.protocol.parser import AWAITING_CONTROL_LINE, AWAITING_MSG_PAYLOAD, Parser

from cg_pipelines.jetstream.api import (
    DEFAULT_PREFIX,
    DIRECT_GET_HEADERS,
    JetStreamAPI,
    StoredMessage,
    parse_rfc3339_ns,
)
from cg_pipelines.jetstream.errors import (
    JetStreamError,
    JetStreamUnavailableError,
    RequestTimeoutError,
    error_from_status,
)

__all__ = [
    "MAX_REQUEST_BYTES",
    "RANGE_SCHEMA",
    "FrameCutter",
    "GenericReply",
    "RangeBatch",
    "Reply",
    "direct_get_reply",
    "fast_path_available",
    "parse_status",
    "read_range",
    "reply_columns",
]

#: nats-py versions whose parser and read loop this module was written against.
SUPPORTED_NATS_PY = "2.16."

#: Arrow schema of :meth:`RangeBatch.table`: the engine's record schema plus ``origin_seq``.
RANGE_SCHEMA = pa.schema(
    [
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("subject", pa.string(), nullable=False),
        pa.field("time", pa.timestamp("ns", tz="UTC"), nullable=False),
        pa.field("headers", pa.string()),
        pa.field("data", pa.binary(), nullable=False),
        pa.field("origin_seq", pa.int64()),
    ]
)

#: Most bytes one direct-get request asks for. The server queues a whole reply for the client
#: and cuts off a client whose pending output passes its ``max_pending`` (64 MiB by default),
#: so a request (and everything in flight on one connection) must stay well below that.
MAX_REQUEST_BYTES = 16 * 1024 * 1024

#: A reply's frames are turned into Arrow columns every this many messages while the rest is
#: still arriving, so that the client's parsing overlaps the server's sending.
COLUMNIZE_EVERY = 4096

_MAX_IDLE_INBOXES = 8
_BIG = 1 << 30
_CRLF = b"\r\n"
_HDR_LINE = b"NATS/1.0\r\n"
_STATUS_LINE = b"NATS/1.0 "
_SERVER_BLOCK = b"\r\nNats-Stream: "
_STREAM_SOURCE = "Nats-Stream-Source"
_SOURCE_LINE = "Nats-Stream-Source: "
# The direct-get header lines, in the order the server appends them, and the value offsets.
_SERVER_LINES = (
    "Nats-Stream: ", "Nats-Subject: ", "Nats-Sequence: ", "Nats-Time-Stamp: ",
    "Nats-Num-Pending: ", "Nats-Last-Sequence: ",
)
_ORIGIN_RE = r"\ANats-Stream-Source: [^ ]+ (?P<o>[0-9]{1,18})(?: |\z)"
_JSON_SAFE_RE = r"\A[ !#-\[\]-~]*\z"  # printable ASCII without '"' and '\\'

_parse_header_lines = Client._parse_header_lines


def fast_path_available(nc: Client) -> bool:
    """Whether :func:`read_range` can use the bulk parser on ``nc``: nats-py 2.16.x, and the
    client's parser is nats-py's own (or this module's)."""
    if not str(getattr(nats_client, "__version__", "")).startswith(SUPPORTED_NATS_PY):
        return False
    ps = getattr(nc, "_ps", None)
    return type(ps) is Parser or isinstance(ps, _RangeParser)


# --------------------------------------------------------------------------------------------
# Frame cutting (pure, synchronous)
# --------------------------------------------------------------------------------------------


def parse_status(block: bytes) -> tuple[int, str, dict[str, str]]:
    """Parse a status header block ``NATS/1.0 204 EOB\\r\\nName: value\\r\\n\\r\\n``.

    Returns ``(code, description, headers)``; ``code`` is 0 when the status is not a number.
    """
    line, _, rest = block.partition(_CRLF)
    code_b, _, desc_b = line[len(_STATUS_LINE):].strip().partition(b" ")
    code = int(code_b) if code_b.isdigit() else 0
    return code, desc_b.strip().decode("utf-8", "replace"), _parse_header_lines(rest)


class Reply:
    """The frames of one direct-get reply (one reply inbox), collected by :class:`FrameCutter`.

    For the i-th hit, ``users[i]`` is the header block from ``NATS/1.0\\r\\n`` up to the
    direct-get headers (the message's own headers), ``servers[i]`` the direct-get header lines
    (``Nats-Stream: ...`` to the blank line) and ``datas[i]`` the payload. A status frame ends
    the reply (``status``, ``description``, ``status_headers``) and resolves :attr:`done`; so
    does a frame that is no direct-get reply (``error``). :attr:`progress` resolves once
    ``flush_at`` hits are waiting (0: never).
    """

    __slots__ = (
        "users", "servers", "datas", "status", "description", "status_headers", "error",
        "done", "progress", "flush_at",
    )
    generic = False  # True: every frame goes to on_frame (see GenericReply)

    def __init__(self) -> None:
        self.users: list[bytes] = []
        self.servers: list[bytes] = []
        self.datas: list[bytes] = []
        self.status: int | None = None
        self.description = ""
        self.status_headers: dict[str, str] = {}
        self.error: JetStreamError | None = None
        self.done: asyncio.Future[None] | None = None
        self.progress: asyncio.Future[None] | None = None
        self.flush_at = 0

    @property
    def ended(self) -> bool:
        """True once a status frame (or an unexpected frame) ended the reply."""
        return self.status is not None or self.error is not None

    def take(self) -> tuple[list[bytes], list[bytes], list[bytes]]:
        """The hits collected so far (removed from the reply)."""
        out = (self.users, self.servers, self.datas)
        self.users, self.servers, self.datas = [], [], []
        return out

    def on_status(self, block: bytes) -> None:
        if self.ended:
            return
        try:
            self.status, self.description, self.status_headers = parse_status(block)
        except Exception:  # noqa: BLE001 - never let the client's read loop die
            self.on_bad_frame(f"unreadable status {block[:100]!r}")
            return
        self._resolve()

    def on_bad_frame(self, what: str) -> None:
        if self.ended:
            return
        self.error = JetStreamError(0, 0, f"unexpected frame on a direct-get reply inbox: {what}")
        self._resolve()

    def on_frame(self, parts: list[bytes], header: bytes | None, payload: bytes) -> None:
        """Every frame of a :attr:`generic` collector: control line tokens, header block (or
        ``None`` for ``MSG``) and payload."""

    def check_flush(self) -> None:
        p = self.progress
        if self.flush_at and len(self.datas) >= self.flush_at and p is not None and not p.done():
            p.set_result(None)

    def fail(self, exc: BaseException) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(exc)

    def _resolve(self) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(None)


class GenericReply(Reply):
    """A collector that gets every frame through :meth:`on_frame` (consumer deliveries and
    other non-direct-get replies; the benchmark's pull-consumer reference uses it)."""

    __slots__ = ()
    generic = True


class FrameCutter:
    """Cuts NATS protocol frames out of a byte stream, in bulk.

    :meth:`feed` takes the next bytes read from the socket and a map of subscription ids
    (``b"12"``) to :class:`Reply` collectors: every complete ``HMSG``/``MSG`` frame for one of
    those sids goes to its collector; everything else (other subscriptions' messages, PING, PONG,
    INFO, +OK, -ERR, anything unknown or malformed) is returned as byte strings of whole protocol
    units, in stream order, for nats-py's parser. An incomplete frame at the end is held back for
    the next call; once its length is known, later chunks are only collected until it is
    complete (a large message is not copied over and over). Work per call is linear in the bytes
    fed: frames are cut by offsets into one buffer, never deleted from its front.
    """

    __slots__ = ("_chunks", "_have", "_need")

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._have = 0
        self._need = 0

    @property
    def pending(self) -> int:
        """Bytes held back (the start of an incomplete frame)."""
        return self._have

    def take_leftover(self) -> bytes:
        """The held-back bytes, removed from the cutter."""
        out = b"".join(self._chunks)
        self.clear()
        return out

    def push_front(self, data: bytes) -> None:
        """Put ``data`` in front of the held-back bytes (state taken over from another parser)."""
        if data:
            self._chunks.insert(0, bytes(data))
            self._have += len(data)
            self._need = 0

    def clear(self) -> None:
        self._chunks = []
        self._have = 0
        self._need = 0

    def feed(self, data: bytes, sinks: Mapping[bytes, Reply]) -> list[bytes]:
        """Cut the complete frames of held-back bytes + ``data``; see the class docstring."""
        if self._chunks:
            self._chunks.append(data)
            self._have += len(data)
            if self._have < self._need:
                return []
            data = b"".join(self._chunks)
            self._chunks = []
        n = len(data)
        pos = 0
        run = -1  # start of the current run of pass-through bytes
        need = 0
        out: list[bytes] = []
        find = data.find
        rfind = data.rfind
        startswith = data.startswith
        get = sinks.get
        cur: Reply | None = None
        generic = False
        ua = sa = da = out.append  # rebound for each collector
        try:
            while pos < n:
                e = find(_CRLF, pos)
                if e < 0:
                    break
                parts = data[pos:e].split()
                if len(parts) == 5 and parts[0] == b"HMSG":
                    # HMSG <subject> <sid> <header len> <total len>: the hot path.
                    hlen = int(parts[3])
                    tlen = int(parts[4])
                    h0 = e + 2
                    end = h0 + tlen
                    if end + 2 > n:
                        need = end + 2 - pos
                        break
                    r = get(parts[2])
                    if r is None or hlen > tlen:
                        if run < 0:
                            run = pos
                        pos = end + 2
                        continue
                    if run >= 0:
                        out.append(data[run:pos])
                        run = -1
                    pos = end + 2
                    if r is not cur:
                        if cur is not None:
                            cur.check_flush()
                        cur = r
                        generic = r.generic
                        ua, sa, da = r.users.append, r.servers.append, r.datas.append
                    h1 = h0 + hlen
                    if generic:
                        r.on_frame(parts, data[h0:h1], data[h1:end])
                    elif hlen == tlen and startswith(_STATUS_LINE, h0):
                        r.on_status(data[h0:h1])
                    else:
                        k = rfind(_SERVER_BLOCK, h0, h1)
                        if k < 0:  # no direct-get headers: reported when columnized
                            k = h1 - 2
                        ua(data[h0:k + 2])
                        sa(data[k + 2:h1])
                        da(data[h1:end])
                    continue
                op = parts[0] if parts else b""
                if op != b"HMSG" and op != b"MSG":
                    # A one-line protocol unit (PING, PONG, +OK, -ERR, INFO, or unknown).
                    if run < 0:
                        run = pos
                    pos = e + 2
                    continue
                # MSG, or HMSG with a reply subject.
                hdr = op == b"HMSG"
                if len(parts) not in ((5, 6) if hdr else (4, 5)):
                    raise ValueError("malformed control line")
                tlen = int(parts[-1])
                hlen = int(parts[-2]) if hdr else 0
                if hlen > tlen:
                    raise ValueError("malformed control line")
                h0 = e + 2
                end = h0 + tlen
                if end + 2 > n:
                    need = end + 2 - pos
                    break
                r = get(parts[2])
                if r is None:
                    if run < 0:
                        run = pos
                    pos = end + 2
                    continue
                if run >= 0:
                    out.append(data[run:pos])
                    run = -1
                pos = end + 2
                if r.generic:
                    r.on_frame(parts, data[h0:h0 + hlen] if hdr else None, data[h0 + hlen:end])
                else:
                    r.on_bad_frame("message with a reply subject" if hdr else
                                   "message without headers")
        except ValueError:
            # A malformed control line: nats-py's parser gets everything from here on and
            # raises its ProtocolError (the client then reconnects).
            if run < 0:
                run = pos
            pos = n
        if cur is not None:
            cur.check_flush()
        if run >= 0:
            out.append(data[run:pos])
        if pos < n:
            self._chunks = [data[pos:]]
            self._have = n - pos
            self._need = need
        else:
            self._have = 0
            self._need = 0
        return out


# --------------------------------------------------------------------------------------------
# Bulk header parsing
# --------------------------------------------------------------------------------------------


@dataclass
class _Columns:
    seq: pa.Array
    subject: pa.Array
    time: pa.Array
    headers: pa.Array
    origin_seq: pa.Array
    data: pa.Array
    pending: pa.Array

    def __len__(self) -> int:
        return len(self.seq)

    def arrays(self) -> tuple[pa.Array, ...]:
        return (self.seq, self.subject, self.time, self.headers, self.origin_seq, self.data,
                self.pending)

    def filter(self, mask: pa.Array) -> _Columns:
        return _Columns(*(pc.filter(a, mask) for a in self.arrays()))

    def head(self, n: int) -> _Columns:
        return _Columns(*(a.slice(0, n) for a in self.arrays()))

    @staticmethod
    def concat(parts: list[_Columns]) -> _Columns:
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return _Columns(
                pa.array([], pa.int64()), pa.array([], pa.string()),
                pa.array([], pa.timestamp("ns", tz="UTC")), pa.array([], pa.string()),
                pa.array([], pa.int64()), pa.array([], pa.binary()), pa.array([], pa.int64()))
        return _Columns(*(pa.concat_arrays(list(a)) for a in zip(*(p.arrays() for p in parts),
                                                                   strict=True)))


def _user_dict(block: bytes, drop_nats: bool) -> dict[str, str] | None:
    hdrs = _parse_header_lines(block)
    if drop_nats:
        out = {k: v for k, v in hdrs.items() if not k.startswith("Nats-")}
    else:
        out = {k: v for k, v in hdrs.items() if k not in DIRECT_GET_HEADERS}
    return out or None


def _origin_of(hdrs: Mapping[str, str] | None) -> int | None:
    v = hdrs.get(_STREAM_SOURCE) if hdrs else None
    if v is None:
        return None
    parts = v.split(" ")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


def _header_columns(blocks: list[bytes], arr: pa.Array, drop_nats: bool
                    ) -> tuple[pa.Array, pa.Array]:
    """``headers`` (JSON object string or null) and ``origin_seq`` (int64 or null) of the
    messages' own header blocks (``arr``: the lines after ``NATS/1.0``; ``blocks``: the same as
    Python bytes, with the ``NATS/1.0`` line). Empty blocks and blocks holding only a
    ``Nats-Stream-Source`` line (every sourced message without headers of its own) are done
    with Arrow compute; any other block with nats-py's header parser, one by one."""
    n = len(arr)
    nonempty = pc.greater(pc.binary_length(arr), 0)
    if not pc.any(nonempty).as_py():
        return pa.nulls(n, pa.string()), pa.nulls(n, pa.int64())
    lines = pc.split_pattern(arr, "\r\n")
    first = pc.list_element(lines, 0)
    src_only = pc.and_(pc.equal(pc.list_value_length(lines), 2),
                       pc.starts_with(first, _SOURCE_LINE))
    origin = pc.struct_field(pc.extract_regex(first, _ORIGIN_RE), "o").cast(pa.int64())
    # The common form: one "Nats-Stream-Source: <value>" line, the value printable ASCII
    # without '"' or '\\' and not padded (nats-py strips the padding).
    value = pc.binary_slice(first, len(_SOURCE_LINE), _BIG)
    fast = pc.and_(src_only, pc.and_(
        pc.match_substring_regex(value, _JSON_SAFE_RE),
        pc.invert(pc.or_(pc.starts_with(value, " "), pc.ends_with(value, " ")))))
    if drop_nats:
        headers = pa.nulls(n, pa.string())
    else:
        js = pc.binary_join_element_wise(
            pa.scalar(b'{"Nats-Stream-Source": "'), value, pa.scalar(b'"}'), pa.scalar(b""))
        headers = pc.if_else(fast, js, pa.scalar(None, pa.binary())).cast(pa.string())
    slow = pc.and_(nonempty, pc.invert(fast))
    if pc.any(slow).as_py():
        h_list: list[str | None] = headers.to_pylist()
        o_list: list[int | None] = origin.to_pylist()
        for i in np.flatnonzero(slow.to_numpy(zero_copy_only=False)).tolist():
            block = blocks[i][len(_HDR_LINE):]
            d = _user_dict(block, drop_nats)
            h_list[i] = json.dumps(d) if d else None
            o_list[i] = _origin_of(_parse_header_lines(block))
        headers = pa.array(h_list, pa.string())
        origin = pa.array(o_list, pa.int64())
    else:
        origin = pc.if_else(fast, origin, pa.scalar(None, pa.int64()))
    return headers, origin


def _slow_server_columns(
    users: list[bytes], servers: list[bytes]
) -> tuple[pa.Array, pa.Array, pa.Array, pa.Array]:
    """Sequence, subject, time, pending row by row (nats-py's header parser)."""
    seqs: list[int] = []
    subjects: list[str] = []
    times: list[int] = []
    pendings: list[int | None] = []
    for user, server in zip(users, servers, strict=True):
        raw = user + server
        hdrs = _parse_header_lines(raw[len(_HDR_LINE):] if raw.startswith(_HDR_LINE) else raw)
        try:
            seqs.append(int(hdrs["Nats-Sequence"]))
            subjects.append(hdrs["Nats-Subject"])
            times.append(parse_rfc3339_ns(hdrs["Nats-Time-Stamp"]))
        except (KeyError, ValueError) as e:
            raise JetStreamError(
                0, 0, f"direct get reply without a valid {e} header: {raw[:300]!r}") from None
        pendings.append(_int_or_none(hdrs.get("Nats-Num-Pending")))
    return (
        pa.array(seqs, pa.int64()),
        pa.array(subjects, pa.string()),
        pa.array(times, pa.int64()).cast(pa.timestamp("ns", tz="UTC")),
        pa.array(pendings, pa.int64()),
    )


def _server_columns(srv: pa.Array) -> tuple[pa.Array, pa.Array, pa.Array, pa.Array]:
    """Sequence, subject, time, pending from the direct-get header lines, in bulk.

    Raises ValueError (or an Arrow error) when any block is not laid out as expected."""
    lines = pc.split_pattern(srv, "\r\n")
    # Six header lines, the blank line and what follows the final CRLF.
    if not pc.all(pc.equal(pc.list_value_length(lines), 8)).as_py():
        raise ValueError("direct-get headers not in the expected layout")
    cols = []
    for i, name in enumerate(_SERVER_LINES):
        line = pc.list_element(lines, i)
        if not pc.all(pc.starts_with(line, name)).as_py():
            raise ValueError(f"{name!r} not where expected")
        cols.append(pc.binary_slice(line, len(name), _BIG))
    _, subject, seq, stamp, pending, _ = cols
    return (
        seq.cast(pa.int64()),
        subject.cast(pa.string()),
        stamp.cast(pa.string()).cast(pa.timestamp("ns", tz="UTC")),
        pending.cast(pa.int64()),
    )


def reply_columns(
    users: list[bytes],
    servers: list[bytes],
    datas: list[bytes],
    *,
    prefix: str | None = None,
    drop_nats_headers: bool = False,
) -> _Columns:
    """Arrow columns of direct-get hits (the lists a :class:`Reply` collected).

    ``subject`` has ``prefix`` stripped, and rows whose subject does not start with ``prefix``
    are dropped. ``headers``: the message's own headers without the direct-get ones (without
    every ``Nats-*`` header with ``drop_nats_headers``) as ``json.dumps`` of the dict nats-py
    builds, or null when none. ``origin_seq``: the second token of ``Nats-Stream-Source``, or
    null. ``pending``: ``Nats-Num-Pending`` of each hit.

    Raises:
        JetStreamError: a hit without a valid ``Nats-Sequence``, ``Nats-Subject`` or
            ``Nats-Time-Stamp`` header.
    """
    user_arr = pa.array(users, pa.binary())
    if not pc.all(pc.starts_with(user_arr, "NATS/1.0\r\n")).as_py():
        raise JetStreamError(0, 0, "direct get reply without a NATS/1.0 header line")
    try:
        seq, subject, stamp, pending = _server_columns(pa.array(servers, pa.binary()))
    except (ValueError, pa.ArrowInvalid, pa.ArrowNotImplementedError):
        seq, subject, stamp, pending = _slow_server_columns(users, servers)
    headers, origin = _header_columns(
        users, pc.binary_slice(user_arr, len(_HDR_LINE), _BIG), drop_nats_headers)
    cols = _Columns(seq, subject, stamp, headers, origin, pa.array(datas, pa.binary()), pending)
    if prefix:
        cols = _strip_prefix(cols, prefix)
    return cols


def _strip_prefix(cols: _Columns, prefix: str) -> _Columns:
    starts = pc.starts_with(cols.subject, prefix)
    if not pc.all(starts).as_py():
        cols = cols.filter(starts)
    cols.subject = pc.utf8_slice_codeunits(cols.subject, len(prefix))
    return cols


def _int_or_none(v: str | None) -> int | None:
    return int(v) if v is not None and v.isdigit() else None


# --------------------------------------------------------------------------------------------
# The per-connection parser
# --------------------------------------------------------------------------------------------


class _RangeParser(Parser):
    """Stands in for nats-py 2.16's ``Parser`` on one client while range reads are in flight.

    Frames for the range-read inboxes (``conn.sinks``) are collected by a :class:`FrameCutter`;
    all other bytes go, as whole protocol units and in order, to the parser it replaced
    (``prev``), which dispatches them exactly as before. State is taken over from ``prev`` at
    each :meth:`parse` (a frame ``prev`` had half read is rebuilt in front of the new bytes) and
    handed back by :meth:`detach`.
    """

    def __init__(self, conn: _Conn, prev: Parser) -> None:  # no super(): reset() is ours
        self.nc = prev.nc
        self.prev = prev
        self.conn = conn
        self.cutter = FrameCutter()
        self.buf = bytearray()  # nats-py's attributes, unused here
        self.state = AWAITING_CONTROL_LINE
        self.needed = 0
        self.header_needed = 0
        self.msg_arg: dict[str, Any] = {}
        self.in_parse = 0
        self.detached = False

    def __repr__(self) -> str:
        return f"<cg_pipelines range-read parser over {self.prev!r}>"

    def reset(self) -> None:
        """Called by nats-py when the connection is lost or re-established: nothing held back
        is valid any more, and the replies in flight will never end."""
        self.cutter.clear()
        self.prev.reset()
        self.conn.fail_all("the connection to the server was lost during a range read")

    def _adopt(self) -> None:
        prev = self.prev
        head = b""
        if prev.state == AWAITING_MSG_PAYLOAD:
            a = prev.msg_arg
            reply = a.get("reply") or b""
            rtok = reply + b" " if reply else b""
            if prev.header_needed > 0:
                head = b"HMSG %s %d %s%d %d\r\n" % (
                    a["subject"], a["sid"], rtok, prev.header_needed, prev.needed)
            else:
                head = b"MSG %s %d %s%d\r\n" % (a["subject"], a["sid"], rtok, prev.needed)
        data = head + bytes(prev.buf)
        prev.reset()
        self.cutter.push_front(data)

    def handback(self) -> None:
        left = self.cutter.take_leftover()
        if left:
            self.prev.buf.extend(left)

    def detach(self) -> None:
        """Put ``prev`` back on the client, with anything held back."""
        self.detached = True
        if self.nc._ps is self:
            self.nc._ps = self.prev
        if not self.in_parse:
            self.handback()

    async def parse(self, data: bytes = b"") -> None:
        prev = self.prev
        if self.detached:  # a caller still holding this parser: stay transparent
            await prev.parse(data)
            return
        if prev.buf or prev.state != AWAITING_CONTROL_LINE:
            self._adopt()
        self.in_parse += 1
        try:
            for span in self.cutter.feed(bytes(data), self.conn.sinks):
                await prev.parse(span)
        finally:
            self.in_parse -= 1
        if self.detached and not self.in_parse:
            self.handback()


@dataclass
class _Inbox:
    sub: Subscription
    subject: str
    sid: bytes


class _Conn:
    """Range-read state of one client: the parser (installed while reads are in flight), the
    reply collectors by sid, and idle reply inboxes."""

    def __init__(self) -> None:
        self.sinks: dict[bytes, Reply] = {}
        self.parser: _RangeParser | None = None
        self.users = 0
        self.idle: list[_Inbox] = []

    def enter(self, nc: Client) -> None:
        if self.parser is None:
            ps = nc._ps
            if isinstance(ps, _RangeParser):  # a detached one still finishing a parse
                ps = ps.prev
            self.parser = _RangeParser(self, ps)
            nc._ps = self.parser
        self.users += 1

    def leave(self) -> None:
        self.users -= 1
        if self.users == 0 and self.parser is not None:
            self.parser.detach()
            self.parser = None

    def fail_all(self, why: str) -> None:
        for r in list(self.sinks.values()):
            r.fail(JetStreamUnavailableError(503, 0, why))

    async def acquire(self, nc: Client) -> _Inbox:
        while self.idle:
            box = self.idle.pop()
            if box.sub._id in nc._subs:
                return box
        subject = nc.new_inbox()
        sub = await nc.subscribe(subject, pending_msgs_limit=1 << 20,
                                 pending_bytes_limit=1 << 30)
        return _Inbox(sub, subject, str(sub._id).encode())

    async def release(self, nc: Client, box: _Inbox, clean: bool) -> None:
        """``clean``: the server sends nothing more to the inbox (the reply ended)."""
        if clean and box.sub._pending_queue.empty() and len(self.idle) < _MAX_IDLE_INBOXES:
            self.idle.append(box)
            return
        if nc.is_closed:
            return
        try:
            await box.sub.unsubscribe()
        except Exception:  # noqa: BLE001 - best effort: the connection may be going away
            pass


_CONNS: weakref.WeakKeyDictionary[Client, _Conn] = weakref.WeakKeyDictionary()


def _conn(nc: Client) -> _Conn:
    c = _CONNS.get(nc)
    if c is None:
        c = _CONNS[nc] = _Conn()
    return c


async def direct_get_reply(
    nc: Client,
    stream: str,
    body: Mapping[str, Any],
    *,
    timeout_s: float = 5.0,
    api_prefix: str = DEFAULT_PREFIX,
    reply: Reply | None = None,
    subject: str | None = None,
    on_progress: Callable[[Reply], None] | None = None,
    flush_at: int = 0,
) -> Reply:
    """Send one request and collect its reply with the bulk parser (needs
    :func:`fast_path_available`).

    ``body`` is the direct-get request (``{"seq", "next_by_subj", "batch", "max_bytes"}``). The
    returned :class:`Reply` has ended (its status is set) unless a generic collector resolved
    it itself. With ``on_progress``, that is called (in this task) each time ``flush_at`` hits
    are waiting, to work on them while the rest arrives. ``reply``/``subject`` let other
    collectors and API subjects use the same machinery (e.g. a consumer's ``MSG.NEXT``).

    Raises:
        RequestTimeoutError: no frame for ``timeout_s`` seconds before the reply ended.
        JetStreamUnavailableError: the connection was lost meanwhile.
    """
    conn = _conn(nc)
    loop = asyncio.get_running_loop()
    r = reply if reply is not None else Reply()
    r.done = done = loop.create_future()
    r.flush_at = flush_at if on_progress is not None else 0
    subj = subject or f"{api_prefix}.DIRECT.GET.{stream}"
    conn.enter(nc)
    try:
        box = await conn.acquire(nc)
        clean = False
        conn.sinks[box.sid] = r
        try:
            await nc.publish(subj, json.dumps(body, separators=(",", ":")).encode(),
                             reply=box.subject)
            step = max(min(timeout_s / 4, 1.0), 0.01)
            seen = taken = 0
            last_change = time.monotonic()
            while not done.done():
                if r.flush_at:
                    r.progress = progress = loop.create_future()
                    r.check_flush()
                    await asyncio.wait((done, progress), timeout=step,
                                       return_when=asyncio.FIRST_COMPLETED)
                    if progress.done() and not done.done() and on_progress is not None:
                        taken += len(r.datas)
                        on_progress(r)
                else:
                    await asyncio.wait((done,), timeout=step)
                if nc.is_closed:
                    raise nats.errors.ConnectionClosedError
                now = time.monotonic()
                count = taken + len(r.datas)
                if count != seen:
                    seen, last_change = count, now
                elif not done.done() and now - last_change >= timeout_s:
                    raise RequestTimeoutError(subj, timeout_s)
            done.result()  # raises the connection-lost error the parser set
            clean = r.status is not None
        finally:
            r.progress = None
            if done.done() and not done.cancelled():
                done.exception()  # retrieved: no "exception never retrieved" warning
            conn.sinks.pop(box.sid, None)
            await conn.release(nc, box, clean)
    finally:
        conn.leave()
    return r


# --------------------------------------------------------------------------------------------
# read_range
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RangeBatch:
    """One partition's range, as Arrow arrays of equal length, in sequence order.

    Attributes:
        seq: int64 stream sequences, ascending.
        subject: string subjects, ``prefix`` stripped.
        time: timestamp[ns, UTC] store times.
        headers: string: the message's own headers (direct-get headers removed; every
            ``Nats-*`` header with ``drop_nats_headers``) as ``json.dumps`` of nats-py's header
            dict, or null when none are left.
        origin_seq: int64: the origin stream sequence from ``Nats-Stream-Source``, or null.
        data: binary payloads.
        num_pending: ``Nats-Num-Pending`` of the last message (messages matching the request's
            filter after it, counted when that request was served); ``None`` when empty.
        ended: True when the range is exhausted: nothing more matched at or below ``last_seq``
            (or at all, without ``last_seq``) when the read ran; False when ``max_msgs`` or
            ``max_bytes`` cut it short.
        next_seq: where the next read of the partition starts: everything of it in
            ``[from_seq, next_seq)`` (up to ``last_seq``) is in this batch.
        requests: direct-get requests sent.
        scanned: hits received (an unfiltered read counts other partitions' messages too).
    """

    seq: pa.Array
    subject: pa.Array
    time: pa.Array
    headers: pa.Array
    origin_seq: pa.Array
    data: pa.Array
    num_pending: int | None
    ended: bool
    next_seq: int
    requests: int = 0
    scanned: int = 0

    def __len__(self) -> int:
        return len(self.seq)

    @property
    def num_rows(self) -> int:
        return len(self.seq)

    def table(self, *, origin: bool = False) -> pa.Table:
        """``seq, subject, time, headers, data`` as a table (the engine's record schema), plus
        ``origin_seq`` with ``origin=True`` (:data:`RANGE_SCHEMA`)."""
        if origin:
            return pa.Table.from_arrays(
                [self.seq, self.subject, self.time, self.headers, self.data, self.origin_seq],
                schema=RANGE_SCHEMA)
        return pa.Table.from_arrays(
            [self.seq, self.subject, self.time, self.headers, self.data],
            schema=pa.schema(list(RANGE_SCHEMA)[:5]))


def _check_status(r: Reply, subject: str, stream: str) -> None:
    if r.error is not None:
        raise r.error
    code = r.status
    if code in (204, 404):
        return
    if code == 503:
        raise JetStreamUnavailableError(
            503, 0, f"no responders for {subject}: stream {stream!r} missing or allow_direct "
                    "not enabled")
    raise error_from_status(code or 0, r.description or "direct get failed")


def _stored_columns(msgs: list[StoredMessage], drop_nats: bool) -> _Columns:
    """The plain path's messages as columns (the same values as :func:`reply_columns`)."""
    heads: list[str | None] = []
    origins: list[int | None] = []
    for m in msgs:
        h = m.headers
        if h and drop_nats:
            h = {k: v for k, v in h.items() if not k.startswith("Nats-")}
        heads.append(json.dumps(h) if h else None)
        origins.append(_origin_of(m.headers))
    return _Columns(
        pa.array([m.seq for m in msgs], pa.int64()),
        pa.array([m.subject for m in msgs], pa.string()),
        pa.array([m.time_ns for m in msgs], pa.int64()).cast(pa.timestamp("ns", tz="UTC")),
        pa.array(heads, pa.string()),
        pa.array(origins, pa.int64()),
        pa.array([m.data for m in msgs], pa.binary()),
        pa.array([m.num_pending for m in msgs], pa.int64()),
    )


async def _fetch(nc: Client, stream: str, body: dict[str, Any], *, timeout_s: float,
                 api_prefix: str, drop_nats: bool) -> tuple[_Columns | None, int | None]:
    """One request with the bulk parser: (columns of its hits or None, EOB num pending)."""
    parts: list[_Columns] = []

    def columnize(r: Reply) -> None:
        users, servers, datas = r.take()
        if datas:
            parts.append(reply_columns(users, servers, datas, drop_nats_headers=drop_nats))

    r = await direct_get_reply(nc, stream, body, timeout_s=timeout_s, api_prefix=api_prefix,
                               on_progress=columnize, flush_at=COLUMNIZE_EVERY)
    _check_status(r, f"{api_prefix}.DIRECT.GET.{stream}", stream)
    columnize(r)
    if not parts:
        return None, None
    cols = _Columns.concat(parts)
    stats = nc.stats
    stats["in_msgs"] += len(cols)
    stats["in_bytes"] += int(pc.sum(pc.binary_length(cols.data)).as_py() or 0)
    return cols, _int_or_none(r.status_headers.get("Nats-Num-Pending"))


async def read_range(
    nc: Client,
    stream: str,
    from_seq: int,
    *,
    filter_subject: str,
    prefix: str | None = None,
    max_msgs: int = 20_000,
    max_bytes: int = 64 * 1024 * 1024,
    last_seq: int | None = None,
    timeout_s: float = 5.0,
    request_batch: int | None = None,
    drop_nats_headers: bool = False,
    api_prefix: str = DEFAULT_PREFIX,
    fast: bool | None = None,
) -> RangeBatch:
    """Read the stored messages matching ``filter_subject`` from ``from_seq`` on, in sequence
    order, without consuming them (batched direct get), as Arrow arrays.

    Args:
        nc: a connected nats-py client; other traffic on it is unaffected, and several reads may
            be in flight on it at once.
        stream: the stream (``allow_direct: true``), e.g. ``"ORDERS-g"``.
        from_seq: first sequence to consider (>= 1).
        filter_subject: the direct get's ``next_by_subj``: ``"<p>.>"`` (filtered: the server
            skips other partitions) or ``">"`` (unfiltered: every message is sent and those
            without ``prefix`` are dropped here).
        prefix: the partition's subject prefix, e.g. ``"3."``: stripped from ``subject``;
            messages whose subject does not start with it are dropped. ``None``: subjects as
            stored, nothing dropped.
        max_msgs: most messages returned (>= 1).
        max_bytes: payload byte budget: the range stops after the message whose payload reaches
            it (so at least one message comes back, as with the server's ``max_bytes``).
        last_seq: never return a message above this sequence (e.g. the stream's last sequence
            when the run started); ``None``: no bound.
        timeout_s: a request without any reply frame for this long raises (a reply that stalls
            before its end-of-batch status counts the same).
        request_batch: most messages per direct-get request (default ``max_msgs``: one request
            per range when the filter selects the partition); each request also asks for at
            most :data:`MAX_REQUEST_BYTES`.
        drop_nats_headers: leave every ``Nats-*`` header out of ``headers`` (as the engine's
            records do), not only the direct-get ones; ``origin_seq`` is filled either way.
        api_prefix: ``"$JS.API"``, or ``"$JS.<domain>.API"``.
        fast: ``None``: the bulk parser where :func:`fast_path_available`, else
            :meth:`JetStreamAPI.direct_get_batch` (same result, slower); ``False`` forces the
            latter; ``True`` requires the former.

    Returns:
        A :class:`RangeBatch`.

    Raises:
        RequestTimeoutError: no reply, or a reply that stalled, for ``timeout_s`` seconds.
        JetStreamUnavailableError: no responders (stream missing / ``allow_direct`` off), or the
            connection was lost during the read.
        JetStreamError: another error status, or a reply that is no direct-get reply.
        nats.errors.ConnectionClosedError: the connection was closed during the read.
        ValueError: ``from_seq``, ``max_msgs``, ``max_bytes`` or ``request_batch`` below 1, or
            ``fast=True`` where the bulk parser is not available.
    """
    if from_seq < 1:
        raise ValueError(f"from_seq must be >= 1, got {from_seq}")
    if max_msgs < 1 or max_bytes < 1:
        raise ValueError(f"max_msgs and max_bytes must be >= 1, got {max_msgs}, {max_bytes}")
    if request_batch is not None and request_batch < 1:
        raise ValueError(f"request_batch must be >= 1, got {request_batch}")
    available = fast_path_available(nc)
    if fast and not available:
        raise ValueError("the bulk range-read parser needs nats-py 2.16.x and its own parser")
    use_fast = available if fast is None else fast
    chunk = request_batch or max_msgs

    parts: list[_Columns] = []
    got = got_bytes = requests = scanned = 0
    seq = from_seq  # everything of the range below seq is done
    ended = False
    num_pending: int | None = None
    api = None if use_fast else JetStreamAPI(nc, prefix=api_prefix, timeout=timeout_s)
    try:
        while got < max_msgs and got_bytes < max_bytes:
            if last_seq is not None and seq > last_seq:
                ended = True
                break
            batch = min(chunk, max_msgs - got)
            if last_seq is not None:
                batch = min(batch, last_seq - seq + 1)
            req_bytes = min(max_bytes - got_bytes, MAX_REQUEST_BYTES)
            requests += 1
            if api is None:
                cols, end_pending = await _fetch(
                    nc, stream, {"seq": seq, "next_by_subj": filter_subject, "batch": batch,
                                 "max_bytes": req_bytes},
                    timeout_s=timeout_s, api_prefix=api_prefix, drop_nats=drop_nats_headers)
            else:
                msgs = await api.direct_get_batch(stream, seq, filter_subject, batch,
                                                  max_bytes=req_bytes)
                cols = _stored_columns(msgs, drop_nats_headers) if msgs else None
                end_pending = msgs[-1].num_pending if msgs else None
            if cols is None:  # 404: nothing stored at or after seq matches the filter
                ended = True
                break
            scanned += len(cols)
            seq_np = cols.seq.to_numpy()
            scanned_to = int(seq_np[-1])
            past_last = last_seq is not None and scanned_to > last_seq
            if past_last:
                assert last_seq is not None
                cols = cols.head(int(np.searchsorted(seq_np, last_seq, side="right")))
                scanned_to = last_seq
            if prefix:
                cols = _strip_prefix(cols, prefix)
            # The limits: keep the first k rows.
            k = min(len(cols), max_msgs - got)
            if k:
                lens = pc.binary_length(cols.data.slice(0, k)).to_numpy(zero_copy_only=False)
                cum = np.cumsum(lens, dtype=np.int64)
                if got_bytes + int(cum[-1]) >= max_bytes:
                    k = int(np.searchsorted(cum, max_bytes - got_bytes, side="left")) + 1
                got_bytes += int(cum[k - 1])
                got += k
                num_pending = cols.pending[k - 1].as_py()
            if k < len(cols):
                # Cut by a limit inside this reply: the rest is for the next read.
                cols = cols.head(k)
                parts.append(cols)
                seq = int(cols.seq[k - 1].as_py()) + 1
                break
            if k:
                parts.append(cols)
            seq = scanned_to + 1
            if past_last or end_pending == 0 or (last_seq is not None and seq > last_seq):
                ended = True
                break
    finally:
        if api is not None:
            await api.close()
    cols = _Columns.concat(parts)
    return RangeBatch(cols.seq, cols.subject, cols.time, cols.headers, cols.origin_seq,
                      cols.data, num_pending, ended, seq, requests, scanned)
