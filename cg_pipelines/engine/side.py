"""One side of a run: a partition of one group (stream, group, partition) with its lease, its
watermark, the range it reads and its dead-letter stream (:class:`Side`).

A partition run has one side; a co-partitioned run has one per input. The run loop
(:mod:`cg_pipelines.engine.drain`) drives its sides through the same steps; what a step does
to one side lives here: start (the stream's last sequence, the first lease, the dense-read
choice), read a range (or take the one read ahead), confirm an empty read with the stream
leader, settle what a commit covered, skip what an earlier run committed, publish dead
letters, record a halt, and the executor read's source options.

Units: sequences are sequences of the stream the side reads (``int``, first is 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import pyarrow as pa

from cg_pipelines.core.record import RECORD_SCHEMA
from cg_pipelines.engine.context import RunContext
from cg_pipelines.engine.deadletter import ensure_dlq_stream, publish_dead_letters, record_halt
from cg_pipelines.engine.executor_read import credentials_shown, executor_connect_options
from cg_pipelines.engine.lease import Lease, LeaseHolder
from cg_pipelines.engine.options import WorkQueueLossError
from cg_pipelines.engine.processor import DeadLetter
from cg_pipelines.jetstream.leader import confirm_empty_range
from cg_pipelines.jetstream.rangeread import read_range

__all__ = ["Prefetch", "Settle", "Side", "bounds", "drop_prefetch", "last_origin_seq"]

Settle = Callable[[Lease, int, "int | None"], Awaitable[None]]
"""``settle(lease, last, read)``: what a side does after a commit through sequence ``last``;
``read``: the messages of the partition the run read up to ``last`` (None: not counted)."""

Prefetch = tuple[int, "asyncio.Task[pa.Table]"]
"""A range read ahead: its first sequence and the task reading it."""


def bounds(batch: pa.Table) -> tuple[int, int] | None:
    """First and last sequence of a batch (stream order), None when it is empty."""
    if batch.num_rows == 0:
        return None
    seqs = batch["seq"]
    return seqs[0].as_py(), seqs[len(seqs) - 1].as_py()


def last_origin_seq(batch: pa.Table) -> int | None:
    """The origin sequence of the batch's last message (None when it has none)."""
    col = batch["origin_seq"]
    return col[len(col) - 1].as_py() if len(col) else None


T = TypeVar("T")


async def take_prefetch(prefetch: tuple[int, asyncio.Task[T]] | None, from_seq: int,
                        read: Callable[[], Awaitable[T]]) -> T:
    """The read from ``from_seq``: ``prefetch`` when it starts there, else ``read()`` (a
    prefetch starting elsewhere is dropped first, :func:`drop_prefetch`)."""
    if prefetch is not None and prefetch[0] == from_seq:
        return await prefetch[1]
    await drop_prefetch(prefetch)
    return await read()


async def drop_prefetch(prefetch: tuple[int, asyncio.Task[Any]] | None) -> None:
    """Cancel a prefetch nobody will use and wait until its task has ended (so no read of this
    run is left running, nor its exception unretrieved). The task's own outcome is dropped. A
    cancellation of the caller while it waits propagates at once (the prefetch, cancelled,
    then ends on its own)."""
    if prefetch is None:
        return
    task = prefetch[1]
    task.cancel()
    await asyncio.wait([task])  # raises only the caller's own cancellation
    if not task.cancelled():
        task.exception()  # retrieved: a failed read nobody uses is not reported as lost


class Side:
    """One side of a run over its context ``ctx`` and lease holder ``holder``.

    ``settle`` is what follows a commit (default :meth:`purge_and_ack`, for a work queue; a
    static group acks each delivered message, :meth:`~cg_pipelines.engine.lease.LeaseHolder.
    ack_each`). Attributes the loop reads and sets: ``lease`` (the held lease, None when the
    side has none), ``start_last`` (the stream's last sequence when the run started: the side
    reads no further), ``dense`` (read unfiltered), ``queue_messages`` (the messages in the
    stream it reads when the run started), ``prefetch`` (the range read ahead).
    """

    def __init__(self, ctx: RunContext, holder: LeaseHolder, settle: Settle | None = None
                 ) -> None:
        self.ctx, self.holder = ctx, holder
        self.name = ctx.name
        self.settle: Settle = settle or self.purge_and_ack
        self.lease: Lease | None = None
        self.start_last = 0
        self.dense = False
        self.queue_messages = 0
        self.prefetch: Prefetch | None = None
        self._dlq_ready = False
        self._shown: bool | None = None  # credentials_shown(nc), asked once per run

    # ------------------------------------------------------------------ start and leases

    async def start(self, info: Mapping[str, Any]) -> None:
        """The stream's last sequence now (the run reads no further), the first lease (None:
        the partition is empty or held, status set) and whether to read unfiltered.
        ``info``: the stream info of the stream read (:meth:`stream_info`), asked just before
        (the sides of a run over several partitions of one group share one request)."""
        c = self.ctx
        self.start_last = int(info["state"].get("last_seq") or 0)
        self.lease = await self.holder.take()
        # Dense partition: when it holds 90 % of the work queue's messages or more, reading the
        # range unfiltered and dropping the few other partitions' messages here is cheaper than
        # the server's filtered lookup; below that, the server and the client pay for every
        # message sent and filtered wins (bench/range_read.py: break-even at about 0.9).
        self.queue_messages = int(info["state"].get("messages") or 0)
        self.dense = 10 * c.pending >= 9 * self.queue_messages

    async def stream_info(self) -> Mapping[str, Any]:
        """The stream info of the stream this side reads (retried), for :meth:`start`."""
        c = self.ctx
        return await c.retry.call("stream info",
                                  functools.partial(c.api.stream_info, c.read_stream))

    def late(self) -> bool:
        """The held lease arrived after the run started (left for the next run)."""
        return self.lease is not None and self.lease.seq > self.start_last

    async def put_back(self) -> None:
        """Give the held lease back untouched (nak: at once for the next run)."""
        if self.lease is not None:
            lease, self.lease = self.lease, None
            await self.holder.put_back(lease)

    async def next(self) -> None:
        """Release the held lease and pull the partition's next message as the new one
        (None: the side is done, status set by the lease)."""
        assert self.lease is not None
        self.lease = await self.holder.next(self.lease)

    async def skip_committed(self, watermark: int) -> None:
        """The held lease is at or below ``watermark``: committed by an earlier run that
        stopped before purge/ack. Finish its job (purge, ack) and take the next lease."""
        assert self.lease is not None
        await self.purge(watermark + 1)
        await self.holder.ack(self.lease)
        self.ctx.side.duplicates_skipped += 1
        await self.next()

    # ------------------------------------------------------------------ reads

    async def read(self, from_seq: int, size: int, timing: str = "read") -> pa.Table:
        """The partition's stored messages from ``from_seq`` on, in order, up to ``size``
        messages and the byte limit and never past ``start_last``: one batched direct get
        (nothing is consumed), cut into Arrow columns in bulk (:func:`~cg_pipelines.jetstream.
        rangeread.read_range`)."""
        t = time.monotonic()
        c, opt = self.ctx, self.ctx.opt
        flt = ">" if self.dense else c.flt
        got = await c.retry.call("read", lambda: read_range(
            c.nc, c.read_stream, from_seq, filter_subject=flt, prefix=f"{c.partition}.",
            max_msgs=size, max_bytes=opt.batch_max_bytes, last_seq=self.start_last,
            timeout_s=opt.timeout_s, drop_nats_headers=True))
        c.timed(timing, t)
        return got.table(origin=True).cast(RECORD_SCHEMA)

    def read_ahead(self, from_seq: int, size: int) -> None:
        """Start reading the range from ``from_seq`` (the prefetch), unless one is running or
        the side has nothing after ``from_seq - 1``."""
        if self.prefetch is None and from_seq <= self.start_last:
            self.prefetch = (from_seq, asyncio.create_task(
                self.read(from_seq, size, timing="read_overlapped")))

    async def take_read(self, from_seq: int, size: int) -> pa.Table:
        """The range from ``from_seq``: the prefetch when it starts there, else a read (a
        prefetch starting elsewhere is dropped)."""
        prefetch, self.prefetch = self.prefetch, None
        return await take_prefetch(prefetch, from_seq, lambda: self.read(from_seq, size))

    async def drop_prefetch(self) -> None:
        """Drop the range read ahead, if any."""
        prefetch, self.prefetch = self.prefetch, None
        await drop_prefetch(prefetch)

    async def stale_empty_read(self, first: int, last: int) -> bool:
        """An empty read of the leased range ``[first, last]`` is taken as "purged after a
        commit" only when the stream's leader agrees: direct gets may be answered by a replica
        a little behind it. True: the leader holds a message of the partition there (read the
        range again). Raises :class:`~cg_pipelines.jetstream.leader.StaleReplicaError` when
        replicas miss it for 5 s."""
        c = self.ctx
        return await c.retry.call("confirm the empty range with the stream leader", lambda:
                                  confirm_empty_range(c.api, c.read_stream, c.flt, first, last))

    async def executor_source(self, from_seq: int) -> dict[str, str] | None:
        """The ``jetstream`` source options for reading ``[from_seq, start_last]`` on the
        executors, when the executor read is to be used for it (see
        ``EngineOptions.executor_read_min_msgs``), else None. The connection's options come
        from the run's :class:`~cg_pipelines.jetstream.connect.ConnectOptions` when it has
        them; else from nats-py's public view of the connection, used only when the server
        confirms it holds every credential the connection authenticated with
        (:func:`~cg_pipelines.engine.executor_read.credentials_shown`)."""
        c = self.ctx
        o, s = c.opt, c.side
        if o.executor_read_min_msgs is None or o.dead_letter_policy != "dlq":
            return None
        handled = s.processed + s.dead_lettered + s.duplicates_skipped
        backlog = min(c.pending - handled, self.start_last - from_seq + 1)
        if backlog < o.executor_read_min_msgs:
            return None
        if o.max_messages is not None and backlog > o.max_messages - c.res.processed:
            return None
        extra = c.processor.read_options
        conn = executor_connect_options(c.nc, connect=c.connect, tls_files="tls_ca" in extra)
        if conn is None:
            return None
        if c.connect is None:
            if self._shown is None:
                self._shown = await credentials_shown(c.nc, o.timeout_s)
            if not self._shown:
                return None
        return {**conn, "stream": c.read_stream, "subject": c.flt,
                "first_seq": str(from_seq), "last_seq": str(self.start_last),
                "strip_partition": "true", "timeout": str(o.timeout_s)}

    # ------------------------------------------------------------------ after processing

    async def dead_letter(self, records: pa.Table, dead: list[DeadLetter]) -> None:
        """Publish ``dead`` (messages of ``records``) to the group's DLQ stream, created
        first (idempotent: ``Nats-Msg-Id`` stores each dead letter once; retried)."""
        if not dead or not records.num_rows:
            return
        t = time.monotonic()
        c = self.ctx
        await self.ensure_dlq()
        c.side.dead_lettered += await c.retry.call("publish dead letters", lambda:
            publish_dead_letters(
                c.js, origin_stream=c.stream, read_stream=c.read_stream, group=c.group,
                partition=c.partition, batch=records, dead=dead, timeout=c.opt.timeout_s))
        c.timed("dead_letter", t)

    async def ensure_dlq(self) -> None:
        """Create the group's DLQ stream, once per run (idempotent; retried): where dead
        letters and the halt note go."""
        if self._dlq_ready:
            return
        c = self.ctx
        await c.retry.call("create the DLQ stream", lambda: ensure_dlq_stream(
            c.api, c.stream, c.group, max_age_s=c.opt.dlq_max_age_s))
        self._dlq_ready = True

    async def purge(self, below: int, read: int | None = None) -> None:
        """Purge the partition's messages below sequence ``below`` (idempotent; retried).

        ``read``: the messages of the partition below ``below`` this run read (its batch's;
        nothing of the partition is below the batch's first message, the lease). Raises
        :class:`~cg_pipelines.engine.options.WorkQueueLossError` when the server purged more
        (a retried purge whose first attempt applied counts 0: only more is a loss)."""
        c = self.ctx
        purged = await c.retry.call(
            "purge", lambda: c.api.purge(c.read_stream, filter=c.flt, seq=below))
        if read is not None and purged > read:
            raise WorkQueueLossError(c.read_stream, c.partition, below, read, purged)

    async def purge_and_ack(self, lease: Lease, last: int, read: int | None) -> None:
        """Settle for a work queue: purge the partition below ``last + 1`` (checked against
        the ``read`` messages, :meth:`purge`), then ack the lease."""
        await self.purge(last + 1, read)
        self.ctx.step("purged", last_seq=last)
        await self.holder.ack(lease)

    async def settled(self, first: int, last: int, *, purged: bool = False,
                      messages: int | None = None) -> None:
        """After a commit through ``last``: release the keep-alive, settle (purge and ack; only
        ack when the run ``purged`` the range already, with other partitions'), record it.
        ``messages``: the batch's messages of this side (its read, ``first`` to ``last``):
        what the purge must remove, no more."""
        assert self.lease is not None
        await self.holder.release(self.lease)
        if purged:
            self.ctx.step("purged", last_seq=last)
            await self.holder.ack(self.lease)
        else:
            await self.settle(self.lease, last, messages)
        c = self.ctx
        c.settled_through = last
        if c.inflight is not None and c.inflight[1] <= last:
            c.inflight = None

    async def halt(self, bad: DeadLetter) -> None:
        """Stop at the bad message ``bad`` (the ``halt`` policy): status ``halted``, the halt
        note for ``cg halt skip`` (best effort: the halt stands without it)."""
        c = self.ctx
        c.side.halted_at = bad.seq
        detail = f"halted at sequence {bad.seq}: {bad.reason}"
        c.end("halted", detail)
        c.res.status, c.res.detail = "halted", detail  # a halt stops the whole run
        await self.ensure_dlq()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(record_halt(
                c.js, c.api, origin_stream=c.stream, read_stream=c.read_stream, group=c.group,
                partition=c.partition, seq=bad.seq, reason=bad.reason, timeout=c.opt.timeout_s),
                2 * c.opt.timeout_s)
