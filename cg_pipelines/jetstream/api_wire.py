"""The JetStream API's wire forms and result types: consumer configs, durations, time stamps,
header blocks, :class:`PullResult` and :class:`StoredMessage` (pure; no connection needed).

Units: durations are **seconds** (``float``) in the Python API and **integer nanoseconds** on
the wire (``ack_wait``, ``priority_timeout``, ``expires`` ...). Everything here is importable
from :mod:`cg_pipelines.jetstream.api` as well.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nats.aio.msg import Msg

from cg_pipelines.core.errors import DecodeError, UsageError
from cg_pipelines.jetstream.errors import (
    JetStreamError,
    JetStreamUnavailableError,
    error_from_status,
)

__all__ = [
    "BATCH_COMPLETED",
    "DEFAULT_PREFIX",
    "DIRECT_GET_HEADERS",
    "NANOS_PER_SECOND",
    "PullResult",
    "StoredMessage",
    "consumer_config",
    "parse_header_block",
    "parse_rfc3339_ns",
    "seconds_to_ns",
]

DEFAULT_PREFIX = "$JS.API"
NANOS_PER_SECOND = 1_000_000_000

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

BATCH_COMPLETED = "Batch Completed"
"""Description of the 409 that ends a filled batch of a pull with ``max_bytes`` bytes to
spare (nats-server ``consumer.go``)."""

# Pull request statuses that end the request (100 = idle heartbeat / flow control does not).
#   400 bad request (e.g. "Priority Group missing"), 404 no messages (no_wait), 408 request
#   timeout (expired), 409 (consumer deleted, max bytes, leadership change, exceeded max
#   waiting ...), 423 pin id mismatch (the pin moved), 503 no responders.


def seconds_to_ns(seconds: float) -> int:
    """Seconds (``float``) to integer nanoseconds, rounded to the nearest nanosecond.

    Raises:
        UsageError: negative duration.
    """
    if seconds < 0:
        raise UsageError(f"duration must be >= 0 seconds, got {seconds!r}")
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
                        inactive_threshold_s=5, priority_groups=[PRIORITY_GROUP],
                        priority_policy="pinned_client", priority_timeout_s=5)
        == {"name": "m1", "filter_subjects": ["0.>", "3.>"], "deliver_policy": "all",
            "ack_policy": "explicit", "ack_wait": 5000000000,
            "inactive_threshold": 5000000000, "priority_groups": [PRIORITY_GROUP],
            "priority_policy": "pinned_client", "priority_timeout": 5000000000}

    Args:
        extra: raw wire fields merged last (they override the ones built here).

    Raises:
        UsageError: a negative duration, an empty filter subject, or ``priority_policy`` given
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
            raise UsageError(f"empty filter subject in {subjects!r}")
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
            raise UsageError("priority_policy needs priority_groups")
        cfg["priority_policy"] = priority_policy
    if priority_timeout_s is not None:
        cfg["priority_timeout"] = seconds_to_ns(priority_timeout_s)
    if metadata is not None:
        cfg["metadata"] = dict(metadata)
    if extra:
        cfg.update(extra)
    return cfg


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
        404 (no messages), 408 (expired), a 409 ``Message Size Exceeds MaxBytes`` that ended
        a batch after some messages (the byte budget was used up) and a 409 ``Batch
        Completed`` (the batch filled with bytes to spare)."""
        if self.status is None or self.status in (404, 408):
            return None
        if self.status == 409 and (BATCH_COMPLETED in self.description
                                   or self.messages and "MaxBytes" in self.description):
            return None
        return error_from_status(self.status, self.description)

    @property
    def unavailable(self) -> bool:
        """True when nothing was delivered and the status says JetStream could not serve the
        pull just now (503; 409 ``Leadership Change`` or ``Server Shutdown``): the same pull,
        sent again, is expected to succeed (:class:`JetStreamUnavailableError`)."""
        return not self.messages and isinstance(self.error, JetStreamUnavailableError)

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
        DecodeError: not an RFC 3339 time stamp.
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
            raise DecodeError(f"not an RFC 3339 time stamp: {ts!r}")
        body, zone = ts[:cut], ts[cut:]
    base, dot, frac = body.partition(".")
    if dot and (not frac.isdigit() or len(frac) > 9):
        raise DecodeError(f"bad fractional seconds in {ts!r}")
    seconds = _seconds_since_epoch(base + zone)
    nanos = int(frac.ljust(9, "0")) if frac else 0
    return seconds * NANOS_PER_SECOND + nanos
