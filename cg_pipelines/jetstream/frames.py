"""Cutting NATS protocol frames out of a socket byte stream, in bulk (pure, synchronous).

:class:`FrameCutter` takes the bytes of each socket read and a map of subscription ids to
:class:`Reply` collectors: the ``HMSG``/``MSG`` frames of those subscriptions go to their
collector (for a direct-get reply: three byte strings per hit, the message's own header lines,
the direct-get header lines and the payload); every other protocol unit comes back, unchanged
and in order, for nats-py's own parser. Used by the range-read parser
(:mod:`cg_pipelines.jetstream.rangeparser`); nothing here touches a client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from nats.aio.client import Client

from cg_pipelines.core.errors import DecodeError
from cg_pipelines.jetstream.errors import JetStreamError

__all__ = ["FrameCutter", "GenericReply", "Reply", "parse_status"]

_CRLF = b"\r\n"
_STATUS_LINE = b"NATS/1.0 "
_SERVER_BLOCK = b"\r\nNats-Stream: "

_parse_header_lines = Client._parse_header_lines


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
        except Exception:  # never let the client's read loop die
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
                    raise DecodeError("malformed control line")
                tlen = int(parts[-1])
                hlen = int(parts[-2]) if hdr else 0
                if hlen > tlen:
                    raise DecodeError("malformed control line")
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
