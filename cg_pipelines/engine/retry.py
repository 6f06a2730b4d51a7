"""Bounded retries of NATS calls while the connection is lost or JetStream is unavailable.

A partition run that loses NATS (server restart, network cut, leader change) must neither give
up at the first timeout nor hang: each NATS step of the engine is retried with exponential
backoff for at most ``nats_retry_max_s`` seconds after its first failure, and then the run fails
with :class:`NatsUnavailableError`, whose message says what to check. Only steps that are safe
to repeat are retried (reads, idempotent creates, purges, de-duplicated DLQ publishes, acks
whose effect is verified); see :mod:`cg_pipelines.engine.runner`.

Nothing here acknowledges anything: a run that fails this way has acknowledged only what it
committed, and the next run resumes from the committed watermark.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import ParseResult, urlsplit

import nats.errors
import nats.js.errors
from nats.aio.client import Client

from cg_pipelines.core.errors import CgError, UsageError
from cg_pipelines.jetstream.errors import (
    JetStreamError,
    JetStreamUnavailableError,
    RequestTimeoutError,
)

T = TypeVar("T")

#: JetStream error codes that mean "try again" (nats-server errors.json): 10008 JetStream
#: temporarily unavailable, 10023 insufficient resources during recovery.
_TRANSIENT_ERR_CODES = frozenset({10008, 10023})

_TRANSIENT: tuple[type[BaseException], ...] = (
    TimeoutError,  # nats.errors.TimeoutError and friends subclass it
    RequestTimeoutError,
    JetStreamUnavailableError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,  # includes UnexpectedEOF
    nats.errors.OutboundBufferLimitError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.NoStreamResponseError,
)


class NatsUnavailableError(CgError, RuntimeError):
    """NATS stayed unreachable (or JetStream unavailable) for longer than the retry budget.

    Attributes:
        step: the engine step that failed (e.g. ``"purge"``).
        attempts: how many times it was tried.
        seconds: time spent retrying, in seconds.
    """

    def __init__(self, step: str, attempts: int, seconds: float, detail: str) -> None:
        self.step, self.attempts, self.seconds = step, attempts, seconds
        super().__init__(detail)


def is_transient(exc: BaseException) -> bool:
    """True for failures that a reconnect can cure: timeouts, no responders, a connection being
    re-established, JetStream 503 / 10008 / 10023. Not for closed connections or API errors."""
    if isinstance(exc, nats.errors.ConnectionClosedError):
        return False
    if isinstance(exc, JetStreamError) and (
        exc.status == 503 or exc.err_code in _TRANSIENT_ERR_CODES
    ):
        return True
    if isinstance(exc, nats.js.errors.APIError) and (
        exc.code == 503 or exc.err_code in _TRANSIENT_ERR_CODES
    ):
        return True
    return isinstance(exc, _TRANSIENT)


def backoff_delays(first_s: float, cap_s: float) -> Callable[[int], float]:
    """``delay(attempt)`` in seconds: ``first_s * 2**(attempt-1)``, capped at ``cap_s``."""
    if first_s <= 0 or cap_s < first_s:
        raise UsageError(f"need 0 < first_s <= cap_s seconds, got {first_s}, {cap_s}")
    return lambda attempt: min(cap_s, first_s * 2 ** max(0, attempt - 1))


def server_hint(nc: Client) -> str:
    """The server the client last used, as ``host:port`` (never credentials)."""
    url = nc.connected_url or (nc.servers[0] if nc.servers else None)
    if url is None:
        return "the configured NATS servers"
    parts = urlsplit(url.geturl() if hasattr(url, "geturl") else str(url))
    return f"{parts.hostname}:{parts.port}" if parts.hostname else "the configured NATS servers"


@dataclass(frozen=True)
class Retrier:
    """Runs NATS calls with bounded retries.

    Args:
        nc: the client (its reconnect loop does the reconnecting; we wait and retry).
        max_s: seconds after the first failure of a call during which it is retried.
        first_backoff_s, max_backoff_s: the exponential backoff between attempts, in seconds.
        context: text naming the run, for error messages (e.g. ``"partition 3 of s-g"``).
        on_retry: ``on_retry(step, attempt, exc)`` after each failed attempt (metrics, logs).
        stream: the stream the calls are about, named in the give-up message when the failed
            request's subject does not name one.
    """

    nc: Client
    max_s: float
    first_backoff_s: float
    max_backoff_s: float
    context: str
    on_retry: Callable[[str, int, BaseException], None] | None = None
    stream: str | None = None

    async def call(self, step: str, op: Callable[[], Awaitable[T]]) -> T:
        """``await op()``, retried while it fails with a transient error, for at most
        :attr:`max_s` seconds.

        Raises:
            NatsUnavailableError: still failing when the budget ran out, or the connection was
                closed for good (the client gave up reconnecting).
            Any non-transient exception of ``op``, unchanged.
        """
        delay = backoff_delays(self.first_backoff_s, self.max_backoff_s)
        t0 = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            try:
                return await op()
            except Exception as e:  # classified just below
                closed = isinstance(e, nats.errors.ConnectionClosedError) or self.nc.is_closed
                if not closed and not is_transient(e):
                    raise
                spent = time.monotonic() - t0
                if closed or spent + delay(attempt) > self.max_s:
                    raise self._give_up(step, attempt, spent, e, closed) from e
                if self.on_retry is not None:
                    self.on_retry(step, attempt, e)
                await asyncio.sleep(delay(attempt))

    def _give_up(
        self, step: str, attempts: int, spent: float, exc: BaseException, closed: bool
    ) -> NatsUnavailableError:
        return NatsUnavailableError(step, attempts, spent, give_up_message(
            self.nc, f"{self.context}: {step}", attempts, spent, exc, closed=closed,
            stream=self.stream))


def servers_tried(nc: Client) -> str:
    """Every server the client knows (its configured and discovered pool), as ``host:port``
    joined by ``", "`` (never credentials); the one it is connected to first."""
    out: list[str] = []
    # ``servers``: the whole pool, configured and discovered (nats-py's public property)
    urls: list[ParseResult | None] = [nc.connected_url] if nc.connected_url is not None else []
    urls.extend(nc.servers or [])
    for url in urls:
        if url is None:
            continue
        parts = urlsplit(url.geturl() if hasattr(url, "geturl") else str(url))
        if parts.hostname:
            hp = f"{parts.hostname}:{parts.port}"
            if hp not in out:
                out.append(hp)
    return ", ".join(out) or "the configured NATS servers"


_API_SUBJECT = re.compile(
    r"\$JS\.(?:[^.\s]+\.)?API\.(?:STREAM\.(?:INFO|PURGE|MSG\.GET|MSG\.DELETE|CREATE|UPDATE"
    r"|DELETE|LEADER\.STEPDOWN)|DIRECT\.GET|CONSUMER\.(?:INFO|CREATE|DURABLE\.CREATE|DELETE"
    r"|MSG\.NEXT|UNPIN|LIST|NAMES))\.([^.\s'\"]+)")


def stream_of(exc: BaseException) -> str | None:
    """The stream a failed JetStream API request was about, read from the request subject in
    the error's text (``$JS.API.STREAM.INFO.<stream>``, ``$JS.API.DIRECT.GET.<stream>``,
    ``$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>`` ...), or None."""
    m = _API_SUBJECT.search(str(exc))
    return m.group(1) if m else None


def status_of(exc: BaseException) -> str:
    """The server's answer in words, to follow "answered": ``"status 503: no responders
    ..."``, ``"nothing (status 408: request to ... timed out after 2 s)"``, ``"status 503,
    err_code 10008: ..."``, or the error's type and text."""
    if isinstance(exc, RequestTimeoutError):
        return f"nothing (status 408: {exc.description})"
    if isinstance(exc, JetStreamError):
        code = f", err_code {exc.err_code}" if exc.err_code else ""
        return f"status {exc.status}{code}: {exc.description}"
    if isinstance(exc, nats.js.errors.APIError):
        return f"status {exc.code}, err_code {exc.err_code}: {exc.description}"
    if isinstance(exc, nats.errors.NoRespondersError | nats.js.errors.NoStreamResponseError):
        return "status 503: no responders (no stream leader answered)"
    if isinstance(exc, TimeoutError):
        return "nothing (timeout)"
    return f"{type(exc).__name__}: {exc}"


def give_up_message(
    nc: Client, what: str, attempts: int, spent: float, exc: BaseException, *,
    closed: bool = False, stream: str | None = None,
) -> str:
    """One line saying why ``what`` (e.g. ``"partition 3 of S-g: read"``) gave up after
    ``attempts`` attempts over ``spent`` seconds: the servers tried, the stream and the
    server's status, what to check, and that nothing past the committed watermark was
    acknowledged. Three cases: the connection is closed; no server answers (lost
    connection); or NATS answers but the stream does not (a 503 / timeout for a stream without
    a leader: its replicas' servers down or without quorum)."""
    servers = servers_tried(nc)
    about = stream_of(exc) or stream
    status = status_of(exc)
    tail = ("Nothing past the committed watermark was acknowledged: rerun the partition to "
            "resume.")
    if closed or not nc.is_connected:
        why = ("the NATS connection is closed (the client gave up reconnecting)" if closed
               else f"NATS did not answer for {spent:.1f} s (no server reachable)")
        return (f"{what} failed after {attempts} attempt(s): {why}; servers tried: {servers}; "
                f"last error: {status}. Check that nats-server is running and reachable at "
                f"{servers}, that JetStream is enabled and has a leader, and the client's "
                f"credentials. {tail}")
    target = f"stream {about}" if about else "JetStream"
    hint = (f"the stream has no leader: check that the servers holding its replicas are up "
            f"and have quorum (`nats stream info {about}`)" if about else
            "check that JetStream is enabled and has a meta leader (`nats server report "
            "jetstream`)")
    return (f"{what} failed after {attempts} attempt(s) over {spent:.1f} s: NATS is reachable "
            f"(servers tried: {servers}) but {target} answered {status}; {hint}. {tail}")
