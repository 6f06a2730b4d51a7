"""Fast range reads of a stream (batched direct get) parsed in bulk into Arrow columns.

An elastic group's batch run reads one partition's range of the work-queue stream
``<stream>-<group>`` (subjects ``<p>.<origin subject>``) without consuming it (the "range" step
of the partition engine's lease-and-range algorithm). A consumer cannot do that (the partition's
lease consumer already holds the filter ``<p>.>`` and a work-queue stream refuses overlapping
consumers), so the range is read with batched direct gets: ``$JS.API.DIRECT.GET.<stream>`` with
``{"seq", "next_by_subj", "batch", "max_bytes"}``. :func:`read_range` does that and returns a
:class:`RangeBatch` of Arrow arrays, without a nats-py ``Msg``, a dict or a dataclass per
message on the way.

Wire format (nats-server 2.15.1, checked): each hit is an ``HMSG`` to the request's reply inbox
whose header block is the stored message's own headers followed by the direct-get ones the
server appends, in this order::

    NATS/1.0\\r\\n
    <the message's own headers, e.g. Nats-Stream-Source: ORIGIN 17 flt dest subj ident>\\r\\n
    Nats-Stream: <stream>\\r\\n
    Nats-Subject: <subject>\\r\\n
    Nats-Sequence: <seq>\\r\\n
    Nats-Time-Stamp: <RFC 3339, nanoseconds, UTC>\\r\\n
    Nats-Num-Pending: <matching messages after this one, at request time>\\r\\n
    Nats-Last-Sequence: <the previous hit's sequence, 0 for the first>\\r\\n
    \\r\\n

and the reply ends with a status frame ``NATS/1.0 204 EOB`` (``Nats-Num-Pending``,
``Nats-Last-Sequence`` headers), or ``NATS/1.0 404 Message Not Found`` alone when nothing at or
after ``seq`` matches; a sourced message's ``Nats-Stream-Source`` value is ``<origin stream>
<origin seq> <source filter> <transform destination> <origin subject>[ <ident>]``.

How it is fast: while at least one range read is in flight on a connection, that connection's
protocol parser (``nc._ps``, nats-py 2.16) is replaced *on that client instance only* by
:class:`~cg_pipelines.jetstream.rangeparser.RangeParser` (attached by
:func:`~cg_pipelines.jetstream.rangeparser.attach`). Its
:class:`~cg_pipelines.jetstream.frames.FrameCutter` cuts complete frames out of each socket read
with ``bytes.find`` and slicing (offsets into one buffer per read, never a delete from the front
of a buffer), keeps the frames of the range-read reply inboxes (three byte strings per hit: the
message's own header lines, the direct-get header lines, the payload) and hands every other
frame, unchanged and in order, to nats-py's own parser (subscriptions, requests, PING/PONG, INFO,
-ERR behave as before). Partial frames and parser state are carried over both ways when the
parser is installed and put back, and it is put back as soon as no range read is in flight.
Every :data:`COLUMNIZE_EVERY` hits, while the rest of the reply is still arriving, the waiting
task turns the collected hits into Arrow arrays in bulk
(:func:`~cg_pipelines.jetstream.columns.reply_columns`: ``split_pattern`` and casts for the
direct-get headers, a vectorised check for the common own-headers block ``Nats-Stream-Source:
...``; only other own headers take nats-py's header parser, message by message), so the client's
parsing overlaps the server's sending. Importing this module changes nothing: no nats-py class
or module is patched. With another nats-py version (or a parser this module does not know on the
client) :func:`read_range` falls back to :meth:`JetStreamAPI.direct_get_batch` and builds the
same arrays.

Choosing the read (``bench/range_read.py``, nats-server 2.15.1 on the same 2-core machine,
200,000 sourced messages, 8 partitions): one request per range (``batch`` = the range size,
20,000) beats chunks of 2,000 sent one after another (each request costs the server a fixed
setup, and the server idles during the round trips) and chunks pipelined by sequence windows (no
faster, and a batched direct get has no upper sequence bound, so windows over-read on sparse
partitions). Filter on the server (``next_by_subj="<p>.>"``): an unfiltered read (``">"``)
sends every partition's messages and costs the server and the client per *sent* message, so it
only pays (by a few per cent) when the partition holds nearly all (>~90 %) of the range. The
server's own cost dominates: about 10-15 µs of server CPU per sourced message (its direct-get
header generation for messages that carry headers), against about 4-5 µs of client CPU here.

Errors: a request without an answer, or whose reply stalls before its end-of-batch status, for
``timeout_s`` seconds raises :class:`RequestTimeoutError`; no responders (stream missing or
``allow_direct`` off) and a connection lost during a read raise
:class:`JetStreamUnavailableError`; a connection closed by its owner raises nats-py's
``ConnectionClosedError``; other statuses raise :func:`error_from_status`'s typed error. A
range is never truncated silently: either it ends at one of the limits documented on
:func:`read_range`, or the call raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from nats.aio import client as nats_client  # noqa: F401 - re-exported (tests patch its version)
from nats.aio.client import Client

from cg_pipelines.core.errors import UsageError
from cg_pipelines.core.record import record_schema
from cg_pipelines.jetstream.api import DEFAULT_PREFIX, JetStreamAPI
from cg_pipelines.jetstream.columns import (
    Columns,
    header_columns,
    int_or_none,
    reply_columns,
    stored_columns,
    strip_prefix,
)
from cg_pipelines.jetstream.errors import JetStreamUnavailableError, error_from_status
from cg_pipelines.jetstream.frames import FrameCutter, GenericReply, Reply, parse_status
from cg_pipelines.jetstream.rangeparser import (
    SUPPORTED_NATS_PY,
    RangeConnection,
    RangeParser,
    connection,
    direct_get_reply,
    fast_path_available,
)

__all__ = [
    "MAX_REQUEST_BYTES",
    "RANGE_SCHEMA",
    "SUPPORTED_NATS_PY",
    "FrameCutter",
    "GenericReply",
    "RangeBatch",
    "Reply",
    "direct_get_reply",
    "fast_path_available",
    "parse_status",
    "read_range",
    "reply_columns",
]

# The names these had before the frames / columns / parser code moved to their own modules
# (tests and benchmarks still use them).
_Columns = Columns
_Conn = RangeConnection
_RangeParser = RangeParser
_conn = connection
_header_columns = header_columns

#: Arrow schema of :meth:`RangeBatch.table`: the record schema of
#: :mod:`cg_pipelines.core.record`, ``origin_seq`` included.
RANGE_SCHEMA = record_schema()

#: The same without ``origin_seq`` (what :meth:`RangeBatch.table` gives by default).
_RECORD_SCHEMA_NO_ORIGIN = record_schema(origin=False)

#: Most bytes one direct-get request asks for. The server queues a whole reply for the client
#: and cuts off a client whose pending output passes its ``max_pending`` (64 MiB by default),
#: so a request (and everything in flight on one connection) must stay well below that.
MAX_REQUEST_BYTES = 16 * 1024 * 1024

#: A reply's frames are turned into Arrow columns every this many messages while the rest is
#: still arriving, so that the client's parsing overlaps the server's sending.
COLUMNIZE_EVERY = 4096


@dataclass(frozen=True)
class RangeBatch:
    """One partition's range, as Arrow arrays of equal length, in sequence order.

    Attributes:
        seq: int64 stream sequences, ascending.
        subject: string subjects, ``prefix`` stripped.
        time: timestamp[ns, UTC] store times.
        headers: string: the message's own headers (direct-get headers removed; every
            ``Nats-*`` header with ``drop_nats_headers``) as ``json.dumps`` of nats-py's header
            dict, or null when none are left.
        origin_seq: int64: the origin stream sequence from ``Nats-Stream-Source``, or null.
        data: binary payloads.
        num_pending: ``Nats-Num-Pending`` of the last message (messages matching the request's
            filter after it, counted when that request was served); ``None`` when empty.
        ended: True when the range is exhausted: nothing more matched at or below ``last_seq``
            (or at all, without ``last_seq``) when the read ran; False when ``max_msgs`` or
            ``max_bytes`` cut it short.
        next_seq: where the next read of the partition starts: everything of it in
            ``[from_seq, next_seq)`` (up to ``last_seq``) is in this batch.
        requests: direct-get requests sent.
        scanned: hits received (an unfiltered read counts other partitions' messages too).
    """

    seq: pa.Array
    subject: pa.Array
    time: pa.Array
    headers: pa.Array
    origin_seq: pa.Array
    data: pa.Array
    num_pending: int | None
    ended: bool
    next_seq: int
    requests: int = 0
    scanned: int = 0

    def __len__(self) -> int:
        return len(self.seq)

    @property
    def num_rows(self) -> int:
        return len(self.seq)

    def table(self, *, origin: bool = False) -> pa.Table:
        """``seq, subject, time, headers, data`` as a table (the engine's record schema), plus
        ``origin_seq`` with ``origin=True`` (:data:`RANGE_SCHEMA`)."""
        if origin:
            return pa.Table.from_arrays(
                [self.seq, self.subject, self.time, self.headers, self.data, self.origin_seq],
                schema=RANGE_SCHEMA)
        return pa.Table.from_arrays(
            [self.seq, self.subject, self.time, self.headers, self.data],
            schema=_RECORD_SCHEMA_NO_ORIGIN)


def _check_status(r: Reply, subject: str, stream: str) -> None:
    if r.error is not None:
        raise r.error
    code = r.status
    if code in (204, 404):
        return
    if code == 503:
        raise JetStreamUnavailableError(
            503, 0, f"no responders for {subject}: stream {stream!r} missing or allow_direct "
                    "not enabled")
    raise error_from_status(code or 0, r.description or "direct get failed")


async def _fetch(nc: Client, stream: str, body: dict[str, Any], *, timeout_s: float,
                 api_prefix: str, drop_nats: bool) -> tuple[Columns | None, int | None]:
    """One request with the bulk parser: (columns of its hits or None, EOB num pending)."""
    parts: list[Columns] = []

    def columnize(r: Reply) -> None:
        users, servers, datas = r.take()
        if datas:
            parts.append(reply_columns(users, servers, datas, drop_nats_headers=drop_nats))

    r = await direct_get_reply(nc, stream, body, timeout_s=timeout_s, api_prefix=api_prefix,
                               on_progress=columnize, flush_at=COLUMNIZE_EVERY)
    _check_status(r, f"{api_prefix}.DIRECT.GET.{stream}", stream)
    columnize(r)
    if not parts:
        return None, None
    cols = Columns.concat(parts)
    stats = nc.stats
    stats["in_msgs"] += len(cols)
    stats["in_bytes"] += int(pc.sum(pc.binary_length(cols.data)).as_py() or 0)
    return cols, int_or_none(r.status_headers.get("Nats-Num-Pending"))


async def read_range(
    nc: Client,
    stream: str,
    from_seq: int,
    *,
    filter_subject: str,
    prefix: str | None = None,
    max_msgs: int = 20_000,
    max_bytes: int = 64 * 1024 * 1024,
    last_seq: int | None = None,
    timeout_s: float = 5.0,
    request_batch: int | None = None,
    drop_nats_headers: bool = False,
    api_prefix: str = DEFAULT_PREFIX,
    fast: bool | None = None,
) -> RangeBatch:
    """Read the stored messages matching ``filter_subject`` from ``from_seq`` on, in sequence
    order, without consuming them (batched direct get), as Arrow arrays.

    Args:
        nc: a connected nats-py client; other traffic on it is unaffected, and several reads may
            be in flight on it at once.
        stream: the stream (``allow_direct: true``), e.g. ``"ORDERS-g"``.
        from_seq: first sequence to consider (>= 1).
        filter_subject: the direct get's ``next_by_subj``: ``"<p>.>"`` (filtered: the server
            skips other partitions) or ``">"`` (unfiltered: every message is sent and those
            without ``prefix`` are dropped here).
        prefix: the partition's subject prefix, e.g. ``"3."``: stripped from ``subject``;
            messages whose subject does not start with it are dropped. ``None``: subjects as
            stored, nothing dropped.
        max_msgs: most messages returned (>= 1).
        max_bytes: payload byte budget: the range stops after the message whose payload reaches
            it (so at least one message comes back, as with the server's ``max_bytes``).
        last_seq: never return a message above this sequence (e.g. the stream's last sequence
            when the run started); ``None``: no bound.
        timeout_s: a request without any reply frame for this long raises (a reply that stalls
            before its end-of-batch status counts the same).
        request_batch: most messages per direct-get request (default ``max_msgs``: one request
            per range when the filter selects the partition); each request also asks for at
            most :data:`MAX_REQUEST_BYTES`.
        drop_nats_headers: leave every ``Nats-*`` header out of ``headers`` (as the engine's
            records do), not only the direct-get ones; ``origin_seq`` is filled either way.
        api_prefix: ``"$JS.API"``, or ``"$JS.<domain>.API"``.
        fast: ``None``: the bulk parser where :func:`fast_path_available`, else
            :meth:`JetStreamAPI.direct_get_batch` (same result, slower); ``False`` forces the
            latter; ``True`` requires the former.

    Returns:
        A :class:`RangeBatch`.

    Raises:
        RequestTimeoutError: no reply, or a reply that stalled, for ``timeout_s`` seconds.
        JetStreamUnavailableError: no responders (stream missing / ``allow_direct`` off), or the
            connection was lost during the read.
        JetStreamError: another error status, or a reply that is no direct-get reply.
        nats.errors.ConnectionClosedError: the connection was closed during the read.
        UsageError: ``from_seq``, ``max_msgs``, ``max_bytes`` or ``request_batch`` below 1, or
            ``fast=True`` where the bulk parser is not available.
    """
    if from_seq < 1:
        raise UsageError(f"from_seq must be >= 1, got {from_seq}")
    if max_msgs < 1 or max_bytes < 1:
        raise UsageError(f"max_msgs and max_bytes must be >= 1, got {max_msgs}, {max_bytes}")
    if request_batch is not None and request_batch < 1:
        raise UsageError(f"request_batch must be >= 1, got {request_batch}")
    available = fast_path_available(nc)
    if fast and not available:
        raise UsageError("the bulk range-read parser needs nats-py 2.16.x and its own parser")
    use_fast = available if fast is None else fast
    chunk = request_batch or max_msgs

    parts: list[Columns] = []
    got = got_bytes = requests = scanned = 0
    seq = from_seq  # everything of the range below seq is done
    ended = False
    num_pending: int | None = None
    api = None if use_fast else JetStreamAPI(nc, prefix=api_prefix, timeout=timeout_s)
    try:
        while got < max_msgs and got_bytes < max_bytes:
            if last_seq is not None and seq > last_seq:
                ended = True
                break
            batch = min(chunk, max_msgs - got)
            if last_seq is not None:
                batch = min(batch, last_seq - seq + 1)
            req_bytes = min(max_bytes - got_bytes, MAX_REQUEST_BYTES)
            requests += 1
            if api is None:
                cols, end_pending = await _fetch(
                    nc, stream, {"seq": seq, "next_by_subj": filter_subject, "batch": batch,
                                 "max_bytes": req_bytes},
                    timeout_s=timeout_s, api_prefix=api_prefix, drop_nats=drop_nats_headers)
            else:
                msgs = await api.direct_get_batch(stream, seq, filter_subject, batch,
                                                  max_bytes=req_bytes)
                cols = stored_columns(msgs, drop_nats_headers) if msgs else None
                end_pending = msgs[-1].num_pending if msgs else None
            if cols is None:  # 404: nothing stored at or after seq matches the filter
                ended = True
                break
            scanned += len(cols)
            seq_np = cols.seq.to_numpy()
            scanned_to = int(seq_np[-1])
            past_last = last_seq is not None and scanned_to > last_seq
            if past_last:
                assert last_seq is not None
                cols = cols.head(int(np.searchsorted(seq_np, last_seq, side="right")))
                scanned_to = last_seq
            if prefix:
                cols = strip_prefix(cols, prefix)
            # The limits: keep the first k rows.
            k = min(len(cols), max_msgs - got)
            if k:
                lens = pc.binary_length(cols.data.slice(0, k)).to_numpy(zero_copy_only=False)
                cum = np.cumsum(lens, dtype=np.int64)
                if got_bytes + int(cum[-1]) >= max_bytes:
                    k = int(np.searchsorted(cum, max_bytes - got_bytes, side="left")) + 1
                got_bytes += int(cum[k - 1])
                got += k
                num_pending = cols.pending[k - 1].as_py()
            if k < len(cols):
                # Cut by a limit inside this reply: the rest is for the next read.
                cols = cols.head(k)
                parts.append(cols)
                seq = int(cols.seq[k - 1].as_py()) + 1
                break
            if k:
                parts.append(cols)
            seq = scanned_to + 1
            if past_last or end_pending == 0 or (last_seq is not None and seq > last_seq):
                ended = True
                break
    finally:
        if api is not None:
            await api.close()
    cols = Columns.concat(parts)
    return RangeBatch(cols.seq, cols.subject, cols.time, cols.headers, cols.origin_seq,
                      cols.data, num_pending, ended, seq, requests, scanned)
