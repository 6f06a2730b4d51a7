"""Publish many messages to a stream fast, every one acknowledged: a window of pending JetStream
acks, collected and checked in bulk.

``js.publish_async`` makes a future, an inbox token and a nats-py ``Msg`` per message and per
ack; here every message is a plain ``PUB`` with the same reply inbox, and the acks (``{"stream":
..., "seq": ...}``, or ``{"error": ...}``) are cut out of the socket stream by the bulk frame
cutter of :mod:`cg_pipelines.jetstream.frames` (through the range-read parser's
:func:`~cg_pipelines.jetstream.rangeparser.attach`) and parsed as one Arrow table per window.
Messages are sent in order on one connection, so the stream stores them in order; the acks say
where.
"""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson
from nats.aio.client import Client

from cg_pipelines.core.errors import UsageError
from cg_pipelines.jetstream.errors import JetStreamError, RequestTimeoutError
from cg_pipelines.jetstream.frames import GenericReply
from cg_pipelines.jetstream.rangeparser import attach, fast_path_available

__all__ = ["PublishError", "publish_many"]


class PublishError(JetStreamError):
    """A message was not stored: the ack carried an error, or came from another stream."""


class _Acks(GenericReply):
    __slots__ = ("payloads", "arrived")

    def __init__(self) -> None:
        super().__init__()
        self.payloads: list[bytes] = []
        self.arrived: asyncio.Event | None = None

    def on_frame(self, parts: list[bytes], header: bytes | None, payload: bytes) -> None:
        self.payloads.append(payload)
        if self.arrived is not None:
            self.arrived.set()


_ACK_SCHEMA = pa.schema([("stream", pa.string()), ("seq", pa.int64())])


def _check(payloads: list[bytes], stream: str | None) -> pa.Array:
    """The sequences of a window of acks, in order. Raises PublishError for any error ack."""
    buf = b"\n".join(payloads)
    try:
        table = pajson.read_json(io.BytesIO(buf), parse_options=pajson.ParseOptions(
            explicit_schema=_ACK_SCHEMA, unexpected_field_behavior="ignore"),
            read_options=pajson.ReadOptions(use_threads=False, block_size=len(buf) + 1))
    except pa.ArrowException as e:
        raise PublishError(0, 0, f"unreadable publish ack: {e}") from None
    if table.num_rows != len(payloads) or table["seq"].null_count:
        bad = next((p for p in payloads if b'"error"' in p or b'"seq"' not in p), payloads[0])
        raise PublishError(0, 0, f"a message was not stored: {bad[:300]!r}")
    if stream is not None and not pc.all(pc.equal(table["stream"], stream)).as_py():
        raise PublishError(0, 0, f"a message was stored by another stream than {stream!r}")
    return table["seq"].combine_chunks()


async def publish_many(
    nc: Client,
    subjects: Sequence[str],
    payloads: Sequence[bytes],
    *,
    stream: str | None = None,
    window: int = 10_000,
    timeout_s: float = 30.0,
    progress: object = None,
) -> pa.Array:
    """Publish ``payloads[i]`` to ``subjects[i]``, in order, each acknowledged by JetStream.

    At most ``window`` messages are unacknowledged at a time; each window's acks are parsed in
    one ``pyarrow.json`` call. ``progress(done, total)`` (optional) is called after each
    window.

    Args:
        nc: a connected nats-py client (2.16; other versions use ``js.publish`` per message).
        stream: when given, every ack must come from this stream.
        timeout_s: seconds to wait for a window's acks.

    Returns:
        The stream sequences (int64), in publish order.

    Raises:
        PublishError: an ack carried an error or named another stream (what was acknowledged
            before it is stored; nothing after it was sent).
        RequestTimeoutError: a window's acks did not all come within ``timeout_s``.
        UsageError: ``subjects`` and ``payloads`` differ in length, or ``window < 1``.
    """
    if len(subjects) != len(payloads):
        raise UsageError("subjects and payloads must have the same length")
    if window < 1:
        raise UsageError("window must be >= 1")
    total = len(payloads)
    if not fast_path_available(nc):
        js = nc.jetstream(timeout=timeout_s)
        seqs = []
        for i, (s, p) in enumerate(zip(subjects, payloads, strict=True)):
            ack = await js.publish(s, p, stream=stream)
            seqs.append(ack.seq)
            if progress is not None and (i + 1) % window == 0:
                progress(i + 1, total)  # type: ignore[operator]
        return pa.array(seqs, pa.int64())
    acks = _Acks()
    acks.arrived = asyncio.Event()
    out: list[pa.Array] = []
    with attach(nc) as conn:
        box = await conn.acquire(nc)
        conn.sinks[box.sid] = acks
        try:
            for start in range(0, total, window):
                end = min(start + window, total)
                for i in range(start, end):
                    await nc.publish(subjects[i], payloads[i], reply=box.subject)
                await nc.flush(timeout=timeout_s)  # type: ignore[arg-type]  # nats-py hints int; a float works (asyncio.wait_for)
                deadline = time.monotonic() + timeout_s
                while len(acks.payloads) < end - start:
                    acks.arrived.clear()
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise RequestTimeoutError(f"acks of {end - start} messages", timeout_s)
                    try:
                        await asyncio.wait_for(acks.arrived.wait(), min(left, 1.0))
                    except TimeoutError:
                        continue
                got, acks.payloads = acks.payloads, []
                out.append(_check(got, stream))
                if progress is not None:
                    progress(end, total)  # type: ignore[operator]
        finally:
            conn.sinks.pop(box.sid, None)
            await conn.release(nc, box, clean=not acks.payloads)
    return pa.concat_arrays(out) if out else pa.array([], pa.int64())
