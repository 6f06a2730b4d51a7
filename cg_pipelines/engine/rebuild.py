"""Rebuild partition ``p`` from the origin history of each of its sides, atomically (a backfill
that recomputes): the rebuild of a partition run (one side) and of a co-partitioned run (one
side per input) are the same run.

A drain processes what the work queue holds; what it committed can only be as good as the code
that first processed it. A rebuild recomputes partition ``p`` with today's processor:

1. **Lease** ``p`` on every side, in the run's fixed order (sorted by stream, then group), as a
   drain does, so no drain of ``p`` runs meanwhile (:meth:`~cg_pipelines.engine.replay.
   SideRebuild.take_lease`); a side held by another instance makes the rebuild ``held``.
2. **Range** of each side (:meth:`~cg_pipelines.engine.replay.SideRebuild.plan`): its
   committed watermark ``W`` and the origin sequences to replay (the whole history through
   what was committed, before what is still queued). A side with nothing committed replays
   nothing; with nothing committed on any side the rebuild is ``empty``.
3. **Replay** every side's history in lockstep (:mod:`cg_pipelines.engine.replay`): each step
   hands the processing step (:class:`~cg_pipelines.engine.step.BatchStep`, ``mode``
   ``"rebuild"``) the next batch of every side (an exhausted side gets an empty batch), from
   empty state, per-key state carried in memory from batch to batch. Payloads it rejects are
   counted, not published again (the drain dead-lettered them). A join transform gives the
   same result whatever the interleaving of its inputs, so the rebuilt rows are what draining
   the same history leaves.
4. **Replace, fenced on every side.** Stream the new rows into ONE transaction that replaces
   ``p``'s rows (in :class:`~cg_pipelines.core.write.Merge` mode: each key's last row, deleted
   keys dropped, which is what a fresh drain leaves) and keeps every side's watermark
   (:meth:`~cg_pipelines.sinks.base.TableSink.replace_partition`), recording each side's
   replayed origin range as its origin marker and coverage (``cg.coverage_through``: every
   message of the partition through it, for the reconcile check): if another holder committed
   a side meanwhile, nothing is written (``fenced``); if the processor raises or the process
   dies, nothing is written either and the old rows stay.
5. **Release** the leases; live draining continues from each side's watermark: no gap, no
   duplicate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import pyarrow as pa
from nats.aio.client import Client

from cg_pipelines.core.coverage import COVERAGE_THROUGH_KEY, JOIN_LINEAGE_KEY
from cg_pipelines.core.record import RECORD_SCHEMA
from cg_pipelines.engine.commit import span_info, spans_of
from cg_pipelines.engine.context import open_run, refuse_after_migration
from cg_pipelines.engine.join import JoinInput, check_inputs, open_inputs
from cg_pipelines.engine.join_processor import JoinProcessor
from cg_pipelines.engine.lease import guard_all
from cg_pipelines.engine.options import EngineOptions, Hook
from cg_pipelines.engine.processor import Processor
from cg_pipelines.engine.replay import RebuildError, ReplayRange, SideRebuild
from cg_pipelines.engine.result import RunResult
from cg_pipelines.engine.state import KeyStateCache
from cg_pipelines.engine.step import BatchStep, JoinStep, SingleStep
from cg_pipelines.sinks.base import FenceConflictError, TableSink, origin_marker

__all__ = ["RebuildError", "fit_to_table", "queued_batches", "rebuild_copartitioned",
           "rebuild_partition"]

def queued_batches(out: queue.Queue[pa.Table | BaseException | None], written: dict[str, int]
                   ) -> Iterator[pa.RecordBatch]:
    """The writer thread's side of a rebuild: the batches of the tables the replay puts on
    ``out`` until ``None``, counting their rows in ``written["rows"]``; an exception put there
    (the replay failed) is raised here, so the writer fails and writes nothing."""
    while True:
        item = out.get()
        if item is None:
            return
        if isinstance(item, BaseException):
            raise item
        written["rows"] += item.num_rows
        yield from item.to_batches()


def fit_to_table(table: pa.Table | None, schema: pa.Schema) -> pa.Table | None:
    """A rebuild's processor output as the table's columns and types (``None`` stays None).

    Raises:
        RebuildError: a table column is missing from the output, or does not cast.
    """
    if table is None:
        return None
    missing = [n for n in schema.names if n not in table.column_names]
    if missing:
        raise RebuildError(f"the processor's output lacks the table's columns {missing}: "
                           "a partition rebuild keeps the table's schema")
    try:
        return table.select(schema.names).cast(schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise RebuildError(f"the processor's output does not fit the table's schema: "
                           f"{e}") from e



async def put(out: queue.Queue[Any], item: Any, writer: asyncio.Task[Any]) -> None:
    """Hand ``item`` to the writer thread (bounded: backpressure), unless it failed.

    Raises:
        The writer's error; RebuildError: the writer stopped without one.
    """
    while True:
        if writer.done():
            writer.result()  # raises the writer's error
            raise RebuildError("the table writer stopped early")
        try:
            out.put_nowait(item)
            return
        except queue.Full:
            await asyncio.sleep(0.01)


class Rebuild:
    """The rebuild run over ``sides`` (in the run's order: the first side's app id records the
    replace) with the processing step ``step`` (see the module docstring); ``hook`` gets the
    joint steps (``processed``), the sides' contexts their own (``leased``, ``rebuilt``)."""

    def __init__(self, sides: Sequence[SideRebuild], step: BatchStep, sink: TableSink,
                 hook: Hook | None) -> None:
        self.sides, self.step, self.sink, self.hook = list(sides), step, sink, hook
        self.names = [s.ctx.name for s in self.sides]
        self.by_name = {s.ctx.name: s for s in self.sides}
        self.leasing = sorted(self.sides, key=lambda s: (s.ctx.stream, s.ctx.group))
        self.res: RunResult = self.sides[0].ctx.res

    async def run(self) -> None:
        """Steps 1-5 of the module docstring."""
        taken: list[SideRebuild] = []
        try:
            for side in self.leasing:
                if not await side.take_lease():
                    if len(self.sides) > 1:
                        self.res.detail = f"input {side.ctx.name}: {self.res.detail}"
                    return
                taken.append(side)
            await self._rebuild()
        finally:
            for side in taken:
                await side.release_lease()

    async def _rebuild(self) -> None:
        ranges: dict[str, ReplayRange | None] = {}
        for side in reversed(self.sides):  # the first side's snapshot is loaded last
            ranges[side.ctx.name] = await side.plan()
        if all(r is None for r in ranges.values()):
            self.res.status = "empty"
            self.res.detail = "nothing committed yet: nothing to rebuild"
            return
        first = self.sides[0]
        schema = await asyncio.to_thread(lambda: self.sink.stats().schema)
        spec = self.step.spec
        self.step.state = KeyStateCache(spec, None, self.sink.write) if spec else None
        self.step.mode = "rebuild"
        out: queue.Queue[pa.Table | BaseException | None] = queue.Queue(maxsize=2)
        written = {"rows": 0}
        reader = pa.RecordBatchReader.from_batches(schema, queued_batches(out, written))
        wms = {s.ctx.app_id: (r.watermark if r else 0)
               for s, r in ((s, ranges[s.ctx.name]) for s in self.sides)}
        markers = {origin_marker(self.by_name[n].ctx.app_id): r.through
                   for n, r in ranges.items() if r is not None}
        fenced = {"fenced": {a: w for a, w in wms.items() if a != first.ctx.app_id}} \
            if len(self.sides) > 1 else {}
        writer = asyncio.create_task(asyncio.to_thread(
            self.sink.replace_partition, reader, first.ctx.partition, first.ctx.app_id,
            wms[first.ctx.app_id], markers, lineage=self._lineage(ranges), **fenced))
        try:
            async for batches in self._lockstep(ranges):
                table = await self._process(batches, schema)
                if table is not None and table.num_rows:
                    await put(out, table, writer)
            await put(out, None, writer)
        except BaseException as e:
            with contextlib.suppress(queue.Full):
                out.put_nowait(RebuildError(f"rebuild stopped: {type(e).__name__}: {e}"))
            with contextlib.suppress(BaseException):
                await writer
            raise
        await self._done(writer, written["rows"], ranges)

    async def _done(self, writer: asyncio.Task[int], written: int,
                    ranges: dict[str, ReplayRange | None]) -> None:
        res = self.res
        try:
            res.rows_replaced = int(await writer or 0)
        except FenceConflictError as e:
            res.fence_conflicts += 1
            res.status = "fenced"
            res.detail = f"{e}; another holder committed meanwhile: nothing was written"
            return
        # merge mode: the rows left in the table (each key's last), not the replay's output
        table_rows = self.sink.last_rows_written
        res.rows_written = written if table_rows is None else int(table_rows)
        res.commits += 1  # the replacement is one table version
        res.status = "rebuilt"
        origin = ", ".join(f"{r.first}..{r.through}" for r in ranges.values() if r is not None)
        res.detail = (f"origin sequences {origin}: {res.messages_read} messages read, "
                      f"{res.processed} of partition {self.sides[0].ctx.partition}, "
                      f"{res.rows_replaced} rows replaced by {res.rows_written}")
        for side in self.sides:
            r = ranges[side.ctx.name]
            if r is not None:
                side.ctx.step("rebuilt", origin_first_seq=r.first, origin_last_seq=r.through)

    def _lineage(self, ranges: dict[str, ReplayRange | None]) -> dict[str, object]:
        """The replace's lineage: one side's origin range and the work-queue range its rows
        stand for (the partition's whole history through the watermark), or per side as
        ``cg.join``. ``cg.coverage_through``: every message of the partition through that
        origin sequence is accounted for (the reconcile check)."""
        if len(self.sides) == 1:
            c, r = self.sides[0].ctx, ranges[self.sides[0].ctx.name]
            assert r is not None
            return {"stream": c.stream, "group": c.group, "partition": c.partition,
                    "origin_first_seq": r.first, "origin_last_seq": r.through,
                    "first_seq": 1, "last_seq": r.watermark, "last_origin_seq": r.through,
                    COVERAGE_THROUGH_KEY: r.through}
        per = [{"name": s.ctx.name, "stream": s.ctx.stream, "group": s.ctx.group,
                "app_id": s.ctx.app_id, "origin_first_seq": r.first if r else None,
                "origin_last_seq": r.through if r else None,
                COVERAGE_THROUGH_KEY: r.through if r else None}
               for s, r in ((s, ranges[s.ctx.name]) for s in self.sides)]
        return {JOIN_LINEAGE_KEY: json.dumps(per, separators=(",", ":"))}

    async def _lockstep(self, ranges: dict[str, ReplayRange | None]
                        ) -> AsyncIterator[dict[str, pa.Table]]:
        """The next batch of every side at each step (empty for an exhausted side) until all
        are exhausted."""
        iters = {n: self.by_name[n].replay(r) for n, r in ranges.items() if r is not None}
        live = set(iters)
        while live:
            step: dict[str, pa.Table] = {}
            for name in self.names:
                step[name] = RECORD_SCHEMA.empty_table()
                if name in live:
                    try:
                        step[name] = await anext(iters[name])
                    except StopAsyncIteration:
                        live.discard(name)
            if any(t.num_rows for t in step.values()):
                yield step

    async def _process(self, batches: dict[str, pa.Table], schema: pa.Schema
                       ) -> pa.Table | None:
        """One lockstep batch through the processing step, counted per side, taken as the
        newest state, fitted to the table's schema."""
        t = time.monotonic()
        table, dead = await asyncio.to_thread(self.step.process, batches)
        self.sides[0].ctx.timed("process", t)
        for name, b in batches.items():
            s = self.by_name[name].ctx.side
            s.processed += b.num_rows - len(dead.get(name, ()))
            s.dead_lettered += len(dead.get(name, ()))
        if self.step.state is not None:
            self.step.state.update(table)
        if self.hook is not None:
            self.hook("processed", span_info(self.names, spans_of(batches)))
        return fit_to_table(table, schema)

    async def guarded(self) -> RunResult:
        """:meth:`run` inside every side's lease guard (the group's config read and the lease
        consumer ensured first); the result."""
        await guard_all([(s.lease, s.ensure) for s in self.leasing], self.run)
        return self.res


async def rebuild_partition(
    nc: Client,
    stream: str,
    group: str,
    partition: int,
    processor: Processor,
    sink: TableSink,
    options: EngineOptions | None = None,
    *,
    allow_partial: bool = False,
    hook: Hook | None = None,
) -> RunResult:
    """Rebuild one partition of an elastic group from the origin stream's history (see module
    docstring): its rows replaced, its watermark kept, in one fenced transaction.

    Args:
        nc: a connected nats-py client.
        stream, group, partition: as for :func:`~cg_pipelines.engine.run_partition`.
        processor: the processing step (today's code: the rows it gives replace the old ones).
        sink: a :class:`~cg_pipelines.sinks.base.TableSink` (its ``replace_partition``).
        options: :class:`~cg_pipelines.engine.EngineOptions` (batch sizes, timeouts; a rebuild
            never halts: bad payloads are counted).
        allow_partial: rebuild from what the origin stream still holds when retention trimmed
            its beginning (the result then lacks the trimmed messages' effects).
        hook: step callback (``leased``, ``processed`` per replayed batch, ``rebuilt``).

    Returns:
        A :class:`~cg_pipelines.engine.result.RunResult` with ``status`` ``"rebuilt"``
        (``origin_first_seq``/``origin_last_seq``: the origin range; ``processed``: the
        partition's messages; ``messages_read``; ``rows_replaced``; ``rows_written``),
        ``"held"`` (another instance holds the partition), ``"empty"`` (nothing committed yet)
        or ``"fenced"`` (another holder committed meanwhile: nothing written).

    Raises:
        ConfigError: ``partition`` is negative.
        RebuildError: the rebuild cannot be done as asked (see the class); nothing is written.
        EngineConfigError: ``sink`` is not a table sink (members missing, named).
        Exceptions of the processor (nothing is written, the old rows stay) and NATS errors as
        :func:`~cg_pipelines.engine.run_partition` raises them.
    """
    ctx = open_run(nc, stream, group, partition, processor, sink, options, hook)
    await refuse_after_migration([ctx], "a rebuild")
    side = SideRebuild(ctx, sink, allow_partial=allow_partial)
    return await Rebuild([side], SingleStep(ctx), sink, hook).guarded()


async def rebuild_copartitioned(
    nc: Client, inputs: Sequence[JoinInput], partition: int, processor: JoinProcessor,
    sink: TableSink, options: EngineOptions | None = None, *, allow_partial: bool = False,
    hook: Hook | None = None,
) -> RunResult:
    """Rebuild partition ``partition`` of a co-partitioned set (see the module docstring):
    the same run as :func:`rebuild_partition` over one side per input.

    Args:
        nc, inputs, partition, processor, options, hook: as
            :func:`~cg_pipelines.engine.join.run_copartitioned` (``hook``: ``processed`` per
            replayed batch, per input ``leased`` and ``rebuilt``).
        sink: a :class:`~cg_pipelines.sinks.base.TableSink`.
        allow_partial: rebuild from what the origin streams still hold when retention trimmed
            their beginning.

    Returns:
        A :class:`~cg_pipelines.engine.result.RunResult`: ``rebuilt`` (each input's
        ``origin_first_seq``/``origin_last_seq``, ``processed``, ``messages_read`` in
        ``inputs``; ``rows_written``), ``held``, ``empty`` (nothing committed for any input) or
        ``fenced`` (another holder committed an input meanwhile: nothing written).

    Raises:
        RebuildError, EngineConfigError, UsageError, the processor's and NATS errors: as
        :func:`rebuild_partition`; nothing is written.
    """
    opt = options or EngineOptions()
    check_inputs(inputs, processor)
    ctxs = open_inputs(nc, inputs, partition, sink, opt, hook)
    await refuse_after_migration(ctxs, "a rebuild")
    sides = [SideRebuild(c, sink, allow_partial=allow_partial) for c in ctxs]
    return await Rebuild(sides, JoinStep(processor, ctxs), sink, hook).guarded()
