"""The range-read parser: attached to one nats-py client while bulk reads are in flight.

While at least one bulk read (:func:`direct_get_reply`, :func:`attach`) is in flight on a
connection, that connection's protocol parser (``nc._ps``, nats-py 2.16) is replaced *on that
client instance only* by :class:`RangeParser`. Its
:class:`~cg_pipelines.jetstream.frames.FrameCutter` keeps the frames of the registered reply
inboxes (:attr:`RangeConnection.sinks`) and hands every other frame, unchanged and in order, to
nats-py's own parser (subscriptions, requests, PING/PONG, INFO, -ERR behave as before). Partial
frames and parser state are carried over both ways when the parser is installed and put back,
and it is put back as soon as no bulk read is in flight. Importing this module changes nothing:
no nats-py class or module is patched.

Public entry points: :func:`fast_path_available` (can this client take the parser),
:func:`attach` (install it for the duration of a ``with`` block and get the connection's
:class:`RangeConnection`: reply inboxes and collectors), :func:`direct_get_reply` (one request,
its reply collected by the parser).
"""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import nats.errors
from nats.aio import client as nats_client
from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.protocol.parser import AWAITING_CONTROL_LINE, AWAITING_MSG_PAYLOAD, Parser

from cg_pipelines.jetstream.api import DEFAULT_PREFIX
from cg_pipelines.jetstream.errors import JetStreamUnavailableError, RequestTimeoutError
from cg_pipelines.jetstream.frames import FrameCutter, Reply

__all__ = [
    "SUPPORTED_NATS_PY",
    "RangeConnection",
    "RangeParser",
    "attach",
    "connection",
    "direct_get_reply",
    "fast_path_available",
]

#: nats-py versions whose parser and read loop this module was written against.
SUPPORTED_NATS_PY = "2.16."

_MAX_IDLE_INBOXES = 8


def fast_path_available(nc: Client) -> bool:
    """Whether the bulk parser can be attached to ``nc``: nats-py 2.16.x, and the client's
    parser is nats-py's own (or this module's)."""
    if not str(getattr(nats_client, "__version__", "")).startswith(SUPPORTED_NATS_PY):
        return False
    ps = getattr(nc, "_ps", None)
    return type(ps) is Parser or isinstance(ps, RangeParser)


class RangeParser(Parser):
    """Stands in for nats-py 2.16's ``Parser`` on one client while range reads are in flight.

    Frames for the range-read inboxes (``conn.sinks``) are collected by a :class:`FrameCutter`;
    all other bytes go, as whole protocol units and in order, to the parser it replaced
    (``prev``), which dispatches them exactly as before. State is taken over from ``prev`` at
    each :meth:`parse` (a frame ``prev`` had half read is rebuilt in front of the new bytes) and
    handed back by :meth:`detach`.
    """

    def __init__(self, conn: RangeConnection, prev: Parser) -> None:  # no super(): reset() is ours
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


class RangeConnection:
    """Range-read state of one client: the parser (installed while reads are in flight), the
    reply collectors by sid, and idle reply inboxes."""

    def __init__(self) -> None:
        self.sinks: dict[bytes, Reply] = {}
        self.parser: RangeParser | None = None
        self.users = 0
        self.idle: list[_Inbox] = []

    def enter(self, nc: Client) -> None:
        if self.parser is None:
            ps = nc._ps
            if isinstance(ps, RangeParser):  # a detached one still finishing a parse
                ps = ps.prev
            self.parser = RangeParser(self, ps)
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
        except Exception:  # best effort: the connection may be going away
            pass


_CONNS: weakref.WeakKeyDictionary[Client, RangeConnection] = weakref.WeakKeyDictionary()


def connection(nc: Client) -> RangeConnection:
    """The range-read state of ``nc`` (made on first use, dropped with the client). Reading it
    attaches nothing; :func:`attach` does."""
    c = _CONNS.get(nc)
    if c is None:
        c = _CONNS[nc] = RangeConnection()
    return c


@contextmanager
def attach(nc: Client) -> Iterator[RangeConnection]:
    """Install the range-read parser on ``nc`` for the ``with`` block (needs
    :func:`fast_path_available`); yields the connection's :class:`RangeConnection`.

    Blocks may nest and run concurrently on one client: they share one parser, put back (with
    anything it held back) when the last of them ends. Inside the block, register a collector
    with ``conn.sinks[box.sid] = reply`` for an inbox from ``await conn.acquire(nc)``, and
    remove it and ``await conn.release(nc, box, clean)`` when done.
    """
    conn = connection(nc)
    conn.enter(nc)
    try:
        yield conn
    finally:
        conn.leave()


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
    loop = asyncio.get_running_loop()
    r = reply if reply is not None else Reply()
    r.done = done = loop.create_future()
    r.flush_at = flush_at if on_progress is not None else 0
    subj = subject or f"{api_prefix}.DIRECT.GET.{stream}"
    with attach(nc) as conn:
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
    return r
