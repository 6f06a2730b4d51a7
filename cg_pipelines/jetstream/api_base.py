"""The plumbing every JetStream API call shares: the connection, the subject prefix, the JSON
request/response call and a pool of reply inboxes (:class:`ApiBase`, the base of
:class:`~cg_pipelines.jetstream.api.JetStreamAPI` and of its per-concern parts).

Pull requests and direct gets reply with several messages on one reply inbox, told apart by
subscription (SID), not by subject: each in-flight pull or direct get owns one
:class:`ReplyInbox`, taken from a small pool of idle ones and put back when the request ended
cleanly. A request abandoned early drops its subscription instead, so a late reply can never
reach a later request; JetStream messages still queued on it are nak'ed so the server
redelivers them at once instead of after ``ack_wait``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine, Mapping
from types import TracebackType
from typing import Any, Self

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from cg_pipelines.jetstream.api_wire import DEFAULT_PREFIX
from cg_pipelines.jetstream.errors import (
    JetStreamError,
    JetStreamUnavailableError,
    RequestTimeoutError,
    error_from_response,
)

__all__ = ["DESCRIPTION_HEADER", "STATUS_HEADER", "ApiBase", "ReplyInbox", "int_header",
           "json_body"]

#: Header names of a status message (``NATS/1.0 408 Request Timeout``, as nats-py parses it).
STATUS_HEADER = "Status"
DESCRIPTION_HEADER = "Description"

_MAX_IDLE_INBOXES = 8
_INBOX_PENDING_MSGS = 1 << 20
_INBOX_PENDING_BYTES = 1 << 30


class ReplyInbox:
    """One reply subscription (a unique ``_INBOX.<nuid>`` subject) used by one request at a time.

    Reads the subscription's pending queue directly (nats-py is pinned to 2.16.0): the public
    ``Subscription.next_msg`` creates a task and a UUID per call, which costs more than the rest
    of a pull.
    """

    __slots__ = ("sub", "subject")

    def __init__(self, sub: Subscription, subject: str) -> None:
        self.sub = sub
        self.subject = subject

    async def get(self, timeout: float) -> Msg | None:
        """Next reply, or ``None`` after ``timeout`` seconds without one."""
        sub = self.sub
        queue = sub._pending_queue
        if queue.empty():
            if timeout <= 0:
                return None
            try:
                async with asyncio.timeout(timeout):
                    msg = await queue.get()
            except TimeoutError:
                return None
        else:
            msg = queue.get_nowait()
        sub._pending_size -= len(msg.data)
        queue.task_done()
        return msg

    def drain_nowait(self) -> list[Msg]:
        """Everything already queued (not waiting)."""
        out: list[Msg] = []
        queue = self.sub._pending_queue
        while not queue.empty():
            msg = queue.get_nowait()
            self.sub._pending_size -= len(msg.data)
            queue.task_done()
            out.append(msg)
        return out


def json_body(payload: Mapping[str, Any] | None) -> bytes:
    """Compact JSON of a request body (``b""`` for ``None``)."""
    if payload is None:
        return b""
    return json.dumps(payload, separators=(",", ":")).encode()


def int_header(hdrs: Mapping[str, str] | None, key: str) -> int | None:
    """Header ``key`` of ``hdrs`` as an int, ``None`` when absent."""
    if not hdrs:
        return None
    v = hdrs.get(key)
    return int(v) if v is not None else None


class ApiBase:
    """Connection, prefix, timeout, :meth:`request` and the reply-inbox pool of a
    :class:`~cg_pipelines.jetstream.api.JetStreamAPI` (see its docstring for the arguments)."""

    def __init__(self, nc: Client, prefix: str = DEFAULT_PREFIX, timeout: float = 5.0) -> None:
        self.nc = nc
        self.prefix = prefix.rstrip(".")
        self.timeout = timeout
        # Idle reply subscriptions (see the module docstring); at most _MAX_IDLE_INBOXES kept.
        self._idle: list[ReplyInbox] = []
        # Background housekeeping (see _sweep_waiting); referenced so they are not collected.
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    def from_js(cls, js: JetStreamContext, timeout: float | None = None) -> Self:
        """The raw API on the connection and prefix (domain) of a nats-py JetStream context.

        ``timeout`` defaults to 5 seconds.
        """
        return cls(js._nc, prefix=js._prefix, timeout=5.0 if timeout is None else timeout)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Unsubscribe the idle reply inboxes (idempotent). The connection stays open; requests
        still in flight drop their own inbox when they end."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        idle, self._idle = self._idle, []
        for box in idle:
            await self._unsubscribe(box)

    # -- plumbing ----------------------------------------------------------------------------

    def _subject(self, *tokens: str) -> str:
        return ".".join((self.prefix, *tokens))

    async def request(
        self,
        subject: str,
        payload: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Send one API request and decode the JSON answer.

        Args:
            subject: full subject, e.g. ``"$JS.API.CONSUMER.INFO.S.c"``.
            payload: JSON body (``None`` sends an empty body).
            timeout: seconds, default ``self.timeout``.

        Returns:
            The decoded response object.

        Raises:
            JetStreamError: (a typed subclass) when the response has an ``"error"`` field.
            RequestTimeoutError: no answer within the timeout.
            JetStreamUnavailableError: no responders (JetStream not enabled / wrong prefix).
        """
        t = self.timeout if timeout is None else timeout
        try:
            msg = await self.nc.request(subject, json_body(payload), timeout=t)
        except nats.errors.NoRespondersError as e:
            raise JetStreamUnavailableError(
                503, 0, f"no responders for {subject}: is JetStream enabled on this account?"
            ) from e
        except nats.errors.TimeoutError as e:
            raise RequestTimeoutError(subject, t) from e
        try:
            resp = json.loads(msg.data) if msg.data else {}
        except ValueError as e:
            raise JetStreamError(0, 0, f"invalid JSON from {subject}: {msg.data[:200]!r}") from e
        if not isinstance(resp, dict):
            raise JetStreamError(0, 0, f"unexpected response from {subject}: {resp!r}")
        if resp.get("error"):
            raise error_from_response(resp)
        return resp

    async def _acquire(self) -> ReplyInbox:
        """An idle reply inbox, or a new subscription on a fresh ``_INBOX.<nuid>``."""
        if self._idle:
            return self._idle.pop()
        subject = self.nc.new_inbox()
        sub = await self.nc.subscribe(
            subject,
            pending_msgs_limit=_INBOX_PENDING_MSGS,
            pending_bytes_limit=_INBOX_PENDING_BYTES,
        )
        return ReplyInbox(sub, subject)

    async def _release(self, box: ReplyInbox, *, clean: bool) -> None:
        """Give ``box`` back. ``clean``: the server will send nothing more to it (the request got
        its terminating status or filled its batch), so it can serve the next request."""
        if clean and box.sub._pending_queue.empty() and len(self._idle) < _MAX_IDLE_INBOXES:
            self._idle.append(box)
            return
        await self._unsubscribe(box)
        # Deliveries nobody will process: hand them back now rather than after ack_wait.
        for msg in box.drain_nowait():
            if msg.reply and msg.reply.startswith("$JS.ACK."):
                try:
                    await msg.nak()
                except nats.errors.Error:
                    pass

    async def _unsubscribe(self, box: ReplyInbox) -> None:
        if self.nc.is_closed:
            return
        try:
            await box.sub.unsubscribe()
        except nats.errors.Error:
            pass

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
