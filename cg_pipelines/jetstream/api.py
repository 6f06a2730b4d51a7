"""Raw JetStream API calls that nats-py 2.16 lacks.

nats-py 2.16 has no priority groups (pinned pulls, unpin), no batched direct get and no
``action`` on consumer create, so this module speaks the JSON API directly:

- :class:`JetStreamAPI` — request/response calls (consumer create/info/list/delete, unpin,
  stream create/info/purge/delete), pinned pull requests (:meth:`JetStreamAPI.pull`) and
  batched direct gets (:meth:`JetStreamAPI.direct_get_batch`).
- :func:`consumer_config` — builds a consumer config wire dict.

Units: durations are **seconds** (``float``) in the Python API and **integer nanoseconds** on
the wire (``ack_wait``, ``priority_timeout``, ``expires`` ...). Sequences are stream sequences
(``int``, first message is 1).

Pull requests and direct gets reply with several messages on one reply inbox. Messages a pull
delivers carry their *stream* subject (not the inbox), so replies are told apart by subscription
(SID), not by subject: each in-flight pull or direct get owns one inbox subscription, taken from
a small pool of idle ones and put back when the request ended cleanly (batch filled, or a
terminating status such as 404/408/423/204 EOB, after which the server sends nothing more to
that inbox). A request abandoned early (client deadline, missed heartbeats, cancellation) drops
its subscription instead, so a late reply can never reach a later request; JetStream messages
still queued on it are nak'ed so the server redelivers them at once instead of after
``ack_wait``. Messages delivered by a pull are plain ``nats.aio.msg.Msg`` objects:
``await msg.ack()`` and ``msg.metadata.sequence.stream`` work as usual.

Errors: API error responses raise the typed errors of :mod:`cg_pipelines.jetstream.errors`
(:class:`StreamNotFoundError`, :class:`ConsumerAlreadyExistsError`, ...); a request that gets no
answer within ``timeout`` raises :class:`RequestTimeoutError`; no responders (JetStream off, or
direct get not enabled on the stream) raises :class:`JetStreamUnavailableError`.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import functools
import json
import time
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from cg_pipelines.jetstream.errors import (
    JetStreamError,
    JetStreamUnavailableError,
    NoMessageFoundError,
    RequestTimeoutError,
    error_from_response,
    error_from_status,
)

__all__ = [
    "DEFAULT_PREFIX",
    "DIRECT_GET_HEADERS",
    "JetStreamAPI",
    "PullResult",
    "StoredMessage",
    "consumer_config",
    "parse_header_block",
    "parse_rfc3339_ns",
    "seconds_to_ns",
]

DEFAULT_PREFIX = "$JS.API"
NANOS_PER_SECOND = 1_000_000_000

_STATUS = "Status"
_DESCRIPTION = "Description"
_PIN_ID = "Nats-Pin-Id"

_MAX_IDLE_INBOXES = 8
_INBOX_PENDING_MSGS = 1 << 20
_INBOX_PENDING_BYTES = 1 << 30

#: Headers the server adds to direct-get replies; stripped from :attr:`StoredMessage.headers`.
DIRECT_GET_HEADERS: frozenset[str] = frozenset(
    {
        "Nats-Stream",
        "Nats-Sequence",
        "Nats-Subject",
        "Nats-Time-Stamp",
        "Nats-Num-Pending",
        "Nats-Last-Sequence",
        "Nats-UpTo-Sequence",
    }
)

# Pull request statuses that end the request (100 = idle heartbeat / flow control does not).
#   400 bad request (e.g. "Priority Group missing"), 404 no messages (no_wait), 408 request
#   timeout (expired), 409 (consumer deleted, max bytes, leadership change, exceeded max
#   waiting ...), 423 pin id mismatch (the pin moved), 503 no responders.


def seconds_to_ns(seconds: float) -> int:
    """Seconds (``float``) to integer nanoseconds, rounded to the nearest nanosecond.

    Raises:
        ValueError: negative duration.
    """
    if seconds < 0:
        raise ValueError(f"duration must be >= 0 seconds, got {seconds!r}")
    return int(round(seconds * NANOS_PER_SECOND))


def consumer_config(
    name: str | None = None,
    *,
    durable_name: str | None = None,
    filter_subjects: Sequence[str] | None = None,
    deliver_policy: str = "all",
    opt_start_seq: int | None = None,
    ack_policy: str = "explicit",
    ack_wait_s: float | None = None,
    max_ack_pending: int | None = None,
    max_deliver: int | None = None,
    max_waiting: int | None = None,
    inactive_threshold_s: float | None = None,
    priority_groups: Sequence[str] | None = None,
    priority_policy: str | None = None,
    priority_timeout_s: float | None = None,
    description: str | None = None,
    metadata: Mapping[str, str] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Build a consumer config as sent on the wire (``CONSUMER.CREATE`` ``"config"``).

    Pure function; fields whose argument is ``None`` are omitted. ``filter_subjects`` is always
    sent as the list form, even for one subject (never ``filter_subject``). Durations are seconds
    here and become integer nanoseconds: ``ack_wait``, ``inactive_threshold``,
    ``priority_timeout``.

    Example (an elastic member consumer)::

        consumer_config("m1", filter_subjects=["0.>", "3.>"], ack_wait_s=5,
                        inactive_threshold_s=5, priority_groups=["PCG"],
                        priority_policy="pinned_client", priority_timeout_s=5)
        == {"name": "m1", "filter_subjects": ["0.>", "3.>"], "deliver_policy": "all",
            "ack_policy": "explicit", "ack_wait": 5000000000,
            "inactive_threshold": 5000000000, "priority_groups": ["PCG"],
            "priority_policy": "pinned_client", "priority_timeout": 5000000000}

    Args:
        extra: raw wire fields merged last (they override the ones built here).

    Raises:
        ValueError: a negative duration, an empty filter subject, or ``priority_policy`` given
            without ``priority_groups``.
    """
    cfg: dict[str, Any] = {}
    if name is not None:
        cfg["name"] = name
    if durable_name is not None:
        cfg["durable_name"] = durable_name
    if description is not None:
        cfg["description"] = description
    if filter_subjects is not None:
        subjects = list(filter_subjects)
        if any(not s for s in subjects):
            raise ValueError(f"empty filter subject in {subjects!r}")
        if subjects:
            cfg["filter_subjects"] = subjects
    cfg["deliver_policy"] = deliver_policy
    if opt_start_seq is not None:
        cfg["opt_start_seq"] = opt_start_seq
    cfg["ack_policy"] = ack_policy
    if ack_wait_s is not None:
        cfg["ack_wait"] = seconds_to_ns(ack_wait_s)
    if max_ack_pending is not None:
        cfg["max_ack_pending"] = max_ack_pending
    if max_deliver is not None:
        cfg["max_deliver"] = max_deliver
    if max_waiting is not None:
        cfg["max_waiting"] = max_waiting
    if inactive_threshold_s is not None:
        cfg["inactive_threshold"] = seconds_to_ns(inactive_threshold_s)
    if priority_groups is not None:
        cfg["priority_groups"] = list(priority_groups)
    if priority_policy is not None:
        if not priority_groups:
            raise ValueError("priority_policy needs priority_groups")
        cfg["priority_policy"] = priority_policy
    if priority_timeout_s is not None:
        cfg["priority_timeout"] = seconds_to_ns(priority_timeout_s)
    if metadata is not None:
        cfg["metadata"] = dict(metadata)
    if extra:
        cfg.update(extra)
    return cfg


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


@dataclass
class PullResult:
    """What one pull request returned.

    Attributes:
        messages: delivered JetStream messages in delivery order (ackable ``Msg`` objects).
        pin_id: the pin to send with the next pull: the ``Nats-Pin-Id`` of the delivered
            messages, else the ``pin_id`` the request carried; ``None`` after a 423 (the pin
            moved: drop it and pull without one) or when the consumer has no pinned group.
        status: the status that ended the request (404 no messages, 408 expired, 409, 423 pin
            moved, 400 bad request ...), or ``None`` when the batch was filled (no status) or the
            client-side deadline passed first.
        description: the status description (``"Request Timeout"``, ``"Nats-Wrong-Pin-Id"``...),
            ``""`` when none.
        pending_messages: ``Nats-Pending-Messages`` of the terminating status, if sent.
        pending_bytes: ``Nats-Pending-Bytes`` of the terminating status, if sent.
    """

    messages: list[Msg] = field(default_factory=list)
    pin_id: str | None = None
    status: int | None = None
    description: str = ""
    pending_messages: int | None = None
    pending_bytes: int | None = None

    @property
    def pin_lost(self) -> bool:
        """True when the server answered 423: this client is not (or no longer) pinned."""
        return self.status == 423

    @property
    def error(self) -> JetStreamError | None:
        """The typed error for a failure status (400, 409, 423, 503 ...), ``None`` for success,
        404 (no messages), 408 (expired) and a 409 ``Message Size Exceeds MaxBytes`` that ended
        a batch after some messages (the byte budget was used up)."""
        if self.status is None or self.status in (404, 408):
            return None
        if self.status == 409 and self.messages and "MaxBytes" in self.description:
            return None
        return error_from_status(self.status, self.description)

    def raise_for_status(self) -> PullResult:
        """Return ``self``, or raise :attr:`error` if there is one.

        Raises:
            NotPinnedError: status 423.
            JetStreamError: other failure statuses (400, 409, 503 ...).
        """
        err = self.error
        if err is not None:
            raise err
        return self


@dataclass(slots=True)
class StoredMessage:
    """A message read from a stream without consuming it (direct get).

    Attributes:
        seq: stream sequence.
        subject: the message's subject.
        headers: user headers (the ``Nats-*`` direct-get headers removed), ``None`` if none.
        data: payload.
        time_ns: store time, nanoseconds since the Unix epoch (from ``Nats-Time-Stamp``).
        num_pending: ``Nats-Num-Pending``: messages matching the request's subject filter after
            this one (at the time of the request), ``None`` if not sent.
    """

    seq: int
    subject: str
    headers: dict[str, str] | None
    data: bytes
    time_ns: int
    num_pending: int | None = None


def parse_header_block(raw: bytes) -> dict[str, str]:
    """Headers of a NATS header block (``NATS/1.0[ status]\\r\\nKey: Value\\r\\n\\r\\n``) as a
    dict (the last value of a repeated key wins; the status line is dropped)."""
    out: dict[str, str] = {}
    for line in raw.decode("utf-8", "replace").split("\r\n")[1:]:
        key, sep, value = line.partition(":")
        if sep and key.strip():
            out[key.strip()] = value.strip()
    return out


_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


@functools.lru_cache(maxsize=4096)
def _seconds_since_epoch(stamp: str) -> int:
    dt = datetime.datetime.fromisoformat(stamp)
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=datetime.UTC)
    return (dt - _EPOCH) // datetime.timedelta(seconds=1)


def parse_rfc3339_ns(ts: str) -> int:
    """Parse an RFC 3339 time stamp with up to nanosecond precision into ns since the epoch.

    Examples: ``"2026-11-21T01:50:48.67076386Z"`` -> ``1795225848670763860``;
    ``"2024-01-01T01:00:00+01:00"`` -> ``1704067200000000000``.

    Raises:
        ValueError: not an RFC 3339 time stamp.
    """
    # Split "<date>T<time>[.<frac>]<zone>" into the part fromisoformat handles fast and the
    # fraction (up to 9 digits, which datetime cannot hold).
    if ts.endswith(("Z", "z")):
        body, zone = ts[:-1], "+00:00"
    else:
        t = ts.find("T")
        if t < 0:
            t = ts.find("t")
        cut = max(ts.rfind("+"), ts.rfind("-"))
        if t < 0 or cut < t:
            raise ValueError(f"not an RFC 3339 time stamp: {ts!r}")
        body, zone = ts[:cut], ts[cut:]
    base, dot, frac = body.partition(".")
    if dot and (not frac.isdigit() or len(frac) > 9):
        raise ValueError(f"bad fractional seconds in {ts!r}")
    seconds = _seconds_since_epoch(base + zone)
    nanos = int(frac.ljust(9, "0")) if frac else 0
    return seconds * NANOS_PER_SECOND + nanos


# --------------------------------------------------------------------------------------------
# The API
# --------------------------------------------------------------------------------------------


class _Inbox:
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


def _json(payload: Mapping[str, Any] | None) -> bytes:
    if payload is None:
        return b""
    return json.dumps(payload, separators=(",", ":")).encode()


def _int_header(hdrs: Mapping[str, str] | None, key: str) -> int | None:
    if not hdrs:
        return None
    v = hdrs.get(key)
    return int(v) if v is not None else None


class JetStreamAPI:
    """Raw JetStream API over a connected nats-py client.

    Args:
        nc: a connected ``nats.aio.client.Client`` (``await nats.connect(url)``).
        prefix: API subject prefix, ``"$JS.API"`` by default (``"$JS.<domain>.API"`` for a
            domain).
        timeout: seconds each request waits for its answer (default 5). Pulls wait
            ``expires_s + timeout``.

    Use ``await api.close()`` (or ``async with``) to drop the reply subscription; the connection
    itself is the caller's.
    """

    def __init__(self, nc: Client, prefix: str = DEFAULT_PREFIX, timeout: float = 5.0) -> None:
        self.nc = nc
        self.prefix = prefix.rstrip(".")
        self.timeout = timeout
        # Idle reply subscriptions (see the module docstring); at most _MAX_IDLE_INBOXES kept.
        self._idle: list[_Inbox] = []
        # Background housekeeping (see _sweep_waiting); referenced so they are not collected.
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    def from_js(cls, js: JetStreamContext, timeout: float | None = None) -> JetStreamAPI:
        """The raw API on the connection and prefix (domain) of a nats-py JetStream context.

        ``timeout`` defaults to 5 seconds.
        """
        return cls(js._nc, prefix=js._prefix, timeout=5.0 if timeout is None else timeout)

    async def __aenter__(self) -> JetStreamAPI:
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
            msg = await self.nc.request(subject, _json(payload), timeout=t)
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

    async def _acquire(self) -> _Inbox:
        """An idle reply inbox, or a new subscription on a fresh ``_INBOX.<nuid>``."""
        if self._idle:
            return self._idle.pop()
        subject = self.nc.new_inbox()
        sub = await self.nc.subscribe(
            subject,
            pending_msgs_limit=_INBOX_PENDING_MSGS,
            pending_bytes_limit=_INBOX_PENDING_BYTES,
        )
        return _Inbox(sub, subject)

    async def _release(self, box: _Inbox, *, clean: bool) -> None:
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

    async def _unsubscribe(self, box: _Inbox) -> None:
        if self.nc.is_closed:
            return
        try:
            await box.sub.unsubscribe()
        except nats.errors.Error:
            pass

    # -- consumers ---------------------------------------------------------------------------

    async def create_consumer(
        self, stream: str, config: Mapping[str, Any], action: str = "create"
    ) -> dict[str, Any]:
        """Create (or update) a consumer: ``$JS.API.CONSUMER.CREATE.<stream>.<name>``.

        The unfiltered subject form is used even with several ``filter_subjects`` (the server
        accepts that; the ``.<filter>`` suffix form only exists for a single filter). Without
        ``name``/``durable_name`` the ephemeral form ``CONSUMER.CREATE.<stream>`` is used.

        Args:
            stream: stream name.
            config: wire config, see :func:`consumer_config`.
            action: ``"create"`` (fail if it exists with a different config; an identical config
                is fine), ``"update"`` (fail if missing) or ``""`` (create or update).

        Returns:
            The consumer info (``{"stream_name", "name", "config", "created", "delivered",
            "ack_floor", "num_pending", "priority_groups"?, ...}``).

        Raises:
            ConsumerAlreadyExistsError: ``create`` and a different config exists (err_code 10148).
            ConsumerNotFoundError: ``update`` of a missing consumer (10149).
            WorkQueueConsumerNotUniqueError: overlapping filters on a work-queue stream (10100).
            StreamNotFoundError: no such stream (10059).
            ValueError: unknown ``action``.
        """
        if action not in ("create", "update", ""):
            raise ValueError(f"action must be 'create', 'update' or '', got {action!r}")
        name = config.get("name") or config.get("durable_name")
        subject = (
            self._subject("CONSUMER", "CREATE", stream, name)
            if name
            else self._subject("CONSUMER", "CREATE", stream)
        )
        body: dict[str, Any] = {"stream_name": stream, "config": dict(config)}
        if action:
            body["action"] = action
        resp = await self.request(subject, body)
        resp.pop("type", None)
        return resp

    async def delete_consumer(self, stream: str, name: str) -> bool:
        """Delete a consumer; returns the server's ``success`` flag.

        Raises:
            ConsumerNotFoundError: no such consumer (10014).
            StreamNotFoundError: no such stream (10059).
        """
        resp = await self.request(self._subject("CONSUMER", "DELETE", stream, name))
        return bool(resp.get("success"))

    async def consumer_info(self, stream: str, name: str) -> dict[str, Any]:
        """Consumer info dict.

        With a priority group it has ``"priority_groups": [{"group": "PCG",
        "pinned_client_id": "<id>", "pinned_ts": "<RFC 3339>"}]``; ``pinned_client_id`` is absent
        and ``pinned_ts`` is ``"0001-01-01T00:00:00Z"`` while nobody is pinned.

        Raises:
            ConsumerNotFoundError: no such consumer (10014).
            StreamNotFoundError: no such stream (10059).
        """
        resp = await self.request(self._subject("CONSUMER", "INFO", stream, name))
        resp.pop("type", None)
        return resp

    async def _paged(self, subject: str, key: str, body: Mapping[str, Any] | None) -> list[Any]:
        items: list[Any] = []
        offset = 0
        while True:
            payload = dict(body or {})
            payload["offset"] = offset
            resp = await self.request(subject, payload)
            page = resp.get(key) or []
            items.extend(page)
            offset += len(page)
            total = int(resp.get("total") or 0)
            if not page or offset >= total:
                return items

    async def list_consumer_names(self, stream: str) -> list[str]:
        """All consumer names of a stream (follows the API's paging).

        Raises:
            StreamNotFoundError: no such stream.
        """
        names: list[str] = await self._paged(
            self._subject("CONSUMER", "NAMES", stream), "consumers", None
        )
        return names

    async def list_consumers(self, stream: str) -> list[dict[str, Any]]:
        """Consumer info dicts of all consumers of a stream (paged).

        Raises:
            StreamNotFoundError: no such stream.
        """
        infos: list[dict[str, Any]] = await self._paged(
            self._subject("CONSUMER", "LIST", stream), "consumers", None
        )
        return infos

    async def unpin(self, stream: str, consumer: str, group: str = "PCG") -> None:
        """Unpin the current pinned client of ``group``: ``$JS.API.CONSUMER.UNPIN.<s>.<c>``.

        The next pull request without (or with a stale) pin id gets the pin; the old holder's
        pulls get status 423. Unpinning a group nobody holds succeeds.

        Raises:
            ConsumerNotFoundError: no such consumer.
            JetStreamError: err_code 10160 when the group is not one of the consumer's.
        """
        await self.request(self._subject("CONSUMER", "UNPIN", stream, consumer), {"group": group})

    async def pull(
        self,
        stream: str,
        consumer: str,
        *,
        batch: int = 1,
        expires_s: float = 5.0,
        group: str | None = "PCG",
        pin_id: str | None = None,
        max_bytes: int | None = None,
        no_wait: bool = False,
        heartbeat_s: float | None = None,
    ) -> PullResult:
        """One pull request: ``$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>``.

        Sends ``{"batch", "expires" (ns), "group", "id", "max_bytes", "no_wait",
        "idle_heartbeat" (ns)}`` (``None`` fields omitted) and collects replies until ``batch``
        messages arrived, a terminating status came (404/408/409/423/400...), or
        ``expires_s + self.timeout`` seconds passed.

        Pinned groups: a pull without ``pin_id`` competes for the pin and, while another client
        holds it, waits (ending with 408 at expiry). A pull whose ``pin_id`` is not the current
        pin gets 423 at once (``"Nats-Pin-Id mismatch"``, or ``"Nats-Wrong-Pin-Id"`` when the pin
        was released, e.g. by :meth:`unpin` or after ``priority_timeout`` without pulls).
        :attr:`PullResult.pin_id` tells what to send next time.

        A pull cancelled (or ended by missed heartbeats) while the server still holds it drops
        its inbox and asks the server, in the background, to sweep dead waiting requests: on a
        pinned group a dead request could otherwise be pinned by the next message and lock live
        pullers out for ``priority_timeout``.

        Args:
            batch: maximum messages (>= 1).
            expires_s: seconds the server keeps the request waiting (> 0 unless ``no_wait``).
            group: priority group, ``None`` for consumers without one.
            pin_id: the last ``Nats-Pin-Id`` seen, if any.
            max_bytes: byte budget for the batch; the server ends the batch with 409
                ``Message Size Exceeds MaxBytes`` when the next message does not fit (not an
                error in :attr:`PullResult.error` when messages came).
            no_wait: answer at once (404 when nothing is available). With ``expires_s > 0``
                too, the server waits until expiry instead (408) when nothing is available.
            heartbeat_s: ask for idle heartbeats at this interval (seconds); if neither a message
                nor a heartbeat comes for twice this long the pull ends (status ``None``,
                description ``"missed heartbeats"``).

        Returns:
            A :class:`PullResult`; failures are reported in it, not raised (see
            :meth:`PullResult.raise_for_status`).

        Raises:
            ValueError: ``batch < 1`` or ``expires_s <= 0`` without ``no_wait``.
        """
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if expires_s <= 0 and not no_wait:
            raise ValueError(f"expires_s must be > 0 seconds, got {expires_s}")
        body: dict[str, Any] = {"batch": batch}
        if expires_s > 0:
            body["expires"] = seconds_to_ns(expires_s)
        if no_wait:
            body["no_wait"] = True
        if max_bytes is not None:
            body["max_bytes"] = max_bytes
        if heartbeat_s is not None:
            body["idle_heartbeat"] = seconds_to_ns(heartbeat_s)
        if group is not None:
            body["group"] = group
        if pin_id is not None:
            body["id"] = pin_id

        result = PullResult(pin_id=pin_id)
        subject = self._subject("CONSUMER", "MSG", "NEXT", stream, consumer)
        box = await self._acquire()
        clean = False
        try:
            await self.nc.publish(subject, _json(body), reply=box.subject)
            deadline = time.monotonic() + max(expires_s, 0.0) + self.timeout
            idle = 2 * heartbeat_s if heartbeat_s else None
            messages = result.messages
            while True:
                if len(messages) >= batch:
                    clean = True  # the request is complete: the server sends nothing more
                    break
                remaining = deadline - time.monotonic()
                wait = remaining if idle is None else min(remaining, idle)
                msg = await box.get(wait)
                if msg is None:
                    if idle is not None and time.monotonic() < deadline:
                        result.description = "missed heartbeats"
                    break
                hdrs = msg.headers
                if hdrs is not None and _STATUS in hdrs:
                    status = int(hdrs[_STATUS])
                    if status == 100:  # idle heartbeat / flow control
                        continue
                    result.status = status
                    result.description = hdrs.get(_DESCRIPTION, "")
                    result.pending_messages = _int_header(hdrs, "Nats-Pending-Messages")
                    result.pending_bytes = _int_header(hdrs, "Nats-Pending-Bytes")
                    if status == 423:
                        result.pin_id = None
                    elif status == 503:
                        result.description = result.description or "no responders"
                    clean = True
                    break
                messages.append(msg)
                if hdrs is not None:
                    pid = hdrs.get(_PIN_ID)
                    if pid is not None:
                        result.pin_id = pid
        finally:
            await self._release(box, clean=clean)
            if not clean:
                self._spawn(self._sweep_waiting(stream, consumer))
        return result

    async def _sweep_waiting(self, stream: str, consumer: str) -> None:
        """Make the server drop pull requests whose inbox is gone.

        A pull abandoned while the server still holds it (cancelled, missed heartbeats) leaves a
        waiting request on an unsubscribed inbox. On a ``pinned_client`` group the server may
        pin that ghost when the next message arrives, locking every live puller out for
        ``priority_timeout``. A consumer info request makes the server check the waiting
        requests' interest and drop the dead ones (checked on nats-server 2.15.1). A message
        published between the abandonment and this sweep can still pin the ghost.
        """
        try:
            await self.request(
                self._subject("CONSUMER", "INFO", stream, consumer),
                timeout=min(self.timeout, 2.0),
            )
        except (JetStreamError, nats.errors.Error):
            pass

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- streams -----------------------------------------------------------------------------

    async def create_stream(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """Create a stream from a raw wire config (``$JS.API.STREAM.CREATE.<name>``).

        Durations in ``config`` are nanoseconds (wire form). Returns the stream info dict
        (``{"config", "created", "state", ...}``).

        Raises:
            JetStreamError: e.g. err_code 10058 (name in use with a different config), 10065
                (subjects overlap).
            KeyError: ``config`` has no ``"name"``.
        """
        resp = await self.request(self._subject("STREAM", "CREATE", config["name"]), config)
        resp.pop("type", None)
        return resp

    async def update_stream(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """Update a stream (``$JS.API.STREAM.UPDATE.<name>``); returns the stream info dict.

        Raises:
            StreamNotFoundError: no such stream.
        """
        resp = await self.request(self._subject("STREAM", "UPDATE", config["name"]), config)
        resp.pop("type", None)
        return resp

    async def delete_stream(self, name: str) -> bool:
        """Delete a stream; returns the server's ``success`` flag.

        Raises:
            StreamNotFoundError: no such stream.
        """
        resp = await self.request(self._subject("STREAM", "DELETE", name))
        return bool(resp.get("success"))

    async def stream_info(self, stream: str, subjects_filter: str | None = None) -> dict[str, Any]:
        """Stream info dict (``{"config", "created", "state": {"messages", "first_seq",
        "last_seq", ...}, ...}``).

        With ``subjects_filter`` (a subject, wildcards allowed) ``state["subjects"]`` maps each
        matching subject to its message count; pages are fetched and merged.

        Raises:
            StreamNotFoundError: no such stream.
        """
        subject = self._subject("STREAM", "INFO", stream)
        if subjects_filter is None:
            resp = await self.request(subject)
            resp.pop("type", None)
            return resp
        merged: dict[str, int] = {}
        offset = 0
        while True:
            resp = await self.request(
                subject, {"subjects_filter": subjects_filter, "offset": offset}
            )
            resp.pop("type", None)
            page: dict[str, int] = (resp.get("state") or {}).get("subjects") or {}
            merged.update(page)
            offset += len(page)
            total = int(resp.get("total") or 0)
            if not page or offset >= total:
                break
        resp.setdefault("state", {})["subjects"] = merged
        for k in ("total", "offset", "limit"):
            resp.pop(k, None)
        return resp

    async def purge(
        self,
        stream: str,
        *,
        filter: str | None = None,  # noqa: A002 - the API's name
        seq: int | None = None,
        keep: int | None = None,
    ) -> int:
        """Purge messages: ``$JS.API.STREAM.PURGE.<stream>`` ``{"filter", "seq", "keep"}``.

        Args:
            filter: only messages on this subject (wildcards allowed).
            seq: remove messages with sequence **below** ``seq`` (``seq`` itself stays).
            keep: keep this many newest messages (per filter); exclusive with ``seq``.

        Returns:
            The number of messages purged.

        Raises:
            ValueError: both ``seq`` and ``keep``.
            StreamNotFoundError: no such stream.
        """
        if seq is not None and keep is not None:
            raise ValueError("purge takes seq or keep, not both")
        body: dict[str, Any] = {}
        if filter is not None:
            body["filter"] = filter
        if seq is not None:
            body["seq"] = seq
        if keep is not None:
            body["keep"] = keep
        resp = await self.request(self._subject("STREAM", "PURGE", stream), body)
        return int(resp.get("purged") or 0)

    async def msg_get(
        self,
        stream: str,
        *,
        seq: int | None = None,
        next_by_subj: str | None = None,
        last_by_subj: str | None = None,
    ) -> StoredMessage | None:
        """One stored message, answered by the stream's **leader** (``$JS.API.STREAM.MSG.GET``,
        not a direct get, which any replica may answer a little behind the leader).

        Body ``{"seq"}`` (that sequence), ``{"seq", "next_by_subj"}`` (the first message at or
        after ``seq`` on that subject filter) or ``{"last_by_subj"}``.

        Returns:
            The message (all its headers, ``Nats-*`` included, in ``headers``; ``num_pending``
            ``None``), or ``None`` when nothing matches (err_code 10037).

        Raises:
            StreamNotFoundError: no such stream.
            JetStreamError: another API error (e.g. 503 while the stream has no leader).
            RequestTimeoutError: no answer within ``self.timeout`` seconds.
        """
        body: dict[str, Any] = {}
        if seq is not None:
            body["seq"] = seq
        if next_by_subj is not None:
            body["next_by_subj"] = next_by_subj
        if last_by_subj is not None:
            body["last_by_subj"] = last_by_subj
        try:
            resp = await self.request(self._subject("STREAM", "MSG", "GET", stream), body)
        except NoMessageFoundError:
            return None
        m = resp.get("message") or {}
        raw_hdrs = base64.b64decode(m["hdrs"]) if m.get("hdrs") else b""
        return StoredMessage(
            int(m["seq"]), str(m["subject"]), parse_header_block(raw_hdrs) or None,
            base64.b64decode(m["data"]) if m.get("data") else b"",
            parse_rfc3339_ns(str(m["time"])) if m.get("time") else 0)

    async def delete_msg(self, stream: str, seq: int, *, erase: bool = False) -> bool:
        """Delete one message (``$JS.API.STREAM.MSG.DELETE``; ``erase`` overwrites it too).

        Returns:
            True when deleted, False when there was no such message (err_code 10043 on
            nats-server 2.15.1).

        Raises:
            StreamNotFoundError: no such stream.
            JetStreamError: another API error.
        """
        body: dict[str, Any] = {"seq": seq}
        if not erase:
            body["no_erase"] = True
        try:
            resp = await self.request(self._subject("STREAM", "MSG", "DELETE", stream), body)
        except JetStreamError as e:
            # 10043 sequence not found (2.15.1), 10057 / 10037: no such message
            if e.err_code in (10037, 10043, 10057) or (e.status == 404
                                                       and e.err_code != 10059):
                return False
            raise
        return bool(resp.get("success"))

    async def direct_get_batch(
        self,
        stream: str,
        seq: int,
        next_by_subj: str,
        batch: int,
        max_bytes: int | None = None,
    ) -> list[StoredMessage]:
        """Read up to ``batch`` stored messages without consuming them (batched direct get).

        Sends ``{"seq", "next_by_subj", "batch"[, "max_bytes"]}`` to
        ``$JS.API.DIRECT.GET.<stream>``; the server answers with one message per hit (headers
        ``Nats-Stream``, ``Nats-Sequence``, ``Nats-Subject``, ``Nats-Time-Stamp``,
        ``Nats-Num-Pending``, ``Nats-Last-Sequence``) and ends with status 204 ``EOB``. The
        stream needs ``allow_direct: true``.

        Args:
            seq: first sequence to consider (inclusive).
            next_by_subj: subject filter (wildcards allowed), e.g. ``"3.>"``.
            batch: maximum number of messages (>= 1).
            max_bytes: byte budget; the server stops after the message that crosses it (at least
                one message is returned).

        Returns:
            Messages in stream-sequence order, ``seq`` <= each ``.seq``; empty when nothing
            matches (status 404).

        Raises:
            JetStreamUnavailableError: no responders (stream missing or ``allow_direct`` off).
            RequestTimeoutError: no reply (or the batch stalled) for ``self.timeout`` seconds.
            JetStreamError: another error status (e.g. 400 bad request).
            ValueError: ``batch < 1`` or ``seq < 1``.
        """
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if seq < 1:
            raise ValueError(f"seq must be >= 1, got {seq}")
        body: dict[str, Any] = {"seq": seq, "next_by_subj": next_by_subj, "batch": batch}
        if max_bytes is not None:
            body["max_bytes"] = max_bytes
        subject = self._subject("DIRECT", "GET", stream)
        out: list[StoredMessage] = []
        box = await self._acquire()
        clean = False
        try:
            await self.nc.publish(subject, _json(body), reply=box.subject)
            strip = DIRECT_GET_HEADERS
            while True:
                msg = await box.get(self.timeout)
                if msg is None:
                    raise RequestTimeoutError(subject, self.timeout)
                hdrs = msg.headers
                if not hdrs:
                    raise JetStreamError(0, 0, f"direct get reply without headers from {subject}")
                status = hdrs.get(_STATUS)
                if status is not None:
                    code = int(status)
                    clean = True  # a status always ends the reply stream
                    if code in (204, 404, 408):  # end of batch / nothing found / timed out
                        return out
                    if code == 503:
                        raise JetStreamUnavailableError(
                            503,
                            0,
                            f"no responders for {subject}: stream {stream!r} missing or "
                            "allow_direct not enabled",
                        )
                    raise error_from_status(code, hdrs.get(_DESCRIPTION, ""))
                user = {k: v for k, v in hdrs.items() if k not in strip}
                pending = hdrs.get("Nats-Num-Pending")
                out.append(
                    StoredMessage(
                        int(hdrs["Nats-Sequence"]),
                        hdrs["Nats-Subject"],
                        user or None,
                        msg.data,
                        parse_rfc3339_ns(hdrs["Nats-Time-Stamp"]),
                        int(pending) if pending is not None else None,
                    )
                )
                if len(out) > batch:  # defensive: never trust a runaway reply stream
                    return out[:batch]
        finally:
            await self._release(box, clean=clean)
