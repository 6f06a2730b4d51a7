"""The run loop: how the backlog of a run's sides becomes committed, acknowledged batches.

A run has one side or several (:class:`~cg_pipelines.engine.side.Side`: one partition of one
group, with its lease, watermark, range and dead-letter stream): a partition run has one, a
co-partitioned run one per input. Each batch goes through these steps, in this order (the
exactly-once rule: nothing is acknowledged before its effect is committed, and a commit is
fenced by the watermarks read):

1. **Watermarks.** Read every side's committed watermark (the first side's first). A lease at
   or below its side's watermark was committed by an earlier run that stopped before
   purge/ack: finish its job (purge, ack) without processing.
2. **Read.** Each leased side's stored messages from ``max(lease, watermark + 1)`` on, in
   order, up to the batch limits (the adaptive size, :func:`~cg_pipelines.core.batching.
   next_batch_size`) and never past that side's last sequence at the start of the run: one
   batched direct get per side, nothing consumed; a partition holding 90 % of its work queue
   or more is read unfiltered. The partitions of a run over several that hold 90 % of the work
   queue together are read with ONE unfiltered direct get split by partition
   (:mod:`~cg_pipelines.engine.reads`). A read that misses a lease is believed only when the
   stream leader agrees.
3. **Process.** One call of the run's processing step with every side's batch
   (:class:`~cg_pipelines.engine.step.BatchStep`; a side with nothing gets an empty batch),
   the output held to the contract. Under ``halt`` each side with a bad message is cut before
   its first one and the batch is processed again.
4. **Dead-letter.** Publish each side's dead letters to its group's DLQ stream (idempotent:
   ``Nats-Msg-Id``) before the commit.
5. **Commit, fenced.** ONE sink commit with the rows and every side's new watermark, origin
   marker and coverage (:func:`~cg_pipelines.engine.commit.commit_batch`), only if every
   watermark is still the one read in 1; a fence conflict means a newer holder owns a range:
   stop (status ``fenced``).
6. **Settle.** For each side with messages in the batch: release the lease's keep-alive,
   purge the partition below ``last + 1`` and ack the lease (a static group acks each
   delivered message instead); the partitions of a run over several settle concurrently,
   each in that order. A halted side stops the run here. In the batch loop a commit less than
   ``EngineOptions.settle_interval_s`` after the run's last settle is not settled yet: the
   next settle covers it with the commits after it, in one purge
   (:class:`~cg_pipelines.engine.unsettled.Unsettled`; a purge costs per call, not per
   message), and the loop settles what it owes before it leaves.
7. **Next.** Pull each settled side's next message as its next lease and go on from 1 (a side
   with commits owed keeps its lease and reads on after its last commit).

Pipelining: batch k+1 is read (prefetched) and processed while batch k commits, settles and
the next leases come back; a processed batch that no longer starts where the sides' next
leases start is dropped (and the state it added), and one whose range another holder took
over is fenced at its commit (:meth:`Drain._pipeline`).

Executor read (``EngineOptions.executor_read_min_msgs``, a step with a
:class:`~cg_pipelines.engine.executor_read.RangeProcessor`): for a large backlog, steps 2-3 for
the rest of the range are one read on the Spark executors; steps 4-7 are the same.

The run ends when no side holds a lease any more (status ``drained``: the backlog present at
the start is done), a limit is hit (``limit``), or a side stops it (``fenced``, ``halted``,
``handed_over``); after the last commit, while the partitions are still held, the sink's
upkeep runs (:class:`~cg_pipelines.sinks.base.MaintainedSink`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from cg_pipelines.core.batching import next_batch_size
from cg_pipelines.core.errors import InvariantError
from cg_pipelines.engine.commit import Prepared, Span, commit_batch, span_info, spans_of
from cg_pipelines.engine.executor_read import check_range
from cg_pipelines.engine.lease import Lease
from cg_pipelines.engine.options import Hook
from cg_pipelines.engine.processor import DeadLetter
from cg_pipelines.engine.reads import Reads, Window, at_once
from cg_pipelines.engine.side import Side
from cg_pipelines.engine.step import BatchStep, Output
from cg_pipelines.engine.unsettled import Unsettled
from cg_pipelines.sinks.base import FenceConflictError, MaintainedSink

__all__ = ["Drain", "merge_figures"]

_STOPS = ("fenced", "halted", "handed_over")
"""Statuses that end a run at once."""


class Drain:
    """The run loop over ``sides`` (see the module docstring), in the run's order: the first
    side's app id records the commits and its snapshot serves state reads. ``step`` processes
    the batches; ``hook`` gets the run's joint steps (``processed``, ``committed``), the sides'
    own contexts their per-side steps (``leased``, ``read``, ``purged``, ``acked``).

    ``independent``: the sides are partitions of one group that end on their own (a run over
    several partitions, :func:`~cg_pipelines.engine.runner.run_partitions`), not inputs that
    must be held together (a co-partitioned run):

    * the sides are started (first lease taken), read and settled at once (at most
      :data:`~cg_pipelines.engine.reads.AT_ONCE` at a time), not one after the other: a side
      another run holds is not processed and holds up no other side (its status ``held`` in
      its :class:`~cg_pipelines.engine.result.SideResult`; the sides held cost one
      ``hold_wait_s`` together); the run is ``held`` only when no side was leased and a
      side is held;
    * a side's ending (drained, handed over) ends that side only; each side's status is its
      own (a side still going when the run stops carries the run's ``fenced``/``halted``);
    * a batch's messages are shared out among the sides still leased (each side reads at most
      its share of the batch size, at least one message), or, when the sides leased hold 90 %
      of the work queue, read with one unfiltered read split by partition
      (:mod:`~cg_pipelines.engine.reads`);
    * a commit fences and records only the sides with messages in the batch (a side it leaves
      untouched may be another run's by then; :func:`~cg_pipelines.engine.commit.
      commit_batch`);
    * a fence conflict stops the run as for any run (nothing acknowledged that was not
      committed): the conflicting side's lease is left to expire, every other side's is put
      back at once (nak), since its batch was not committed either;
    * the sink's upkeep runs for every side that committed (and was not handed over);
    * a side that is done (drained, or its next message arrived after the run started) gives
      its pin up at once when its holder says so (``unpin_when_drained``), not when the run
      ends.
    """

    def __init__(self, sides: Sequence[Side], step: BatchStep, hook: Hook | None, *,
                 independent: bool = False,
                 after_start: Callable[[], Awaitable[None]] | None = None) -> None:
        self.sides = list(sides)
        self.by_name = {s.name: s for s in self.sides}
        #: the order leases are taken in (two runs never hold one lease each of the same two)
        self.leasing = sorted(self.sides, key=lambda s: (s.ctx.stream, s.ctx.group,
                                                         s.ctx.partition))
        self.first = self.sides[0].ctx
        self.res, self.opt, self.sink = self.first.res, self.first.opt, self.first.sink
        self.proc, self.hook = step, hook
        self.independent = independent
        self.after_start = after_start
        self.reads = Reads(self.sides, independent=independent)
        #: committed batches of the batch loop not settled yet, and when the last settle was
        self.owed: Unsettled | None = None
        self.settled_at = time.monotonic()

    def _step(self, name: str, **info: object) -> None:
        if self.hook is not None:
            self.hook(name, info)

    def _size(self) -> int:
        """The next read's batch size, all sides (adaptive when ``adaptive_max_msgs`` is
        set)."""
        o = self.opt
        return next_batch_size(self.first.cost, o.batch_max_msgs,
                               o.adaptive_max_msgs or o.batch_max_msgs)

    async def run(self) -> None:
        """Lease every side, then steps 1-7 batch after batch until the run ends."""
        if self.independent:
            await self._start_all()
            self.reads.choose()
        for side in self.leasing if not self.independent else ():
            await side.start(await side.stream_info())
            if self.res.status == "held":
                if len(self.sides) > 1:
                    self.res.detail = f"input {side.name}: {self.res.detail}"
                for s in self.sides:
                    await s.put_back()
                return
        if self.after_start is not None:  # e.g. the lineage, read once the sides started
            await self.after_start()
        try:
            await self._loop()
        finally:
            await self.reads.drop()
            for side in self.sides:
                if side.lease is not None:
                    await side.holder.release(side.lease)
        if self.independent:
            self._end_sides()

    async def _start_all(self) -> None:
        """Independent sides: start every side at once (:func:`~cg_pipelines.engine.reads.
        at_once`), so held sides cost one ``hold_wait_s``, not one each. On a failure the
        other starts are cancelled and waited for before it propagates (no lease is taken
        after the run gave its leases back). The sides reading one stream share one stream
        info request."""
        infos: dict[str, Mapping[str, Any]] = {}
        for side in {s.ctx.read_stream: s for s in self.leasing}.values():
            infos[side.ctx.read_stream] = await side.stream_info()
        await at_once(self.leasing, lambda s: s.start(infos[s.ctx.read_stream]))

    def _end_sides(self) -> None:
        """Independent sides: each side's status (a side with none yet carries the run's stop
        status, or ``drained``/``empty``), then the run's: its stop status, else ``limit`` when
        a side stopped at a limit, ``drained`` when a side was leased, ``held`` when none was
        and a side is held, else ``empty``; the detail names the sides held or handed over."""
        res = self.res
        stopped = res.status in _STOPS
        for s in self.sides:
            side = s.ctx.side
            if side.status is None:
                if stopped:
                    side.status = res.status
                    side.detail = side.detail or f"stopped with the run: {res.detail}"
                else:
                    side.status = "drained" if s.holder.was_pinned else "empty"
        statuses = [s.ctx.side.status for s in self.sides]
        if not stopped:
            if "limit" in statuses:
                res.status = "limit"
            elif any(s.holder.was_pinned for s in self.sides):
                res.status = "drained"
            else:  # nothing leased: held when a side has a backlog another run holds
                res.status = "held" if "held" in statuses else "empty"
        if len(self.sides) == 1:  # a run over one partition ends as its partition does
            side = self.sides[0].ctx.side
            if not stopped:
                res.status = side.status or res.status
                res.detail = side.detail or res.detail
            return
        notes = [f"partition {s.ctx.partition} {s.ctx.side.status}: {s.ctx.side.detail}"
                 for s in self.sides if s.ctx.side.status in ("held", "handed_over")]
        if notes and not stopped:
            res.detail = "; ".join(notes)

    async def _loop(self) -> None:
        while True:
            live = [s for s in self.sides if s.lease is not None]
            if not live or self.res.status in _STOPS:
                break
            late = all(s.late() for s in live)
            if late or self.first.limit_hit():
                # Arrived after the run started, or a limit: leave it for the next run (the
                # table's upkeep first, while the leases are still held).
                await self._maintain()
                for s in live:
                    if self.independent:
                        s.ctx.end("drained" if s.late() else "limit")
                    await s.put_back()
                self.res.status = "drained" if late else "limit"
                return
            for s in live:
                if s.late():
                    if self.independent:
                        s.ctx.end("drained")
                    await s.put_back()
                    if s.holder.unpin_when_drained:
                        await s.holder.unpin_now()
            watermarks = await self._watermarks()
            if watermarks is None or await self._executor_batch(watermarks):
                continue
            window = await self.reads.first(watermarks, self._size())
            if window is not None:
                await self._pipeline(window, watermarks)
        if self.res.status not in _STOPS:
            pinned = any(s.holder.was_pinned for s in self.sides)
            self.res.status = "drained" if pinned else "empty"
        if self.res.status == "drained":  # nothing left: still pinned, nothing leased
            await self._maintain()

    async def _maintain(self) -> None:
        """After the run's last commit, while the partitions are still held: the sink's
        optional upkeep, its figures in ``res.maintenance`` (skipped when nothing was
        committed)."""
        sink = self.sink
        if self.res.commits == 0 or not isinstance(sink, MaintainedSink):
            return
        t = time.monotonic()
        if not self.independent:
            self.res.maintenance = await asyncio.to_thread(
                sink.maintain, self.first.partition, self.first.app_id)
        else:  # every side that committed and is still this run's; figures summed (words:
            # the distinct ones; one side's as they are)
            sides = [s.ctx for s in self.sides if s.ctx.side.last_seq is not None
                     and s.ctx.side.status != "handed_over"]
            if not sides:
                return
            figures = await asyncio.to_thread(
                lambda: [sink.maintain(c.partition, c.app_id) for c in sides])
            self.res.maintenance = figures[0] if len(self.sides) == 1 else merge_figures(figures)
        self.first.timed("maintain", t)

    async def _watermarks(self) -> dict[str, int] | None:
        """Step 1: every side's committed watermark, by side name; None when a lease at or
        below its side's watermark was settled (the caller decides again)."""
        t = time.monotonic()
        out: dict[str, int] = {}
        for side in self.sides:
            c = side.ctx
            if self.independent and side.lease is None:
                out[side.name] = c.side.watermark  # not read: not in the next batch
                continue
            out[side.name] = c.side.watermark = await asyncio.to_thread(
                self.sink.watermark, c.app_id)
            c.watermark_read = True
        self.first.timed("watermark", t)
        skipped = False
        for side in self.sides:
            if side.lease is not None and side.lease.seq <= out[side.name]:
                await side.skip_committed(out[side.name])
                skipped = True
        return None if skipped else out

    async def _process(self, batches: Mapping[str, pa.Table]) -> Output:
        t = time.monotonic()
        out = await asyncio.to_thread(self.proc.process, batches)
        self.first.timed("process", t)
        return out

    async def _prepare(self, batches: Mapping[str, pa.Table]) -> Prepared:
        """Step 3: process one batch (under ``halt``, again with each side cut before its
        first bad message) and take its output as the newest per-key state. Touches no
        lease."""
        t = time.monotonic()
        records = dict(batches)
        table, dead = await self._process(records)
        halted: dict[str, DeadLetter] = {}
        if dead and self.opt.dead_letter_policy == "halt":
            for name, letters in dead.items():
                halted[name] = letters[0]
                b = records[name]
                records[name] = b.filter(pc.less(b["seq"], letters[0].seq))
            if not any(b.num_rows for b in records.values()):
                return Prepared(records, None, {}, halted, time.monotonic() - t, {})
            table, dead = await self._process(records)
            if dead:  # the prefix must process cleanly: it did in the full batch
                raise InvariantError("processing step is not deterministic: the batch before a "
                                     "bad message produced dead letters on re-processing")
        if self.proc.state is not None:
            # Optimistic: the next batch is processed while this one commits; if the commit
            # is refused (fence), the run stops and this per-run cache goes with it.
            self.proc.state.update(table)
        spans = spans_of(records)
        self._step("processed", **self._ranges(spans))
        return Prepared(records, table, dead, halted, time.monotonic() - t, spans)

    def _ranges(self, spans: Mapping[str, Span]) -> dict[str, object]:
        return span_info([s.name for s in self.sides], spans)

    async def _dead_letter(self, prep: Prepared) -> None:
        """Step 4: each side's dead letters to its group's DLQ."""
        for name, letters in prep.dead.items():
            await self.by_name[name].dead_letter(prep.records[name], letters)

    async def _commit(self, prep: Prepared, watermarks: Mapping[str, int]) -> bool:
        """Step 5: commit (fenced), count. True: the run stops (fenced; status set)."""
        res, t = self.res, time.monotonic()
        try:
            await commit_batch(self.sides, prep, watermarks, independent=self.independent)
        except FenceConflictError as e:
            res.fence_conflicts += 1
            res.status = "fenced"
            res.detail = f"{e}; a newer holder owns this range, stopping"
            # Stop renewing the leases (nobody else holds them): left unacknowledged, they are
            # redelivered to the partitions' next run after the ack wait. Independent sides
            # other than the conflicting one are this run's alone: put back at once.
            for side in self.sides:
                if self.independent and side.ctx.app_id == e.app_id:
                    side.ctx.end("fenced", res.detail)
                if side.lease is None:
                    continue
                if self.independent and side.ctx.app_id != e.app_id:
                    await side.put_back()
                else:
                    await side.holder.release(side.lease)
            return True
        self.first.timed("commit", t)
        res.commits += 1
        res.rows_written += prep.table.num_rows if prep.table is not None else 0
        messages = sum(s.messages for s in prep.spans.values())
        if not prep.executor:  # an executor batch costs another path: it would skew the fit
            self.first.cost.observe(messages, prep.process_s + time.monotonic() - t)
        left = 0
        for name, span in prep.spans.items():
            c = self.by_name[name].ctx
            s = c.side
            s.watermark = span.last
            s.processed += span.messages - len(prep.dead.get(name, ()))
            s.first_seq = s.first_seq or span.first
            s.last_seq = span.last
            left += max(0, c.pending - s.processed - s.dead_lettered - s.duplicates_skipped)
        self._step("committed", commits=res.commits, processed=res.processed,
                   dead_lettered=res.dead_lettered, left=left,
                   seconds=time.monotonic() - self.first.t0, **self._ranges(prep.spans))
        return False

    async def _settle(self, done: Unsettled, halted: Mapping[str, DeadLetter],
                      take_next: bool) -> bool:
        """Steps 6-7 for each side with messages in the committed batches ``done`` (``halted``:
        the halted sides of the last of them), in leasing order (the sides of a run over
        several partitions concurrently, :func:`~cg_pipelines.engine.reads.at_once`, after ONE
        purge of them all when ``done`` is all that its split reads found,
        :meth:`~cg_pipelines.engine.reads.SplitRead.purge_below`): :meth:`_settle_side`. True:
        the run stops (halted, handed over; status set)."""
        sides = [s for s in self.leasing if s.name in done.spans]
        if self.independent and len(sides) > 1:
            purged = False
            split = self.reads.split
            if split is not None and done.window is not None and not halted:
                purged = await split.purge_below(done.window, done.committed)
            await at_once(sides, lambda s: self._settle_side(s, done.spans[s.name], halted,
                                                             take_next, purged))
            stop = (take_next and not halted and all(s.lease is None for s in self.sides)
                    and any(s.ctx.side.status == "handed_over" for s in sides))
        else:
            stop = False
            for side in sides:
                await self._settle_side(side, done.spans[side.name], halted, take_next)
                if take_next and not halted and (
                        self.res.status == "handed_over" or (
                            self.independent and side.ctx.side.status == "handed_over"
                            and all(s.lease is None for s in self.sides))):
                    return True
        self.settled_at = time.monotonic()
        if halted:
            # A bad message is now its partition's first: leave it for an operator.
            await self._halt(halted)
            return True
        return stop

    async def _settle_side(self, side: Side, span: Span, halted: Mapping[str, DeadLetter],
                           take_next: bool, purged: bool = False) -> None:
        """Settle ``side``'s committed ``span`` (release the keep-alive, then purge, unless
        ``purged`` already, and ack: no keep-alive pull may be waiting when a lease is acked),
        then, with ``take_next`` and no halt, take its next lease."""
        t = time.monotonic()
        await side.settled(span.first, span.last, purged=purged, messages=span.messages)
        self.first.timed("settle", t)
        if halted:
            side.lease = None  # acknowledged: the run stops
            return
        side.ctx.step("acked", first_seq=span.first, last_seq=span.last)
        if take_next:
            await side.next()

    async def _halt(self, halted: Mapping[str, DeadLetter]) -> None:
        """Stop at each halted side's bad message: its lease (if still held) given back."""
        for name, bad in halted.items():
            side = self.by_name[name]
            await side.put_back()
            await side.halt(bad)

    async def _commit_and_next(self, prep: Prepared, watermarks: Mapping[str, int],
                               window: Window | None = None, *, defer: bool = False) -> bool:
        """Steps 5-7: :meth:`_commit`, then :meth:`_settle` (of ``prep`` read as ``window``,
        with the batches owed before it) with each settled side's next lease; with ``defer``
        (the batch loop), a commit less than ``settle_interval_s`` after the last settle is
        owed instead (:meth:`_settle_owed`). True: the run stops (status set)."""
        if await self._commit(prep, watermarks):
            return True
        done = Unsettled.of(prep, window)
        if self.owed is not None:
            done = self.owed.then(done)
        if (defer and not prep.halted
                and time.monotonic() - self.settled_at < self.opt.settle_after_s()):
            self.owed = done
            return False
        self.owed = None
        return await self._settle(done, prep.halted, True)

    async def _settle_owed(self) -> bool:
        """Settle the committed batches owed, if any, with each side's next lease. True: the
        run stops (status set)."""
        owed, self.owed = self.owed, None
        return owed is not None and await self._settle(owed, {}, True)

    async def process_and_commit(self, lease: Lease, records: pa.Table, watermark: int
                                 ) -> bool:
        """A run of one side settled by its own loop (a static group): process,
        dead-letter, commit and settle ``records`` held as ``lease``, in that order, over the
        ``watermark`` read. Returns True to stop the run."""
        side = self.sides[0]
        side.lease = lease
        side.ctx.inflight = (records["seq"][0].as_py(), records["seq"][-1].as_py())
        prep = await self._prepare({side.name: records})
        if not prep.spans:  # halted at the batch's first message
            await self._halt(prep.halted)
            return True
        await self._dead_letter(prep)
        return (await self._commit(prep, {side.name: watermark})
                or await self._settle(Unsettled.of(prep, None), prep.halted, False))

    async def _executor_batch(self, watermarks: Mapping[str, int]) -> bool:
        """Steps 2-3 on the executors for a large backlog, then 4-7 as any batch (a step that
        processes ranges covers one side). True: done (the caller decides again); False: the
        executor read is not used for this range."""
        if self.proc.range_processor() is None:
            return False
        side = self.sides[0]
        assert side.lease is not None and len(self.sides) == 1
        first = max(side.lease.seq, watermarks[side.name] + 1)
        source = await side.executor_source(first)
        if source is None:
            return False
        await side.drop_prefetch()
        last = side.start_last
        t = time.monotonic()
        got = await asyncio.to_thread(self.proc.process_range, source, first, last)
        process_s = time.monotonic() - t
        timings = self.res.timings
        for k, v in got.timings.items():
            timings[k] = timings.get(k, 0.0) + v
        timings.setdefault("read_executors", 0.0)
        if got.messages == 0 or got.first_seq is None or got.last_seq is None:
            if not await side.stale_empty_read(first, last):
                # The leased message was purged after a commit (crash before its ack).
                await side.holder.ack(side.lease)
                await side.next()
            return True
        span = Span(got.first_seq, got.last_seq, got.last_origin_seq, got.messages)
        side.ctx.inflight = (span.first, span.last)
        check_range(got, first, last)
        side.ctx.step("read", first_seq=span.first, last_seq=span.last, executors=True)
        table = got.processed.table
        if self.proc.state is not None:
            self.proc.state.update(table)  # as _prepare: the cache goes on a fence
        spans = {side.name: span}
        self._step("processed", **self._ranges(spans))
        dead = {side.name: got.processed.dead} if got.processed.dead else {}
        prep = Prepared({side.name: got.dead_records}, table, dead, {}, process_s, spans,
                        executor=True)
        await self._dead_letter(prep)
        await self._commit_and_next(prep, watermarks)
        return True

    async def _pipeline(self, window: Window, watermarks: Mapping[str, int]) -> None:
        """Steps 3-7 with commit and settle off the critical path: batch k+1 is processed
        while batch k commits (fenced, in order), purges, acks and the next leases come back.
        The batch after is read meanwhile too. Returns when the outer loop must decide (a
        batch that no longer lines up, a limit, nothing read ahead) or the run stops."""
        pending: asyncio.Task[bool] | None = None
        wms = watermarks
        try:
            while True:
                spans = spans_of(window.tables)
                for name, span in spans.items():
                    side = self.by_name[name]
                    side.ctx.inflight = (span.first, span.last)
                    side.ctx.step("read", first_seq=span.first, last_seq=span.last)
                self.reads.ahead(window, spans, self._size())
                # 3. Process (while the previous batch commits).
                prep = await self._prepare(window.tables)
                if pending is not None:
                    stop, pending = await pending, None
                    if stop:
                        return
                    owed = self.owed.spans if self.owed is not None else {}
                    if not self.reads.lines_up(spans, window, owed) or self.first.limit_hit():
                        # Not where this batch starts (or a limit): drop it, and the state it
                        # added to the cache, settle what is owed and let the outer loop
                        # decide.
                        if self.proc.state is not None:
                            self.proc.state.reset()
                        await self._settle_owed()
                        return
                if not prep.spans:  # halted at every side's first message
                    if not await self._settle_owed():
                        await self._halt(prep.halted)
                    return
                # 4. Dead-letter.
                await self._dead_letter(prep)
                # 5.-7. off the critical path: commit (fenced), settle, next leases.
                pending = asyncio.create_task(
                    self._commit_and_next(prep, wms, window, defer=True))
                wms = {**wms, **{n: s.last for n, s in prep.spans.items()}}
                nxt = None if prep.halted else await self.reads.following(window, spans)
                if nxt is None:
                    task, pending = pending, None
                    if not await task:
                        await self._settle_owed()
                    return
                window = nxt
        finally:
            if pending is not None:  # an error or cancellation: let the commit finish first
                with contextlib.suppress(BaseException):
                    await pending


def merge_figures(figures: Sequence[Mapping[str, int | float | str]]
                  ) -> dict[str, int | float | str]:
    """The upkeep figures of several sides as one dict: numbers summed, words (``"no"``,
    ``"yes"``, an error) the distinct ones joined by ``"; "``; ``sides``: how many."""
    out: dict[str, int | float | str] = {}
    words: dict[str, list[str]] = {}
    for f in figures:
        for k, v in f.items():
            if isinstance(v, str):
                if v not in words.setdefault(k, []):
                    words[k].append(v)
            else:
                prev = out.get(k, 0)
                out[k] = (prev if isinstance(prev, (int, float)) else 0) + v
    out.update({k: "; ".join(v) for k, v in words.items()})
    if figures:
        out["sides"] = len(figures)
    return out
