"""Rebuild partition ``p`` of a co-partitioned set from every input's origin history, in one
fenced replace (the set's counterpart of :mod:`cg_pipelines.engine.rebuild`).

1. **Lease** partition ``p`` of every input in the run's fixed order (sorted by stream, then
   group), each as a single rebuild leases (:meth:`~cg_pipelines.engine.rebuild.
   PartitionRebuild.take_lease`); an input held by another instance makes the rebuild ``held``
   and releases what was taken.
2. **Range** of each input (:meth:`~cg_pipelines.engine.rebuild.PartitionRebuild.plan`): its
   committed watermark and the origin sequences to replay (the whole history through what was
   committed, before what is still queued). An input with nothing committed replays nothing.
3. **Replay** the inputs' histories in lockstep: each step hands the processor the next batch
   of every input (an exhausted input gets an empty batch), from empty state, state carried in
   memory across batches. A join transform gives the same result whatever the interleaving of
   its inputs (a drain sees arbitrary interleavings too), so the rebuilt rows are what
   draining the same history leaves.
4. **Replace, fenced on every input**: one commit replaces ``p``'s rows and keeps every
   input's watermark (:meth:`~cg_pipelines.sinks.base.ReplaceSink.replace_partition` with
   ``fenced``), recording each input's replayed origin range; a commit of any input by another
   holder meanwhile makes it ``fenced`` (nothing written).
5. **Release** the leases; draining continues from each input's watermark.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import time
from collections.abc import AsyncIterator, Sequence

import pyarrow as pa
from nats.aio.client import Client

from cg_pipelines.core.coverage import COVERAGE_THROUGH_KEY, JOIN_LINEAGE_KEY
from cg_pipelines.core.record import RECORD_SCHEMA
from cg_pipelines.engine.context import open_run
from cg_pipelines.engine.join import (
    JoinInput,
    JoinResult,
    NoProcessing,
    check_inputs,
    tag_hook,
)
from cg_pipelines.engine.join_processor import JoinContext, JoinProcessor
from cg_pipelines.engine.options import EngineConfigError, EngineOptions, Hook
from cg_pipelines.engine.rebuild import (
    PartitionRebuild,
    RebuildError,
    ReplayRange,
    fit_to_table,
    queued_batches,
)
from cg_pipelines.engine.state import KeyStateCache
from cg_pipelines.sinks.base import (
    FenceConflictError,
    JoinSink,
    ReplaceSink,
    origin_marker,
    with_partition_column,
)

__all__ = ["rebuild_copartitioned"]


async def rebuild_copartitioned(
    nc: Client, inputs: Sequence[JoinInput], partition: int, processor: JoinProcessor,
    sink: JoinSink, options: EngineOptions | None = None, *, allow_partial: bool = False,
    hook: Hook | None = None,
) -> JoinResult:
    """Rebuild partition ``partition`` of a co-partitioned set (see the module docstring).

    Args:
        nc, inputs, partition, processor, options, hook: as
            :func:`~cg_pipelines.engine.join.run_copartitioned`.
        sink: a sink that is both a :class:`~cg_pipelines.sinks.base.JoinSink` and a
            :class:`~cg_pipelines.sinks.base.ReplaceSink` (Delta, Iceberg).
        allow_partial: rebuild from what the origin streams still hold when retention trimmed
            their beginning.

    Returns:
        A :class:`~cg_pipelines.engine.join.JoinResult`: ``rebuilt`` (each input's
        ``origin_first_seq``/``origin_last_seq``, ``processed``, ``messages_read`` in
        ``inputs``; ``rows_written``), ``held``, ``empty`` (nothing committed for any input) or
        ``fenced`` (another holder committed an input meanwhile: nothing written).

    Raises:
        RebuildError, EngineConfigError, UsageError, the processor's and NATS errors: as
        :func:`~cg_pipelines.engine.rebuild.rebuild_partition`; nothing is written.
    """
    opt = options or EngineOptions()
    check_inputs(inputs, processor, sink, opt)
    if not isinstance(sink, ReplaceSink):
        raise EngineConfigError(f"{type(sink).__name__} cannot replace a partition's rows")
    names = [i.name for i in inputs]
    sides: dict[str, PartitionRebuild] = {}
    for inp in sorted(inputs, key=lambda i: (i.stream, i.group)):
        ctx = open_run(nc, inp.stream, inp.group, partition, NoProcessing(), sink, opt,
                       tag_hook(hook, inp.name))
        ctx.state = None
        sides[inp.name] = PartitionRebuild(ctx, sink, allow_partial=allow_partial)
    run = _SetRebuild(sides, names, inputs, partition, processor, sink)
    order = list(sides.values())

    async def nest(k: int) -> None:
        if k == len(order):
            await run.run()
            return
        await order[k].lease.guard(order[k].ensure, lambda: nest(k + 1))

    try:
        await nest(0)
    finally:
        run.res.seconds = time.monotonic() - run.t0
    return run.res


class _SetRebuild:
    def __init__(self, sides: dict[str, PartitionRebuild], names: list[str],
                 inputs: Sequence[JoinInput], partition: int, processor: JoinProcessor,
                 sink: ReplaceSink) -> None:
        self.sides, self.names, self.inputs = sides, names, inputs
        self.partition, self.processor, self.sink = partition, processor, sink
        self.res = JoinResult(partition, inputs={n: s.ctx.res for n, s in sides.items()})
        self.t0 = time.monotonic()

    async def run(self) -> None:
        taken: list[PartitionRebuild] = []
        try:
            for name, side in self.sides.items():
                if not await side.take_lease():
                    self.res.status = "held"
                    self.res.detail = f"input {name}: {side.ctx.res.detail}"
                    return
                taken.append(side)
            await self._rebuild()
        finally:
            for side in taken:
                await side.release_lease()

    async def _rebuild(self) -> None:
        ranges: dict[str, ReplayRange | None] = {}
        for name in reversed(self.names):  # the first input's snapshot is loaded last
            ranges[name] = await self.sides[name].plan()
        if all(r is None for r in ranges.values()):
            self.res.status, self.res.detail = "empty", "nothing committed yet: nothing to rebuild"
            return
        primary = self.sides[self.names[0]].ctx.app_id
        wms = {self.sides[n].ctx.app_id: (r.watermark if r else 0) for n, r in ranges.items()}
        markers = {origin_marker(self.sides[n].ctx.app_id): r.through
                   for n, r in ranges.items() if r is not None}
        lineage = [{"name": n, "stream": self.sides[n].ctx.stream,
                    "group": self.sides[n].ctx.group, "app_id": self.sides[n].ctx.app_id,
                    "origin_first_seq": r.first if r else None,
                    "origin_last_seq": r.through if r else None,
                    COVERAGE_THROUGH_KEY: r.through if r else None}
                   for n, r in ((n, ranges[n]) for n in self.names)]
        schema = await asyncio.to_thread(self.sides[self.names[0]].table_schema)
        spec = self.processor.state
        cache = KeyStateCache(spec, None, self.sink.write) if spec is not None else None
        out: queue.Queue[pa.Table | BaseException | None] = queue.Queue(maxsize=2)
        written = {"rows": 0}

        reader = pa.RecordBatchReader.from_batches(schema, queued_batches(out, written))
        writer = asyncio.create_task(asyncio.to_thread(
            self.sink.replace_partition, reader, self.partition, primary, wms[primary],
            markers, lineage={JOIN_LINEAGE_KEY: json.dumps(lineage, separators=(",", ":"))},
            fenced={a: w for a, w in wms.items() if a != primary}))
        try:
            async for tables in self._lockstep(ranges):
                table = await self._process(tables, schema, cache)
                if table is not None and table.num_rows:
                    await PartitionRebuild.put(out, table, writer)
            await PartitionRebuild.put(out, None, writer)
        except BaseException as e:
            with contextlib.suppress(queue.Full):
                out.put_nowait(RebuildError(f"rebuild stopped: {type(e).__name__}: {e}"))
            with contextlib.suppress(BaseException):
                await writer
            raise
        try:
            await writer
        except FenceConflictError as e:
            self.res.status = "fenced"
            self.res.detail = f"{e}; another holder committed meanwhile: nothing was written"
            return
        table_rows = self.sink.last_rows_written
        self.res.rows_written = written["rows"] if table_rows is None else int(table_rows)
        self.res.commits = 1
        self.res.status = "rebuilt"

    async def _lockstep(self, ranges: dict[str, ReplayRange | None]
                        ) -> AsyncIterator[dict[str, pa.Table]]:
        """The next batch of every input at each step (empty for an exhausted input) until
        all are exhausted."""
        iters: dict[str, AsyncIterator[pa.Table]] = {
            n: self.sides[n].replay(r) for n, r in ranges.items() if r is not None}
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

    async def _process(self, tables: dict[str, pa.Table], schema: pa.Schema,
                       cache: KeyStateCache | None) -> pa.Table | None:
        ranges = {n: ((t["seq"][0].as_py(), t["seq"][-1].as_py()) if t.num_rows else None)
                  for n, t in tables.items()}
        ctx = JoinContext(self.partition, ranges,
                          {n: self.sides[n].ctx.app_id for n in self.names}, self.sink, cache,
                          "rebuild")
        got = await asyncio.to_thread(self.processor.process_inputs, tables, ctx)
        for name, t in tables.items():
            r = self.sides[name].ctx.res
            r.processed += t.num_rows - len(got.dead.get(name, ()))
            r.dead_lettered += len(got.dead.get(name, ()))
        table = with_partition_column(got.table, self.partition)
        if cache is not None:
            cache.update(table)
        return fit_to_table(table, schema)

