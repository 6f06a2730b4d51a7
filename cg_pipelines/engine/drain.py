"""The drain pipeline: how a held partition's backlog becomes committed, acknowledged batches.

Each batch goes through these steps, in this order (the exactly-once rule: nothing is
acknowledged before its effect is committed, and a commit is fenced by the watermark read):

1. **Watermark.** Read the sink's committed watermark for the partition. A lease at or below
   it was committed by an earlier run that stopped before purge/ack: finish its job (purge,
   ack) without processing.
2. **Read.** The partition's stored messages from ``max(lease, watermark + 1)`` on, in order,
   up to the batch limits and never past the stream's last sequence at the start of the run:
   one batched direct get, nothing consumed (:meth:`Drain._read`). A partition holding 90 % of
   the work queue or more is read unfiltered (cheaper than the server's filtered lookup). An
   empty read is believed only when the stream leader agrees (a replica may lag).
3. **Process.** The processor turns the batch into rows and dead letters; the output is checked
   against the declared state and the partition column is set (:meth:`Drain._process`). Under
   ``halt`` the part before the first bad message is processed again alone.
4. **Dead-letter.** Publish the batch's dead letters to the group's DLQ stream (idempotent:
   ``Nats-Msg-Id``) before the commit.
5. **Commit, fenced.** One sink commit with the rows, the new watermark (the batch's last
   sequence), the origin-sequence marker and the batch's coverage (``cg.coverage``: every
   origin sequence it settled, for the reconcile check), only if the watermark is still the
   one read in 1;
   a fence conflict means a newer holder owns the range: stop (:meth:`Drain._commit_batch`).
6. **Settle.** Release the lease's keep-alive, then purge the partition below ``last + 1`` and
   ack the lease (:meth:`Drain.purge_and_ack`; a static group acks each delivered message
   instead, :meth:`~cg_pipelines.engine.lease.LeaseHolder.ack_each`).
7. **Next.** Pull the partition's next message as the next lease
   (:meth:`~cg_pipelines.engine.lease.LeaseHolder.next`) and go on from 1.

Pipelining: batch k+1 is read (prefetched) and processed while batch k commits, settles and the
next lease comes back; a prefetch that no longer starts where the next range starts is dropped,
and one whose range another holder took over is fenced at its commit (:meth:`Drain._pipeline`).

Executor read (``EngineOptions.executor_read_min_msgs``): for a large backlog, steps 2-3 for the
rest of the range are one read on the Spark executors
(:class:`~cg_pipelines.engine.executor_read.RangeProcessor`); steps 4-7 are the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from cg_pipelines.core.batching import next_batch_size
from cg_pipelines.core.contract import check_output
from cg_pipelines.core.coverage import COVERAGE_KEY, encode_seqs
from cg_pipelines.core.errors import ContractError, InvariantError
from cg_pipelines.core.record import RECORD_SCHEMA
from cg_pipelines.engine.context import RunContext
from cg_pipelines.engine.deadletter import (
    ensure_dlq_stream,
    publish_dead_letters,
    record_halt,
)
from cg_pipelines.engine.executor_read import (
    RangeProcessor,
    check_range,
    credentials_shown,
    executor_connect_options,
)
from cg_pipelines.engine.lease import Lease, LeaseHolder
from cg_pipelines.engine.processor import BatchContext, DeadLetter, Processed
from cg_pipelines.jetstream.leader import confirm_empty_range
from cg_pipelines.jetstream.rangeread import read_range
from cg_pipelines.sinks.base import (
    FenceConflictError,
    MaintainedSink,
    origin_marker,
    with_partition_column,
)

__all__ = ["Drain", "Settle"]

Settle = Callable[[Lease, int], Awaitable[None]]
"""``settle(lease, last)``: step 6 after a commit through sequence ``last``."""

Prefetch = tuple[int, "asyncio.Task[pa.Table]"]
"""A range read ahead: its first sequence and the task reading it."""


async def _drop(prefetch: Prefetch | None) -> None:
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


@dataclass(frozen=True)
class _Span:
    """Facts of a batch whose records stayed on the executors: first and last work-queue
    sequence, origin sequence of the last message, messages."""

    first: int
    last: int
    last_origin: int | None
    messages: int


@dataclass
class _Prepared:
    """A processed batch waiting for its commit: ``records`` (only those before a bad message
    under ``halt``), ``processed``, ``halted`` (the bad message, or None), ``process_s``.
    An executor batch has ``span`` (its facts) and only its dead-lettered ``records``."""

    records: pa.Table
    processed: Processed
    halted: DeadLetter | None
    process_s: float
    span: _Span | None = None

    def facts(self) -> _Span:
        """First and last sequence, last origin sequence and size of the batch."""
        if self.span is not None:
            return self.span
        first, last = _bounds(self.records)
        return _Span(first, last, _last_origin_seq(self.records), self.records.num_rows)


class Drain:
    """The batch pipeline of one partition run (see the module docstring), over the run's
    context ``ctx`` and its lease ``lease``. ``settle`` is step 6 (default:
    :meth:`purge_and_ack`, for a work queue)."""

    def __init__(self, ctx: RunContext, lease: LeaseHolder, settle: Settle | None = None) -> None:
        self.ctx, self.lease = ctx, lease
        self._settle: Settle = settle or self.purge_and_ack
        self._dense = False  # read ranges unfiltered (see run)
        self._shown: bool | None = None  # credentials_shown(nc), asked once per run

    async def run(self) -> None:
        """Drain the partition: steps 1-7 of the module docstring, batch after batch, until
        the backlog present at the start is done, a limit is hit, or the lease says stop."""
        c = self.ctx
        start = await c.retry.call("stream info", lambda: c.api.stream_info(c.read_stream))
        start_last = int(start["state"].get("last_seq") or 0)
        lease = await self.lease.take()
        # Dense partition: when it holds 90 % of the work queue's messages or more, reading the
        # range unfiltered and dropping the few other partitions' messages here is cheaper than
        # the server's filtered lookup; below that, the server and the client pay for every
        # message sent and filtered wins (bench/range_read.py: break-even at about 0.9).
        self._dense = 10 * self.ctx.pending >= 9 * int(start["state"].get("messages") or 0)
        dlq_ready = False
        # The next range is read while the current batch is processed and committed: reading
        # consumes nothing, and a prefetch that no longer starts where the next range starts
        # (or whose range another holder took over) is discarded or fenced at commit.
        prefetch: Prefetch | None = None
        try:
            while lease is not None:
                if lease.seq > start_last or self.ctx.limit_hit():
                    # Arrived after the run started, or a limit: leave it for the next run
                    # (the table's upkeep first, while the lease is still held).
                    await self._maintain()
                    await self.lease.put_back(lease)
                    self.ctx.res.status = "drained" if lease.seq > start_last else "limit"
                    return
                # 1. The watermark.
                t = time.monotonic()
                watermark = await asyncio.to_thread(self.ctx.sink.watermark, self.ctx.app_id)
                self.ctx.timed("watermark", t)
                self.ctx.res.watermark = watermark
                self.ctx.watermark_read = True
                if lease.seq <= watermark:
                    # Committed by an earlier run that stopped before purge/ack: finish its job.
                    await self._purge(watermark + 1)
                    await self.lease.ack(lease)
                    self.ctx.res.duplicates_skipped += 1
                    lease = await self.lease.next(lease)
                    continue
                from_seq = max(lease.seq, watermark + 1)
                source = await self._executor_source(from_seq, start_last)
                if source is not None:
                    # 2.-3. for a large backlog: one batch read, decoded and transformed on the
                    # executors; 4.-7. as any batch.
                    await _drop(prefetch)
                    prefetch = None
                    if not dlq_ready:
                        dlq_ready = await self._ensure_dlq()
                    lease = await self._executor_batch(lease, watermark, source)
                    continue
                # 2. Read (or take the range prefetched while the last batch committed).
                if prefetch is not None and prefetch[0] == from_seq:
                    records = await prefetch[1]
                else:
                    await _drop(prefetch)
                    records = await self._read(from_seq, start_last)
                prefetch = None
                if records.num_rows == 0:
                    if await self._stale_empty_read(from_seq, start_last):
                        continue  # a replica behind the leader answered: read again
                    # The leased message was purged after a commit (crash before its ack).
                    await self.lease.ack(lease)
                    lease = await self.lease.next(lease)
                    continue
                if not dlq_ready:
                    dlq_ready = await self._ensure_dlq()
                # 3.-7., pipelined.
                lease, prefetch = await self._pipeline(lease, records, watermark, start_last,
                                                       prefetch)
            if self.ctx.res.status == "drained":  # nothing left: still pinned, nothing leased
                await self._maintain()
        finally:
            await _drop(prefetch)
            if lease is not None:
                await self.lease.release(lease)

    async def _maintain(self) -> None:
        """After the run's last commit, while the partition is still held: the sink's optional
        upkeep (:class:`~cg_pipelines.sinks.base.MaintainedSink`: compaction, snapshots,
        retention), its figures in ``res.maintenance`` (skipped when nothing was committed)."""
        sink = self.ctx.sink
        if self.ctx.res.commits == 0 or not isinstance(sink, MaintainedSink):
            return
        t = time.monotonic()
        self.ctx.res.maintenance = await asyncio.to_thread(
            sink.maintain, self.ctx.partition, self.ctx.app_id)
        self.ctx.timed("maintain", t)

    async def _executor_source(self, from_seq: int, start_last: int) -> dict[str, str] | None:
        """The ``jetstream`` source options for reading ``[from_seq, start_last]`` of the
        partition on the executors, when the executor read is to be used for it (see
        ``EngineOptions.executor_read_min_msgs``); else None. The connection's options come
        from the run's :class:`~cg_pipelines.jetstream.connect.ConnectOptions` when it has
        them; else from nats-py's public view of the connection, used only when the server
        confirms it holds every credential the connection authenticated with
        (:func:`~cg_pipelines.engine.executor_read.credentials_shown`)."""
        o, res = self.ctx.opt, self.ctx.res
        if (o.executor_read_min_msgs is None or o.dead_letter_policy != "dlq"
                or not isinstance(self.ctx.processor, RangeProcessor)):
            return None
        handled = res.processed + res.dead_lettered + res.duplicates_skipped
        backlog = min(self.ctx.pending - handled, start_last - from_seq + 1)
        if backlog < o.executor_read_min_msgs:
            return None
        if o.max_messages is not None and backlog > o.max_messages - res.processed:
            return None
        extra = self.ctx.processor.read_options
        c = self.ctx
        conn = executor_connect_options(c.nc, connect=c.connect, tls_files="tls_ca" in extra)
        if conn is None:
            return None
        if c.connect is None:
            if self._shown is None:
                self._shown = await credentials_shown(c.nc, c.opt.timeout_s)
            if not self._shown:
                return None
        return {**conn, "stream": self.ctx.read_stream, "subject": self.ctx.flt,
                "first_seq": str(from_seq), "last_seq": str(start_last), "strip_partition": "true",
                "timeout": str(o.timeout_s)}

    async def _executor_batch(self, lease: Lease, watermark: int,
                              source: dict[str, str]) -> Lease | None:
        """Process the range ``source`` names as one batch on the executors
        (:meth:`RangeProcessor.process_range`), then dead-letter, commit (fenced), purge and
        ack exactly as a driver batch. Returns the next lease, or None when the run stops."""
        first, last = int(source["first_seq"]), int(source["last_seq"])
        c = self.ctx
        ctx = BatchContext(c.stream, c.group, c.partition, c.app_id, first, last, c.sink,
                           c.state)
        t = time.monotonic()
        assert isinstance(self.ctx.processor, RangeProcessor)
        got = await asyncio.to_thread(self.ctx.processor.process_range, source, ctx)
        process_s = time.monotonic() - t
        for k, v in got.timings.items():
            self.ctx.res.timings[k] = self.ctx.res.timings.get(k, 0.0) + v
        self.ctx.res.timings.setdefault("read_executors", 0.0)
        if got.messages == 0 or got.first_seq is None or got.last_seq is None:
            if await self._stale_empty_read(first, last):
                return lease  # a replica behind the leader answered: the loop reads again
            # The leased message was purged after a commit (crash before its ack).
            await self.lease.ack(lease)
            return await self.lease.next(lease)
        span = _Span(got.first_seq, got.last_seq, got.last_origin_seq, got.messages)
        self.ctx.inflight = (span.first, span.last)
        check_range(got, first, last)
        processed = got.processed
        processed.table = with_partition_column(processed.table, self.ctx.partition)
        self.ctx.step("read", first_seq=span.first, last_seq=span.last, executors=True)
        if self.ctx.state is not None:
            self.ctx.state.update(processed.table)  # as _prepare_batch: the cache goes on a fence
        self.ctx.step("processed", first_seq=span.first, last_seq=span.last)
        prep = _Prepared(got.dead_records, processed, None, process_s, span)
        await self._dead_letter(prep)
        if await self._commit_batch(lease, prep, watermark):
            return None
        return await self.lease.next(lease)

    async def _stale_empty_read(self, first: int, last: int) -> bool:
        """An empty read of the leased range ``[first, last]`` is taken as "purged after a
        commit" (and the lease acknowledged) only when the stream's leader agrees: direct gets
        may be answered by a replica a little behind it. True: the leader holds a message of
        the partition there (a replica now serves it too): read the range again. Raises
        :class:`~cg_pipelines.jetstream.leader.StaleReplicaError` when replicas miss it for
        5 s."""
        c = self.ctx
        return await c.retry.call("confirm the empty range with the stream leader", lambda:
                                  confirm_empty_range(c.api, c.read_stream, c.flt, first, last))

    async def _read(self, from_seq: int, start_last: int, timing: str = "read") -> pa.Table:
        """The partition's stored messages from ``from_seq`` on, in order, up to the batch
        limits and never past ``start_last``: one batched direct get (nothing is consumed),
        its replies cut into Arrow columns in bulk (:func:`~cg_pipelines.jetstream.rangeread.
        read_range`)."""
        t = time.monotonic()
        opt = self.ctx.opt
        flt = ">" if self._dense else self.ctx.flt
        size = next_batch_size(self.ctx.cost, opt.batch_max_msgs,
                               opt.adaptive_max_msgs or opt.batch_max_msgs)
        got = await self.ctx.retry.call("read", lambda: read_range(
            self.ctx.nc, self.ctx.read_stream, from_seq, filter_subject=flt,
            prefix=f"{self.ctx.partition}.",
            max_msgs=size, max_bytes=opt.batch_max_bytes, last_seq=start_last,
            timeout_s=opt.timeout_s, drop_nats_headers=True))
        self.ctx.timed(timing, t)
        return got.table(origin=True).cast(RECORD_SCHEMA)

    async def _process(self, records: pa.Table) -> Processed:
        first, last = _bounds(records)
        ctx = BatchContext(self.ctx.stream, self.ctx.group, self.ctx.partition, self.ctx.app_id,
                           first, last, self.ctx.sink, self.ctx.state)
        t = time.monotonic()
        processed = await asyncio.to_thread(self.ctx.processor.process, records, ctx)
        if processed.table is not None:  # one line naming a missing or mistyped column
            check_output(processed.table.schema, self.ctx.processor.state,
                         where=f"transform output of partition {self.ctx.partition} of "
                               f"{self.ctx.read_stream} (sequences {first}..{last})")
        processed.table = with_partition_column(processed.table, self.ctx.partition)
        self.ctx.timed("process", t)
        seqs = set(records["seq"].to_pylist())
        unknown = [d.seq for d in processed.dead if d.seq not in seqs]
        if unknown:
            raise ContractError(f"processing step dead-lettered sequences not in the batch: "
                                f"{unknown[:5]}")
        return processed

    async def _prepare_batch(self, records: pa.Table) -> _Prepared:
        """Process one batch (under ``halt``, re-process the part before the first bad
        message) and take its output as the newest per-key state. Touches no lease."""
        t = time.monotonic()
        processed = await self._process(records)
        halted = None
        if processed.dead and self.ctx.opt.dead_letter_policy == "halt":
            halted = min(processed.dead, key=lambda d: d.seq)
            records = records.filter(pc.less(records["seq"], halted.seq))
            if records.num_rows == 0:
                return _Prepared(records, processed, halted, time.monotonic() - t)
            processed = await self._process(records)
            if processed.dead:  # the prefix must process cleanly: it did in the full batch
                raise InvariantError("processing step is not deterministic: the batch before a "
                                     "bad message produced dead letters on re-processing")
        if self.ctx.state is not None:
            # Optimistic: the next batch is processed while this one commits; if the commit
            # is refused (fence), the run stops and this per-run cache goes with it.
            self.ctx.state.update(processed.table)
        first, last = _bounds(records)
        self.ctx.step("processed", first_seq=first, last_seq=last)
        return _Prepared(records, processed, halted, time.monotonic() - t)

    async def _dead_letter(self, prep: _Prepared) -> None:
        if not prep.processed.dead or not prep.records.num_rows:
            return
        t = time.monotonic()
        dead = prep.processed.dead
        # Retried as a whole: Nats-Msg-Id makes the DLQ store each dead letter once.
        c = self.ctx
        c.res.dead_lettered += await c.retry.call("publish dead letters", lambda:
            publish_dead_letters(
                c.js, origin_stream=c.stream, read_stream=c.read_stream, group=c.group,
                partition=c.partition, batch=prep.records, dead=dead,
                timeout=c.opt.timeout_s))
        self.ctx.timed("dead_letter", t)

    async def _commit_batch(self, lease: Lease, prep: _Prepared, watermark: int) -> bool:
        """Commit (fenced), purge, ack one prepared batch. Returns True to stop the run."""
        res = self.ctx.res
        processed = prep.processed
        facts = prep.facts()
        first, last = facts.first, facts.last
        t = time.monotonic()
        try:  # 5. Commit, fenced.
            origin = facts.last_origin
            markers = {origin_marker(self.ctx.app_id): origin} if origin is not None else None
            lineage = {"stream": self.ctx.stream, "group": self.ctx.group,
                       "partition": self.ctx.partition, "first_seq": first, "last_seq": last,
                       "last_origin_seq": origin,
                       # every origin sequence this batch settled (rows, dead letters, filtered
                       # out): what the reconcile check counts as covered (core/coverage.py)
                       COVERAGE_KEY: _coverage(prep)}
            await asyncio.to_thread(self.ctx.sink.commit, processed.table, self.ctx.app_id, last,
                                    watermark, markers, lineage=lineage)
        except FenceConflictError as e:
            res.fence_conflicts += 1
            res.status = "fenced"
            res.detail = f"{e}; a newer holder owns this range, stopping"
            # Stop renewing the lease (nobody else holds this one): left unacknowledged, it is
            # redelivered to the partition's next run after the ack wait.
            await self.lease.release(lease)
            return True
        self.ctx.timed("commit", t)
        res.commits += 1
        if prep.span is None:  # an executor batch costs another path: it would skew the fit
            self.ctx.cost.observe(facts.messages, prep.process_s + time.monotonic() - t)
        res.watermark = last
        res.processed += facts.messages - len(processed.dead)
        res.first_seq = res.first_seq or first
        res.last_seq = last
        handled = res.processed + res.dead_lettered + res.duplicates_skipped
        self.ctx.step("committed", first_seq=first, last_seq=last, processed=res.processed,
                      dead_lettered=res.dead_lettered, left=max(0, self.ctx.pending - handled),
                      seconds=time.monotonic() - self.ctx.t0)
        # 6. Settle (no keep-alive pull may be waiting when the lease is acked).
        t = time.monotonic()
        await self.lease.release(lease)
        await self._settle(lease, last)
        self.ctx.settled_through = last
        if self.ctx.inflight is not None and self.ctx.inflight[1] <= last:
            self.ctx.inflight = None
        self.ctx.timed("settle", t)
        if prep.halted is not None:
            # The bad message is now the partition's first: leave it for an operator.
            await self._halt(prep.halted.seq, prep.halted.reason)
            return True
        self.ctx.step("acked", first_seq=first, last_seq=last)
        return False

    async def _halt(self, seq: int, reason: str) -> None:
        c = self.ctx
        c.res.status, c.res.halted_at = "halted", seq
        c.res.detail = f"halted at sequence {seq}: {reason}"
        # The halt note, for `cg halt skip` (best effort: the halt stands without it).
        with contextlib.suppress(Exception):
            await asyncio.wait_for(record_halt(
                c.js, c.api, origin_stream=c.stream, read_stream=c.read_stream, group=c.group,
                partition=c.partition, seq=seq, reason=reason, timeout=c.opt.timeout_s),
                2 * c.opt.timeout_s)

    async def process_and_commit(
        self, lease: Lease, records: pa.Table, watermark: int
    ) -> bool:
        """Process, dead-letter, commit, purge, ack one batch, in that order. Returns True to
        stop the run."""
        self.ctx.inflight = _bounds(records)
        prep = await self._prepare_batch(records)
        if prep.records.num_rows == 0:  # halted at the batch's first message
            await self.lease.put_back(lease)
            assert prep.halted is not None
            await self._halt(prep.halted.seq, prep.halted.reason)
            return True
        await self._dead_letter(prep)
        return await self._commit_batch(lease, prep, watermark)

    async def _commit_and_next(self, lease: Lease, prep: _Prepared,
                               watermark: int) -> Lease | None:
        """:meth:`_commit_batch`, then the next lease (None: the run stops, status set)."""
        if await self._commit_batch(lease, prep, watermark):
            return None
        return await self.lease.next(lease)

    async def _pipeline(
        self, lease: Lease, records: pa.Table, watermark: int, start_last: int,
        prefetch: Prefetch | None,
    ) -> tuple[Lease | None, Prefetch | None]:
        """Drain batches with commit and settle off the critical path: batch k+1 is processed
        while batch k commits (fenced, in order), purges, acks and the next lease comes back.
        The next batch is read meanwhile too. Returns the lease to go on with (the outer loop
        checks it) or None when the run stops, and an unused prefetch."""
        pending: asyncio.Task[Lease | None] | None = None
        try:
            while True:
                first, last = _bounds(records)
                self.ctx.inflight = (first, last)
                self.ctx.step("read", first_seq=first, last_seq=last)
                if prefetch is None and last < start_last:
                    prefetch = (last + 1, asyncio.create_task(
                        self._read(last + 1, start_last, timing="read_overlapped")))
                # 3. Process (while the previous batch commits).
                prep = await self._prepare_batch(records)
                if pending is not None:
                    next_lease, pending = await pending, None
                    if next_lease is None:
                        return None, prefetch
                    lease = next_lease
                    if lease.seq != first or self.ctx.limit_hit():
                        # Not where this batch starts (or a limit): drop it, and the state it
                        # added to the cache, and let the outer loop decide.
                        if self.ctx.state is not None:
                            self.ctx.state.reset()
                        return lease, prefetch
                if prep.records.num_rows == 0:  # halted at the batch's first message
                    await self.lease.put_back(lease)
                    assert prep.halted is not None
                    await self._halt(prep.halted.seq, prep.halted.reason)
                    return None, prefetch
                # 4. Dead-letter.
                await self._dead_letter(prep)
                # 5.-7. off the critical path: commit (fenced), settle, next lease.
                pending = asyncio.create_task(self._commit_and_next(lease, prep, watermark))
                watermark = _bounds(prep.records)[1]
                if prep.halted is not None or prefetch is None or prefetch[0] != last + 1:
                    next_lease, pending = await pending, None
                    return next_lease, prefetch
                records = await prefetch[1]
                prefetch = None
                if records.num_rows == 0:
                    next_lease, pending = await pending, None
                    return next_lease, None
        except BaseException:
            await _drop(prefetch)  # the caller never sees this prefetch
            raise
        finally:
            if pending is not None:  # an error or cancellation: let the commit finish first
                with contextlib.suppress(BaseException):
                    await pending

    async def purge_and_ack(self, lease: Lease, last: int) -> None:
        """Step 7 for a work queue: purge the partition below ``last + 1``, then ack the lease."""
        await self._purge(last + 1)
        self.ctx.step("purged", last_seq=last)
        await self.lease.ack(lease)

    async def _purge(self, below: int) -> None:
        """Purge the partition's messages below sequence ``below`` (idempotent; retried)."""
        c = self.ctx
        await c.retry.call("purge", lambda: c.api.purge(c.read_stream, filter=c.flt, seq=below))

    async def _ensure_dlq(self) -> bool:
        """Step 4's stream: create the group's DLQ stream (idempotent; retried)."""
        c = self.ctx
        await c.retry.call("create the DLQ stream", lambda: ensure_dlq_stream(
            c.api, c.stream, c.group, max_age_s=c.opt.dlq_max_age_s))
        return True


def _bounds(batch: pa.Table) -> tuple[int, int]:
    """First and last sequence of a non-empty batch (stream order)."""
    seqs = batch["seq"]
    return seqs[0].as_py(), seqs[-1].as_py()


def _coverage(prep: _Prepared) -> str | None:
    """The batch's covered origin sequences (:func:`~cg_pipelines.core.coverage.encode_seqs`),
    or None for an executor batch (its records stay on the executors)."""
    if prep.span is not None:
        return None
    col = prep.records["origin_seq"].drop_null()
    return encode_seqs(col.to_numpy()) if len(col) else None


def _last_origin_seq(batch: pa.Table) -> int | None:
    """The origin sequence of the batch's last message (None when it has none)."""
    col = batch["origin_seq"]
    return col[len(col) - 1].as_py() if len(col) else None
