"""Dead-letter stream ``<stream>-<group>-dlq`` for messages the processing step rejects.

Each dead letter keeps the original payload and headers and adds ``Cg-Origin-Stream``,
``Cg-Stream`` (the stream it was read from), ``Cg-Sequence``, ``Cg-Subject`` (partition token
stripped), ``Cg-Partition`` and ``Cg-Error``. It is published with ``Nats-Msg-Id =
<stream read from>:<sequence>`` so a batch re-processed after a crash or by a newer holder
dead-letters each message once (within the stream's duplicate window, default 7 days).

A run stopped by ``dead_letter_policy="halt"`` leaves a **halt note** (no payload) on
``<stream>-<group>-dlq.halted.<partition>``: the work-queue sequence it halted at and why
(``Cg-Sequence``, ``Cg-Error``), at most one per partition (the newest). ``cg halt skip`` reads
it so the dead letter keeps the original error next to the operator's reason, then deletes it.
Dead letters themselves are on ``<stream>-<group>-dlq.<partition>`` (one token): listing and
purging dead letters never meets a halt note.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from nats.js import JetStreamContext

from cg_pipelines.core.config import dlq_stream_name, work_queue_stream_name
from cg_pipelines.core.errors import ContractError, DecodeError, UsageError
from cg_pipelines.core.reconcile import ORIGIN_SEQ_HEADER, REPLAY_OF_HEADER
from cg_pipelines.engine.processor import DeadLetter
from cg_pipelines.jetstream.api import JetStreamAPI, StoredMessage, seconds_to_ns
from cg_pipelines.jetstream.errors import (
    ERR_NO_MESSAGE_FOUND,
    JetStreamError,
    NoMessageFoundError,
    StreamNotFoundError,
)

DLQ_DUPLICATE_WINDOW_S = 7 * 24 * 3600.0

DLQ_MAX_AGE_S = 30 * 24 * 3600.0
"""Default retention of the dead-letter stream (seconds): dead letters older than 30 days are
dropped by the server (``max_age``); ``EngineOptions.dlq_max_age_s`` sets it per run."""


def source_seq(headers: dict[str, str] | None) -> int | None:
    """The origin sequence in a sourced message's ``Nats-Stream-Source`` header
    (``<origin stream> <origin seq> ...``), or None."""
    parts = (headers or {}).get("Nats-Stream-Source", "").split(" ")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


async def ensure_dlq_stream(
    api: JetStreamAPI, stream: str, group: str, *, replicas: int | None = None,
    duplicate_window_s: float = DLQ_DUPLICATE_WINDOW_S,
    max_age_s: float | None = DLQ_MAX_AGE_S,
) -> str:
    """Create the dead-letter stream if missing (subjects ``<name>.>``); returns its name.

    ``max_age_s`` bounds how long dead letters are kept (seconds; ``None``: for ever); an
    existing stream with another ``max_age`` is updated to it (best effort, like replicas).
    The duplicate window is cut to ``max_age_s`` when longer (the server requires it).

    ``replicas`` defaults to the origin stream's replica count (the work queue's when the
    origin cannot be read), so on a cluster the dead letters survive a node as the group's
    other streams do. An existing dead-letter stream with fewer replicas (made by an earlier
    version, always R1) is updated to that count; when the update is refused (e.g. a node is
    down) the stream is used as it is and the next run tries again.

    Raises:
        JetStreamError: the stream cannot be read or created (503 while it has no leader).
    """
    name = dlq_stream_name(stream, group)
    try:
        info: dict[str, Any] | None = await api.stream_info(name)
    except JetStreamError as e:
        if e.status != 404:
            raise
        info = None
    want = replicas if replicas is not None else await group_replicas(api, stream, group)
    max_age = seconds_to_ns(max_age_s) if max_age_s else 0
    window = seconds_to_ns(min(duplicate_window_s, max_age_s) if max_age_s
                           else duplicate_window_s)
    if info is None:
        await api.create_stream({
            "name": name, "subjects": [f"{name}.>"], "storage": "file",
            "num_replicas": want, "retention": "limits", "max_age": max_age,
            "duplicate_window": window, "allow_direct": True,
        })
        return name
    config = dict(info.get("config") or {})
    changed = False
    if int(config.get("num_replicas") or 1) < want:
        config["num_replicas"], changed = want, True
    if int(config.get("max_age") or 0) != max_age:
        config["max_age"], changed = max_age, True
        if max_age and int(config.get("duplicate_window") or 0) > max_age:
            config["duplicate_window"] = max_age
    if changed:
        with contextlib.suppress(JetStreamError):
            await api.update_stream(config)
    return name


async def group_replicas(api: JetStreamAPI, stream: str, group: str) -> int:
    """The replica count a group's streams should carry: the origin stream's, else its
    work-queue stream's, else 1 when neither exists (both answer 404).

    Raises:
        JetStreamError: neither stream could be read for another reason (a timeout, 503 while
            a leader is elected): guessing 1 there would create an R1 stream on a cluster
            that the caller never raises again, so the caller retries instead.
    """
    last: JetStreamError | None = None
    for name in (stream, work_queue_stream_name(stream, group)):
        try:
            info = await api.stream_info(name)
        except JetStreamError as e:
            if e.status != 404:
                last = e
            continue
        return max(1, int((info.get("config") or {}).get("num_replicas") or 1))
    if last is not None:
        raise last
    return 1


def dead_letter_headers(
    user_headers: dict[str, str] | None, *, origin_stream: str, read_stream: str, seq: int,
    subject: str, partition: int, reason: str, origin_seq: int | None = None,
) -> dict[str, str]:
    """The headers a dead letter is stored with: the message's own headers (``Nats-*`` ones
    dropped), then ``Nats-Msg-Id = <read_stream>:<seq>`` (each message dead-lettered once,
    whoever does it: a run or ``cg halt``), ``Cg-Origin-Stream``, ``Cg-Stream``,
    ``Cg-Sequence``, ``Cg-Subject`` (partition token stripped), ``Cg-Partition``,
    ``Cg-Error`` (``reason`` on one line, at most 1,000 characters) and, when known,
    ``Cg-Origin-Sequence`` (the origin stream sequence: reconciliation counts the message as
    having reached the work queue)."""
    headers = {k: v for k, v in (user_headers or {}).items() if not k.startswith("Nats-")}
    headers.update({
        "Nats-Msg-Id": f"{read_stream}:{seq}",
        "Cg-Origin-Stream": origin_stream,
        "Cg-Stream": read_stream,
        "Cg-Sequence": str(seq),
        "Cg-Subject": subject,
        "Cg-Partition": str(partition),
        "Cg-Error": " ".join(reason.split())[:1000],
    })
    if origin_seq is not None:
        headers[ORIGIN_SEQ_HEADER] = str(origin_seq)
    return headers


async def publish_dead_letters(
    js: JetStreamContext,
    *,
    origin_stream: str,
    read_stream: str,
    group: str,
    partition: int,
    batch: pa.Table,
    dead: Sequence[DeadLetter],
    timeout: float = 5.0,
) -> int:
    """Publish each dead letter (awaiting the stream's acks). Returns how many were stored.

    ``batch`` is the batch the dead letters came from
    (:data:`~cg_pipelines.core.record.RECORD_SCHEMA`: its ``data``, ``subject`` and user
    ``headers`` are what is published).

    Raises ``ContractError`` if a dead letter names a sequence not in ``batch`` (the processing
    step must only reject messages it was given).
    """
    index = {seq: i for i, seq in enumerate(batch["seq"].to_pylist())}
    name = dlq_stream_name(origin_stream, group)
    acks = []
    for d in dead:
        i = index.get(d.seq)
        if i is None:
            raise ContractError(f"dead letter for sequence {d.seq} which is not in the batch")
        raw = batch["headers"][i].as_py()
        headers = dead_letter_headers(
            dict(json.loads(raw)) if raw else None, origin_stream=origin_stream,
            read_stream=read_stream, seq=d.seq, subject=batch["subject"][i].as_py(),
            partition=partition, reason=d.reason, origin_seq=batch["origin_seq"][i].as_py())
        acks.append(await js.publish_async(f"{name}.{partition}", batch["data"][i].as_py(),
                                           headers=headers))
    if acks:
        await asyncio.wait_for(asyncio.gather(*acks), timeout)
    return len(acks)


# --------------------------------------------------------------------------------------------
# Operator tools (``cg dlq ...``, ``cg halt``): list, show, replay, purge, skip a message
# --------------------------------------------------------------------------------------------

REPLAY_HEADER = "Cg-Replayed-From"
"""Header of a replayed message in the origin stream: ``<dead-letter stream>:<sequence>``."""



@dataclass(frozen=True)
class StoredDeadLetter:
    """A message stored in the dead-letter stream.

    Attributes:
        seq: its sequence in the dead-letter stream.
        subject: its subject there (``<stream>-<group>-dlq.<partition>``).
        partition: ``Cg-Partition`` (None when missing).
        source_stream, source_seq: where it was read (``Cg-Stream``, ``Cg-Sequence``: the
            work-queue stream and sequence for an elastic group).
        origin_subject: ``Cg-Subject``, the subject it was published on.
        reason: ``Cg-Error``.
        skip_reason: ``Cg-Skip-Reason`` (moved by ``cg halt skip``: the operator's reason), or
            None.
        time_ns: when it was dead-lettered, ns since the epoch.
        headers: all its headers (server ``Nats-*`` ones included when read from the leader).
        data: the payload, as published.
    """

    seq: int
    subject: str
    partition: int | None
    source_stream: str | None
    source_seq: int | None
    origin_subject: str | None
    reason: str | None
    time_ns: int
    headers: dict[str, str]
    data: bytes

    @property
    def skip_reason(self) -> str | None:
        """``Cg-Skip-Reason``: why an operator moved it here (``cg halt skip``), or None."""
        return self.headers.get(SKIP_REASON_HEADER)

    @classmethod
    def of(cls, msg: StoredMessage) -> StoredDeadLetter:
        h = dict(msg.headers or {})
        part, src_seq = h.get("Cg-Partition"), h.get("Cg-Sequence")
        return cls(msg.seq, msg.subject, int(part) if part and part.isdigit() else None,
                   h.get("Cg-Stream"), int(src_seq) if src_seq and src_seq.isdigit() else None,
                   h.get("Cg-Subject"), h.get("Cg-Error"), msg.time_ns, h, msg.data)

    def preview(self, limit: int = 120) -> str:
        """The payload's first ``limit`` bytes as text (invalid UTF-8 and control characters
        escaped, ``…`` when cut)."""
        head = self.data[:limit].decode("utf-8", "backslashreplace")
        head = "".join(c if c.isprintable() else repr(c)[1:-1] for c in head)
        return head + ("…" if len(self.data) > limit else "")

    def as_dict(self, preview_bytes: int = 120) -> dict[str, Any]:
        """JSON-ready fields (``payload_preview`` instead of the payload, ``size`` in bytes,
        ``time`` as RFC 3339)."""
        return {
            "seq": self.seq, "subject": self.subject, "partition": self.partition,
            "source_stream": self.source_stream, "source_seq": self.source_seq,
            "origin_subject": self.origin_subject, "reason": self.reason,
            "skip_reason": self.skip_reason,
            "time": _rfc3339(self.time_ns), "headers": self.headers, "size": len(self.data),
            "payload_preview": self.preview(preview_bytes),
        }


def _rfc3339(ns: int) -> str:
    return datetime.datetime.fromtimestamp(ns / 1e9, datetime.UTC).isoformat().replace(
        "+00:00", "Z")


HALT_TOKEN = "halted"
SKIP_REASON_HEADER = "Cg-Skip-Reason"
"""Header of a dead letter moved by ``cg halt skip``: the operator's reason (``Cg-Error``
keeps the error the run halted with, when its halt note was found)."""


def halt_note_subject(stream: str, group: str, partition: int) -> str:
    """``<stream>-<group>-dlq.halted.<partition>``: where a halted run notes why."""
    return f"{dlq_stream_name(stream, group)}.{HALT_TOKEN}.{partition}"


async def record_halt(js: JetStreamContext, api: JetStreamAPI, *, origin_stream: str,
                      read_stream: str, group: str, partition: int, seq: int, reason: str,
                      timeout: float = 5.0) -> None:
    """Leave the partition's halt note: it halted at ``seq`` of ``read_stream`` because of
    ``reason`` (one line, at most 1,000 characters). ``Nats-Msg-Id = halted:<read_stream>:
    <seq>``: a retried run halting at the same message stores it once; older notes of the
    partition are purged (at most one per partition). The dead-letter stream must exist.

    Raises:
        JetStreamError / TimeoutError: the publish or the purge failed.
    """
    subject = halt_note_subject(origin_stream, group, partition)
    await js.publish(subject, b"", timeout=timeout, headers={
        "Nats-Msg-Id": f"halted:{read_stream}:{seq}", "Cg-Stream": read_stream,
        "Cg-Sequence": str(seq), "Cg-Partition": str(partition),
        "Cg-Error": " ".join(reason.split())[:1000]})
    await api.purge(dlq_stream_name(origin_stream, group), filter=subject, keep=1)


async def halt_note(api: JetStreamAPI, stream: str, group: str, partition: int,
                    seq: int) -> StoredMessage | None:
    """The partition's halt note when it is about work-queue sequence ``seq``, else None
    (also when the group has no dead-letter stream)."""
    try:
        got = await api.msg_get(dlq_stream_name(stream, group),
                                last_by_subj=halt_note_subject(stream, group, partition))
    except StreamNotFoundError:
        return None
    if got is None or (got.headers or {}).get("Cg-Sequence") != str(seq):
        return None
    return got


async def list_dead_letters(
    api: JetStreamAPI, stream: str, group: str, *, partition: int | None = None,
    start_seq: int = 1, limit: int = 100,
) -> list[StoredDeadLetter]:
    """Dead letters of a group in stream order from ``start_seq`` (at most ``limit``), all
    partitions or one. Batched direct gets (a replica may answer a little behind the leader).

    Raises:
        StreamNotFoundError: the group has no dead-letter stream (nothing was ever
            dead-lettered, or the group does not exist).
        JetStreamError: another API error.
    """
    name = dlq_stream_name(stream, group)
    await api.stream_info(name)  # a clear StreamNotFoundError rather than no responders
    subject = f"{name}.{partition}" if partition is not None else f"{name}.*"
    out: list[StoredDeadLetter] = []
    seq = max(1, start_seq)
    while len(out) < limit:
        got = await api.direct_get_batch(name, seq, subject, min(256, limit - len(out)))
        if not got:
            break
        out.extend(StoredDeadLetter.of(m) for m in got)
        seq = got[-1].seq + 1
    return out


async def get_dead_letter(api: JetStreamAPI, stream: str, group: str,
                          seq: int) -> StoredDeadLetter:
    """One dead letter, read from the stream's leader (all headers).

    Raises:
        NoMessageFoundError: no message at ``seq`` (err_code 10037).
        StreamNotFoundError: no dead-letter stream.
    """
    name = dlq_stream_name(stream, group)
    got = await api.msg_get(name, seq=seq)
    if got is None:
        raise NoMessageFoundError(404, ERR_NO_MESSAGE_FOUND,
                                  f"no dead letter at sequence {seq} in {name}")
    return StoredDeadLetter.of(got)


@dataclass(frozen=True)
class Replayed:
    """A dead letter published again into the origin stream: its dead-letter sequence, the
    subject, and the new origin stream sequence (None when the origin's duplicate window
    recognised an earlier replay of it)."""

    dlq_seq: int
    subject: str
    origin_seq: int | None


async def replay_dead_letter(js: JetStreamContext, api: JetStreamAPI, stream: str, group: str,
                             seq: int, *, timeout: float = 5.0) -> Replayed:
    """Publish dead letter ``seq`` again on its original subject into the origin ``stream``
    (payload and the message's own headers; ``Cg-*`` dropped, ``Cg-Replayed-From`` added,
    ``Nats-Msg-Id = replay:<dlq>:<seq>`` so a repeated replay within the origin's duplicate
    window stores it once), then delete it from the dead-letter stream.

    Ordering: the replayed message gets a new, later origin sequence, so it is processed after
    every message of its partition already in the stream — after later events of its own key.

    Raises:
        NoMessageFoundError: no dead letter at ``seq``.
        DecodeError: the dead letter has no ``Cg-Subject`` (not made by this library).
        JetStreamError: the publish or delete failed (a failed delete leaves the dead letter
            in place; replaying it again is de-duplicated by the origin).
    """
    dead = await get_dead_letter(api, stream, group, seq)
    if not dead.origin_subject:
        raise DecodeError(f"dead letter {seq} of {dlq_stream_name(stream, group)} has no "
                          "Cg-Subject header: cannot tell where to replay it")
    headers = {k: v for k, v in dead.headers.items()
               if not k.startswith(("Cg-", "Nats-"))}
    name = dlq_stream_name(stream, group)
    headers[REPLAY_HEADER] = f"{name}:{seq}"
    if dead.headers.get(ORIGIN_SEQ_HEADER, "").isdigit():
        headers[REPLAY_OF_HEADER] = dead.headers[ORIGIN_SEQ_HEADER]
    headers["Nats-Msg-Id"] = f"replay:{name}:{seq}"
    ack = await js.publish(dead.origin_subject, dead.data, timeout=timeout, stream=stream,
                           headers=headers)
    await api.delete_msg(name, seq)
    return Replayed(seq, dead.origin_subject, None if ack.duplicate else ack.seq)


async def purge_dead_letters(api: JetStreamAPI, stream: str, group: str, *,
                             partition: int | None = None, seq: int | None = None) -> int:
    """Remove dead letters: one (``seq``), one partition's, or all. Returns how many.

    Raises:
        StreamNotFoundError: no dead-letter stream.
    """
    name = dlq_stream_name(stream, group)
    if seq is not None:
        return 1 if await api.delete_msg(name, seq) else 0
    return await api.purge(name, filter=f"{name}.{partition}" if partition is not None
                           else f"{name}.*")


@dataclass(frozen=True)
class Skipped:
    """A message moved from a partition's work queue to the dead-letter stream by an operator
    (``cg halt``): its work-queue sequence, subject (partition token stripped) and its
    sequence in the dead-letter stream (None when an earlier attempt stored it already)."""

    partition: int
    seq: int
    subject: str
    dlq_seq: int | None


async def skip_message(
    js: JetStreamContext, api: JetStreamAPI, stream: str, group: str, partition: int,
    reason: str, *, seq: int | None = None, timeout: float = 5.0,
) -> Skipped:
    """Move the message a partition halted at into the dead-letter stream, so the partition's
    next run goes on after it.

    ``seq`` is the work-queue sequence (a halted run's ``halted_at``); ``None`` takes the
    partition's first pending message. The message is read from the stream's leader, checked
    to belong to ``partition``, stored as a dead letter (the same ``Nats-Msg-Id`` a run would
    use: never twice) with ``Cg-Skip-Reason = reason`` and ``Cg-Error`` = the error the run
    halted with (from its halt note, :func:`record_halt`; ``reason`` when there is none), and
    deleted from the work queue (the halt note too). It stays in the origin stream.

    Raises:
        NoMessageFoundError: the partition has no pending message, or none at ``seq``.
        UsageError: the message at ``seq`` belongs to another partition; empty ``reason``.
        JetStreamError: an API failure (nothing deleted unless the dead letter was stored).
    """
    if not reason.strip():
        raise UsageError("a reason is required (it is stored as the dead letter's Cg-Error)")
    wq = work_queue_stream_name(stream, group)
    if seq is None:
        got = await api.msg_get(wq, seq=1, next_by_subj=f"{partition}.>")
        if got is None:
            raise NoMessageFoundError(404, ERR_NO_MESSAGE_FOUND,
                                      f"partition {partition} of {wq} has no pending message")
    else:
        got = await api.msg_get(wq, seq=seq)
        if got is None:
            raise NoMessageFoundError(404, ERR_NO_MESSAGE_FOUND,
                                      f"no message at sequence {seq} in {wq} (already removed?)")
    token, _, rest = got.subject.partition(".")
    if token != str(partition):
        raise UsageError(f"sequence {got.seq} of {wq} is in partition {token}, not {partition}")
    await ensure_dlq_stream(api, stream, group)
    note = await halt_note(api, stream, group, partition, got.seq)
    halted_with = (note.headers or {}).get("Cg-Error") if note is not None else None
    headers = dead_letter_headers(got.headers, origin_stream=stream, read_stream=wq,
                                  seq=got.seq, subject=rest, partition=partition,
                                  reason=halted_with or reason,
                                  origin_seq=source_seq(got.headers))
    headers[SKIP_REASON_HEADER] = " ".join(reason.split())[:1000]
    ack = await js.publish(f"{dlq_stream_name(stream, group)}.{partition}", got.data,
                           timeout=timeout, headers=headers)
    await api.delete_msg(wq, got.seq)
    if note is not None:
        with contextlib.suppress(JetStreamError):
            await api.delete_msg(dlq_stream_name(stream, group), note.seq)
    return Skipped(partition, got.seq, rest, None if ack.duplicate else ack.seq)
