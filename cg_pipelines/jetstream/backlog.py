"""Per-partition backlog of an elastic group's work-queue stream (for sensors and schedules).

A partition's backlog is exact and read in one server answer per partition: a batched direct get
``{"seq": 1, "next_by_subj": "<p>.>", "batch": 1}`` returns the partition's first pending message
(its sequence and store time) and, in ``Nats-Num-Pending``, how many of the partition's messages
follow it. What a tick costs is kept small around that:

1. ``STREAM.INFO`` of the work-queue stream (one small request, whatever the stream holds): a
   missing stream raises :class:`~cg_pipelines.jetstream.errors.StreamNotFoundError`, and an
   empty stream ends the read there (no partition has a backlog).
2. When the stream holds few distinct subjects for the partitions asked
   (:func:`cg_pipelines.core.triggers.use_subject_counts`), one ``STREAM.INFO`` with
   ``subjects_filter: ">"`` (pages followed) gives every subject's count; partitions without
   messages are not asked for (:func:`cg_pipelines.core.triggers.pending_by_partition`). With many
   subjects that listing costs more than the direct gets it would save (its size grows with the
   subjects, not the partitions), so it is skipped.
3. The direct gets of the remaining partitions share one reply subscription
   (``<inbox>.<p>``) with at most ``window`` requests in flight, instead of a subscription per
   request; together they are one call bounded by the API's timeout.

A partition counted in step 2 but drained before its direct get reads as empty; one that received
its first message in between is seen at the next tick. Without step 2, a partition's ``pending``
and ``first_seq`` come from the same server answer (a batched direct get: the message, with
``Nats-Num-Pending``, then an end-of-batch status); after it, ``pending`` is the listing's
count (a moment older) and the direct get is a plain one (one answer: half the messages for the
client to parse, which is most of a read's cost at thousands of partitions).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import nats.errors
from nats.aio.msg import Msg

from cg_pipelines.core.config import work_queue_stream_name
from cg_pipelines.core.errors import UsageError
from cg_pipelines.core.triggers import PartitionBacklog, pending_by_partition, use_subject_counts
from cg_pipelines.jetstream.api import JetStreamAPI, parse_rfc3339_ns
from cg_pipelines.jetstream.errors import (
    JetStreamError,
    JetStreamUnavailableError,
    RequestTimeoutError,
    StreamNotFoundError,
    error_from_status,
)

__all__ = ["DEFAULT_WINDOW", "DeadLetterSummary", "PartitionHolder", "dead_letter_counts",
           "first_pending", "latest_dead_letters", "partition_backlog", "partition_holders"]

DEFAULT_WINDOW = 256
"""Direct gets in flight at once (one reply subscription for all of them)."""

FirstPending = tuple[int, int, int]
"""``(sequence, store time in ns since the epoch, messages of the partition after it)``."""


async def partition_backlog(
    api: JetStreamAPI,
    stream: str,
    group: str,
    partitions: Iterable[int],
    *,
    window: int = DEFAULT_WINDOW,
) -> list[PartitionBacklog]:
    """Backlog of each partition, in the order given (see the module docstring for the reads).

    Raises:
        StreamNotFoundError: the work-queue stream is missing.
        RequestTimeoutError: a read got no (complete) answer within ``api.timeout`` seconds.
        JetStreamError: another API error.
    """
    parts = list(partitions)
    if not parts:
        return []
    wq = work_queue_stream_name(stream, group)
    now_ns = time.time_ns()
    state = (await api.stream_info(wq)).get("state") or {}
    if int(state.get("messages") or 0) <= 0:
        return [PartitionBacklog(p, 0, None, 0.0) for p in parts]
    ask = parts
    counts = None
    if use_subject_counts(int(state.get("num_subjects") or 0), len(parts)):
        listed = await api.stream_info(wq, subjects_filter=">")
        counts = pending_by_partition((listed.get("state") or {}).get("subjects") or {})
        ask = [p for p in parts if counts.get(p, 0) > 0]
    found = await first_pending(api, wq, ask, window=window, counts=counts)
    out = []
    for p in parts:
        hit = found.get(p)
        if hit is None:
            out.append(PartitionBacklog(p, 0, None, 0.0))
        else:
            seq, ts_ns, after = hit
            out.append(PartitionBacklog(p, 1 + after, seq, max(0.0, (now_ns - ts_ns) / 1e9),
                                        ts_ns / 1e9))
    return out


async def first_pending(
    api: JetStreamAPI, wq: str, partitions: Sequence[int], *, window: int = DEFAULT_WINDOW,
    counts: Mapping[int, int] | None = None,
) -> dict[int, FirstPending]:
    """The first stored message of each partition of work-queue stream ``wq``: one batched
    direct get per partition, all answered on one reply subscription, at most ``window`` in
    flight. Partitions with no message are absent from the result.

    With ``counts`` (``{partition: messages}``, e.g. from the stream's subject listing): one
    plain direct get per partition instead (one answer, not the message and an end-of-batch
    status: half the messages to parse), the messages after the first taken from ``counts``
    (at least 0).

    Raises:
        RequestTimeoutError: not every answer arrived within ``api.timeout`` seconds.
        JetStreamUnavailableError: no responders (stream missing or ``allow_direct`` off).
        JetStreamError: another error status, or a malformed answer.
        UsageError: ``window < 1``.
    """
    if window < 1:
        raise UsageError(f"window must be >= 1, got {window}")
    todo = list(dict.fromkeys(partitions))  # each partition once: its reply subject is its own
    if not todo:
        return {}
    nc = api.nc
    subject = f"{api.prefix}.DIRECT.GET.{wq}"
    inbox = nc.new_inbox()
    found: dict[int, FirstPending] = {}
    waiting = set(todo)
    slots = asyncio.Semaphore(window)
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def fail(err: BaseException) -> None:
        if not done.done():
            done.set_exception(err)
        slots.release()  # wake the sender, which then stops

    async def on_reply(msg: Msg) -> None:
        if done.done():
            return
        try:
            p = int(msg.subject.rpartition(".")[2])
            hdrs = msg.headers
            if not hdrs:
                raise JetStreamError(0, 0, f"direct get reply without headers from {subject}")
            status = hdrs.get("Status")
            if status is None:  # the message; in a batch, its end-of-batch status follows
                after = int(hdrs.get("Nats-Num-Pending") or 0) if counts is None else max(
                    0, counts.get(p, 1) - 1)
                found[p] = (int(hdrs["Nats-Sequence"]),
                            parse_rfc3339_ns(hdrs["Nats-Time-Stamp"]), after)
                if counts is None:
                    return
                status = "204"
            code = int(status)
            if code == 503:
                raise JetStreamUnavailableError(
                    503, 0, f"no responders for {subject}: stream {wq!r} missing or "
                    "allow_direct not enabled")
            if code not in (204, 404, 408):  # end of batch / nothing stored / expired
                raise error_from_status(code, hdrs.get("Description", ""))
            if p in waiting:
                waiting.discard(p)
                slots.release()
                if not waiting:
                    done.set_result(None)
        except (JetStreamError, KeyError, ValueError) as e:
            fail(e if isinstance(e, JetStreamError) else
                 JetStreamError(0, 0, f"malformed direct get reply from {subject}: {e!r}"))

    sub = await nc.subscribe(f"{inbox}.*", cb=on_reply)
    try:
        async with asyncio.timeout(api.timeout):
            for p in todo:
                await slots.acquire()
                if done.done():
                    break
                body = (json.dumps({"seq": 1, "next_by_subj": f"{p}.>", "batch": 1},
                                   separators=(",", ":")) if counts is None else
                        json.dumps({"seq": 1, "next_by_subj": f"{p}.>"},
                                   separators=(",", ":"))).encode()
                await nc.publish(subject, body, reply=f"{inbox}.{p}")
            await done
    except TimeoutError:
        raise RequestTimeoutError(subject, api.timeout) from None
    finally:
        if not done.done():
            done.cancel()
        if not nc.is_closed:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:  # best effort: the connection may be going away
                pass
    return found


@dataclass(frozen=True)
class PartitionHolder:
    """Who holds a partition of a work-queue stream: a consumer whose filter is the
    partition's (``<p>.>`` or ``<p>.<filter>``; a partition run's lease consumer is
    ``partition-<p>``, a streaming member's is named after the member).

    Attributes:
        consumer: the consumer's name.
        pinned_id: the ``PCG`` group's pinned client id (None: nobody pinned now).
        pinned_since: when it was pinned (RFC 3339, as the server reports it), or None.
        ack_pending: messages delivered and not acknowledged (1 while a run holds its lease).
    """

    consumer: str
    pinned_id: str | None
    pinned_since: str | None
    ack_pending: int


def _filters(cfg: dict[str, Any]) -> list[str]:
    subjects = list(cfg.get("filter_subjects") or [])
    if cfg.get("filter_subject"):
        subjects.append(str(cfg["filter_subject"]))
    return subjects


async def partition_holders(api: JetStreamAPI, wq: str, partitions: Iterable[int]
                            ) -> dict[int, list[PartitionHolder]]:
    """The consumers of each partition of work-queue stream ``wq`` (one consumer list
    request), pinned ones first. Partitions without a consumer are absent.

    Raises:
        StreamNotFoundError: no such stream.
    """
    wanted = set(partitions)
    out: dict[int, list[PartitionHolder]] = {}
    for info in await api.list_consumers(wq):
        cfg = info.get("config") or {}
        pin = None
        since = None
        for g in info.get("priority_groups") or []:
            if g.get("pinned_client_id"):
                pin, since = str(g["pinned_client_id"]), g.get("pinned_ts")
        holder = PartitionHolder(str(cfg.get("name") or cfg.get("durable_name") or info.get(
            "name")), pin, since, int(info.get("num_ack_pending") or 0))
        for flt in _filters(cfg):
            token = flt.split(".", 1)[0]
            if token.isdigit() and int(token) in wanted:
                lst = out.setdefault(int(token), [])
                if holder not in lst:
                    lst.append(holder)
    for lst in out.values():
        lst.sort(key=lambda h: (h.pinned_id is None, h.consumer))
    return out


@dataclass(frozen=True, slots=True)
class DeadLetterSummary:
    """One partition's dead letters: how many the dead-letter stream holds, and the latest
    one's sequence there, source sequence (``Cg-Sequence``), reason (``Cg-Error``) and store
    time (ns since the epoch). The ``latest_*`` fields are ``None``/0 when ``count`` is 0."""

    partition: int
    count: int
    latest_seq: int | None = None
    latest_source_seq: int | None = None
    latest_reason: str | None = None
    latest_time_ns: int = 0


async def dead_letter_counts(api: JetStreamAPI, dlq_stream: str) -> dict[int, int]:
    """``{partition: dead letters held}`` of dead-letter stream ``dlq_stream`` (subjects
    ``<dlq_stream>.<partition>``): one ``STREAM.INFO`` with a subject filter, whatever the
    number of messages (its size grows with the partitions that hold dead letters). A missing
    stream (nothing ever dead-lettered) reads as none. Halt notes
    (``<dlq_stream>.halted.<partition>``, :mod:`cg_pipelines.engine.deadletter`) are not dead
    letters: the filter ``<dlq_stream>.*`` matches one token only.

    Raises:
        JetStreamError, RequestTimeoutError: the request fails.
    """
    try:
        info = await api.stream_info(dlq_stream, subjects_filter=f"{dlq_stream}.*")
    except StreamNotFoundError:
        return {}
    out: dict[int, int] = {}
    for subject, n in ((info.get("state") or {}).get("subjects") or {}).items():
        token = subject[len(dlq_stream) + 1:]
        if subject.startswith(dlq_stream + ".") and token.isdigit():
            out[int(token)] = out.get(int(token), 0) + int(n)
    return out


async def latest_dead_letters(api: JetStreamAPI, dlq_stream: str,
                              counts: Mapping[int, int]) -> list[DeadLetterSummary]:
    """A :class:`DeadLetterSummary` per partition of ``counts`` (from
    :func:`dead_letter_counts`): one leader read (``last_by_subj``) per partition with dead
    letters; ask only for the partitions whose count changed.

    Raises:
        JetStreamError, RequestTimeoutError: a read fails.
    """
    out = []
    for p, n in sorted(counts.items()):
        if n <= 0:
            out.append(DeadLetterSummary(p, 0))
            continue
        msg = await api.msg_get(dlq_stream, last_by_subj=f"{dlq_stream}.{p}")
        if msg is None:
            out.append(DeadLetterSummary(p, 0))
            continue
        h = dict(msg.headers or {})
        src = h.get("Cg-Sequence", "")
        out.append(DeadLetterSummary(p, n, msg.seq, int(src) if src.isdigit() else None,
                                     h.get("Cg-Error"), msg.time_ns))
    return out
