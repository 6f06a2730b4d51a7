"""Run heartbeats in NATS, and what a driver reads to judge a run lost.

The rule is :func:`cg_pipelines.core.liveness.judge_run`; this module is its I/O:

- :class:`RunHeartbeat`: while a run lives, a thread of its process publishes to
  ``cg.liveness.<run id>`` on the stream :data:`LIVENESS_STREAM` with a per-message TTL
  (header ``Nats-TTL``, nats-server >= 2.11) of ``ttl_s`` seconds, every ``ttl_s / 3``
  seconds; the stream keeps one message a subject, so it holds at most one message per live
  run (expired ones are deleted by the server; ``max_age`` of one day bounds it even so).
- :func:`read_sightings`: for suspected runs, whether their heartbeat is still there
  (``$JS.API.STREAM.MSG.GET`` ``last_by_subj``, answered by the stream leader) and whether their
  partitions' lease consumers (``partition-<p>`` on the group's work queue) have a pinned
  client. One request per suspect and per lease; a request that fails leaves that fact
  unknown (``None``), which keeps the run alive.

The stream is this library's own (never a reference-format bucket: the reference lists a
bucket's keys as groups) and is created by the first heartbeat with a config every process
sends identically.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from nats.aio.client import Client

from cg_pipelines.core.errors import CgError, ConfigError, one_line
from cg_pipelines.core.liveness import HEARTBEAT_SUBJECT_PREFIX, heartbeat_subject
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.api_admin import pinned_client_id
from cg_pipelines.jetstream.connect import close_quietly
from cg_pipelines.jetstream.errors import (
    ConsumerNotFoundError,
    JetStreamError,
    RequestTimeoutError,
    StreamNotFoundError,
)

__all__ = ["LIVENESS_STREAM", "HeartbeatError", "RunHeartbeat", "ensure_liveness_stream",
           "any_pinned", "publish_heartbeat", "read_heartbeats",
           "read_pins"]

LIVENESS_STREAM = "CG_RUN_LIVENESS"
"""The stream of run heartbeats (subjects ``cg.liveness.>``)."""

_DAY_NS = 86_400 * 10**9
_MIN_TTL_S = 3.0


class HeartbeatError(CgError):
    """A run's heartbeat could not be written (the run must not go on unseen: a driver would
    judge it lost)."""


def liveness_stream_config(replicas: int) -> dict[str, Any]:
    """The wire config of :data:`LIVENESS_STREAM` (durations in nanoseconds): limits
    retention, one message a subject, per-message TTLs allowed, file storage, one day's
    ``max_age`` as a bound whatever the TTLs."""
    return {"name": LIVENESS_STREAM, "subjects": [f"{HEARTBEAT_SUBJECT_PREFIX}.>"],
            "retention": "limits", "storage": "file", "num_replicas": replicas,
            "max_msgs_per_subject": 1, "max_age": _DAY_NS, "discard": "old",
            "allow_msg_ttl": True, "allow_direct": True}


async def ensure_liveness_stream(api: JetStreamAPI) -> None:
    """Create :data:`LIVENESS_STREAM` unless it exists (any config: an operator may have
    changed its replicas): with 3 replicas where the cluster can place them, else 1 (a single
    server, or too few nodes up).

    Raises:
        HeartbeatError: it exists without per-message TTLs (``allow_msg_ttl``), or it could
            not be created.
        JetStreamError, TimeoutError: NATS did not answer.
    """
    info: dict[str, Any] | None
    try:
        info = await api.stream_info(LIVENESS_STREAM)
    except StreamNotFoundError:
        info = None
        errors = []
        for replicas in (3, 1):
            try:
                info = await api.create_stream(liveness_stream_config(replicas))
                break
            except JetStreamError as e:  # not clustered, too few nodes, or created meanwhile
                errors.append(f"R{replicas}: {e}")
                with contextlib.suppress(StreamNotFoundError):
                    info = await api.stream_info(LIVENESS_STREAM)
                    break
        if info is None:
            raise HeartbeatError(f"cannot create stream {LIVENESS_STREAM}: "
                                 f"{'; '.join(errors)}") from None
    if not (info.get("config") or {}).get("allow_msg_ttl"):
        raise HeartbeatError(f"stream {LIVENESS_STREAM} exists without allow_msg_ttl: run "
                             "heartbeats need per-message TTLs (nats-server >= 2.11); delete "
                             "it or set allow_msg_ttl")


async def publish_heartbeat(nc: Client, run_id: str, ttl_s: float, body: bytes = b"",
                            timeout_s: float = 5.0) -> int:
    """Publish one heartbeat of ``run_id`` living ``ttl_s`` seconds (rounded up to whole
    seconds, at least 1); returns its stream sequence.

    Raises:
        HeartbeatError: JetStream refused it or did not answer in ``timeout_s`` seconds.
        ConfigError: ``run_id`` is not one subject token.
    """
    subject = heartbeat_subject(run_id)
    ttl = f"{max(1, math.ceil(ttl_s))}s"
    try:
        reply = await nc.request(subject, body, timeout=timeout_s, headers={"Nats-TTL": ttl})
    except Exception as e:  # every failure means the same: no beat was stored
        raise HeartbeatError(f"heartbeat of run {run_id} not stored: {e!r}") from e
    ack = json.loads(reply.data or b"{}")
    if "error" in ack or "seq" not in ack:
        raise HeartbeatError(f"heartbeat of run {run_id} refused: {ack.get('error', ack)}")
    return int(ack["seq"])


async def read_heartbeats(api: JetStreamAPI, run_ids: Iterable[str]) -> dict[str, bool | None]:
    """``{run id: heartbeat present}``; ``None`` where the read failed (or the stream is
    missing while some run should have made it: the first beat creates it, so a missing
    stream means no run wrote one — ``False``)."""
    out: dict[str, bool | None] = {}
    for run_id in run_ids:
        try:
            msg = await api.msg_get(LIVENESS_STREAM, last_by_subj=heartbeat_subject(run_id))
        except StreamNotFoundError:
            out[run_id] = False
        except (TimeoutError, JetStreamError, ConfigError):
            out[run_id] = None
        else:
            out[run_id] = msg is not None
    return out


async def read_pins(api: JetStreamAPI, leases: Iterable[tuple[str, str]]
                    ) -> dict[tuple[str, str], bool | None]:
    """``{(stream, lease consumer): has a pinned client}``; a missing consumer is ``False``,
    a failed read ``None``."""
    out: dict[tuple[str, str], bool | None] = {}
    for stream, consumer in leases:
        try:
            info = await api.consumer_info(stream, consumer)
        except (ConsumerNotFoundError, StreamNotFoundError):
            out[(stream, consumer)] = False
        except (TimeoutError, JetStreamError):
            out[(stream, consumer)] = None
        else:
            out[(stream, consumer)] = pinned_client_id(info) is not None
    return out


def any_pinned(pins: Mapping[tuple[str, str], bool | None],
               leases: Sequence[tuple[str, str]]) -> bool | None:
    """Whether any of ``leases`` is pinned: ``True`` if one is, ``None`` if none is and one is
    unknown, else ``False``."""
    got = [pins.get(lease) for lease in leases]
    if any(g is True for g in got):
        return True
    return None if any(g is None for g in got) else False


class RunHeartbeat:
    """A context manager that keeps ``run_id``'s heartbeat alive while the block runs.

    ``__enter__`` waits until the first beat is stored (creating :data:`LIVENESS_STREAM` if
    needed), trying again for up to ``first_beat_s`` seconds while NATS does not answer; then a
    daemon thread with its own asyncio loop and NATS connection (``connect()``) publishes every
    ``ttl_s / 3`` seconds until ``__exit__`` (a failed beat is tried again at the next one). It
    never raises for NATS trouble: :attr:`started` says whether the first beat was stored and
    :attr:`error` why not — a run without a heartbeat is simply never judged lost by it. On
    exit nothing is deleted: the last beat expires ``ttl_s`` seconds later, covering the
    orchestrator's own bookkeeping after the block.

    Args:
        connect: makes a connected nats-py client (e.g. ``NatsResource.connect_options().
            connect``).
        run_id: the orchestrator's run id (one subject token).
        ttl_s: seconds a beat lives, at least 3.
        timeout_s: seconds for connecting and for each request.
        first_beat_s: seconds ``__enter__`` keeps trying the first beat.

    Raises:
        ConfigError: ``ttl_s < 3`` or a bad ``run_id``.
    """

    def __init__(self, connect: Callable[[], Awaitable[Client]], run_id: str, ttl_s: float,
                 *, timeout_s: float = 10.0, first_beat_s: float = 30.0) -> None:
        if ttl_s < _MIN_TTL_S:
            raise ConfigError("heartbeat_ttl_s", f"must be >= {_MIN_TTL_S:g} seconds, got "
                                                 f"{ttl_s!r}")
        heartbeat_subject(run_id)
        self.connect, self.run_id, self.ttl_s = connect, run_id, ttl_s
        self.timeout_s, self.first_beat_s = timeout_s, first_beat_s
        self.beats = 0
        self.started = False
        self.error = ""
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name=f"cg-heartbeat-{run_id}",
                                        daemon=True)

    def __enter__(self) -> RunHeartbeat:
        self._thread.start()
        self._ready.wait()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(self.timeout_s * 2)

    def _main(self) -> None:
        asyncio.run(self._beat())

    async def _first(self) -> Client | None:
        """Connect, make the stream, store the first beat; retried with a doubling pause
        until ``first_beat_s``. Returns the connection, or None (``error`` says why)."""
        deadline = time.monotonic() + self.first_beat_s
        pause = 0.25
        while True:
            nc: Client | None = None
            try:
                nc = await asyncio.wait_for(self.connect(), self.timeout_s)
                api = JetStreamAPI(nc, timeout=self.timeout_s)
                try:
                    await ensure_liveness_stream(api)
                finally:
                    await api.close()
                await publish_heartbeat(nc, self.run_id, self.ttl_s, timeout_s=self.timeout_s)
                return nc
            except Exception as e:  # every failure means the same: no beat yet
                self.error = one_line(f"{type(e).__name__}: {e}")
                if nc is not None:
                    await close_quietly(nc)
                if isinstance(e, HeartbeatError) and "allow_msg_ttl" in str(e):
                    return None  # a config problem: trying again changes nothing
            if time.monotonic() + pause > deadline or self._stop.is_set():
                return None
            await asyncio.sleep(pause)
            pause = min(pause * 2, 4.0)

    async def _beat(self) -> None:
        nc = await self._first()
        if nc is None:
            self._ready.set()
            return
        self.started, self.error = True, ""
        self.beats += 1
        self._ready.set()
        try:
            loop = asyncio.get_running_loop()
            while not await loop.run_in_executor(None, self._stop.wait, self.ttl_s / 3):
                with contextlib.suppress(HeartbeatError, RequestTimeoutError):
                    await publish_heartbeat(nc, self.run_id, self.ttl_s,
                                            timeout_s=self.timeout_s)
                    self.beats += 1
        finally:
            await close_quietly(nc)
