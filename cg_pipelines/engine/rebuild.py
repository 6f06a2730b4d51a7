"""Rebuild one partition from the origin stream's history, atomically (a backfill that
recomputes).

A drain processes what the work queue holds; what it committed can only be as good as the code
that first processed it. A rebuild recomputes partition ``p`` with today's processor:

1. **Lease.** Take ``p``'s lease as a drain does, so no drain of ``p`` runs meanwhile: with a
   backlog, pull and hold one message (renewed, never processed here); without one, keep one
   pull request waiting at the head of the lease consumer's queue for the whole rebuild, so a
   message arriving meanwhile is delivered to this run, which then holds it. A drain started
   during the rebuild finds the partition ``held`` and drains after it.
2. **Range.** Read the committed watermark ``W`` and the origin sequence ``O`` of the last
   committed message (each commit records it, :func:`~cg_pipelines.sinks.base.origin_marker`).
   Refuse when the origin stream no longer holds its whole history (its first sequence is
   not 1, or messages were deleted) unless ``allow_partial``. The replay goes through ``X``:
   the origin's last message, unless the work queue's source has not passed it yet (then the
   origin sequence of the work queue's last message), and before the partition's first
   message still queued (the drain processes those); never below ``O``. So a gap at the
   partition's tail (messages that never reached the work queue after its last commit) is
   repaired too.
3. **Replay.** Read the origin stream from its first message up to ``X`` in order, keep the
   messages whose subject maps to ``p`` (:class:`~cg_pipelines.core.partitioning.
   SubjectPartitioner`: the work queue's own transform), and run the processor over them in
   batches from empty state (per-key state carried in memory from batch to batch).
   Payloads it rejects are counted, not published again (the drain dead-lettered them).
4. **Replace, fenced.** Stream the new rows into ONE Delta transaction that replaces ``p``'s
   rows (in :class:`~cg_pipelines.core.write.Merge` mode: each key's last row, deleted keys
   dropped, which is what a fresh drain leaves) and keeps the watermark at ``W``
   (:meth:`~cg_pipelines.sinks.delta.DeltaSink.replace_partition`), recording ``X`` as the
   partition's origin marker and its coverage (``cg.coverage_through``: every message of the
   partition through ``X``, for the reconcile check): if another holder committed
   ``p`` meanwhile, nothing is written (``fenced``); if the processor raises or the process
   dies, nothing is written either and the old rows stay.
5. **Release** the lease; live draining continues from ``W``: no gap, no duplicate.

Cost: a rebuild reads the origin stream's whole history (every partition's messages) to select
one partition's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import queue
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from nats.aio.client import Client

from cg_pipelines.core.config import ElasticConfig
from cg_pipelines.core.coverage import COVERAGE_THROUGH_KEY
from cg_pipelines.core.errors import CgError, GroupNotFoundError
from cg_pipelines.core.partitioning import SubjectPartitioner
from cg_pipelines.core.record import RECORD_SCHEMA, user_headers
from cg_pipelines.engine.context import RunContext, open_run
from cg_pipelines.engine.lease import Lease, LeaseHolder, lease_consumer_name
from cg_pipelines.engine.options import EngineConfigError, EngineOptions, Hook
from cg_pipelines.engine.processor import BatchContext, Processor, Record, records_to_arrow
from cg_pipelines.engine.result import RunResult
from cg_pipelines.engine.state import KeyStateCache
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import PullResult, consumer_config
from cg_pipelines.jetstream.rangeread import fast_path_available, read_range
from cg_pipelines.sinks.base import (
    FenceConflictError,
    ReplaceSink,
    Sink,
    origin_marker,
    with_partition_column,
)

__all__ = ["PartitionRebuild", "RebuildError", "ReplayRange", "fit_to_table", "queued_batches",
           "rebuild_partition"]

REPLAY_CHUNK = 50_000
"""Messages per direct-get read of the origin stream's history (a rebuild's replay)."""


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


def _payload_bytes(table: pa.Table) -> int:
    return int(pc.sum(pc.binary_length(table["data"])).as_py() or 0) if table.num_rows else 0


class RebuildError(CgError, RuntimeError):
    """A rebuild cannot be done as asked (nothing is written): e.g. the origin stream no longer
    holds the partition's whole history, no origin sequence was recorded, or the processor's
    output does not fit the table."""


@dataclass(frozen=True)
class ReplayRange:
    """What a rebuild replays: the committed ``watermark`` it keeps, the origin sequences
    ``first`` .. ``through``, and whether the origin is read by direct get (``direct``)."""

    watermark: int
    first: int
    through: int
    direct: bool


class PartitionRebuild:
    """A rebuild over the run's context ``ctx`` and the partition's elastic lease (the same
    consumer a drain leases on: see the module docstring, step 1)."""

    def __init__(self, ctx: RunContext, sink: ReplaceSink, allow_partial: bool = False) -> None:
        self.ctx, self.sink, self.allow_partial = ctx, sink, allow_partial
        self.lease = LeaseHolder(ctx, lease_consumer_name(ctx.partition))
        self._guard: asyncio.Task[Any] | None = None
        self._guard_lease: Lease | None = None
        self.config: ElasticConfig = ElasticConfig(1)

    # ------------------------------------------------------------------------ the lease

    async def take_lease(self) -> bool:
        """Hold the partition (see module docstring, step 1); False when another instance
        holds it (status ``held``)."""
        info = await self.lease.info()
        if int(info.get("num_pending") or 0) + int(info.get("num_ack_pending") or 0):
            got = await self.lease.pull("pull the lease", batch=1,
                                        expires_s=self.ctx.opt.hold_wait_s)
            if not got.messages:
                await self.lease.why_nothing()
                return False
            self._guard_lease = self.lease.hold(got.messages[0], got.pin_id)
            return True
        wait_s = self.ctx.opt.max_seconds or 3600.0

        async def waiting() -> None:
            got = await self.ctx.api.pull(self.ctx.read_stream, self.lease.cname, batch=1,
                                          expires_s=wait_s)
            if got.messages:  # a message arrived during the rebuild: hold it too
                self._guard_lease = self.lease.hold(got.messages[0], got.pin_id)

        self._guard = asyncio.create_task(waiting())
        await asyncio.sleep(0)
        return True

    async def release_lease(self) -> None:
        if self._guard is not None:
            self._guard.cancel()  # its inbox goes: the server drops the waiting request
            with contextlib.suppress(BaseException):
                await self._guard
        lease = self._guard_lease
        if lease is not None:
            await self.lease.release(lease)
            with contextlib.suppress(Exception):
                await lease.msg.nak()  # for the drain that follows, at once

    # ------------------------------------------------------------------------ the rebuild

    async def ensure(self) -> None:
        """Read the group's config (a static group is refused), then ensure the lease."""
        self.config = await self._group_config()
        await self.lease.ensure()

    async def _group_config(self) -> ElasticConfig:
        """The elastic group's config. Raises RebuildError for a static group."""
        try:
            v = await self.ctx.retry.call("group config", lambda: admin.get_elastic(
                self.ctx.js, self.ctx.stream, self.ctx.group, timeout=self.ctx.opt.timeout_s))
        except GroupNotFoundError:
            try:
                await admin.get_static(self.ctx.js, self.ctx.stream, self.ctx.group,
                                       timeout=self.ctx.opt.timeout_s)
            except GroupNotFoundError:
                raise
            raise RebuildError(
                f"{self.ctx.stream}.{self.ctx.group} is a static group: its stream is "
                "partitioned by the publishers (subjects <p>.<...>) and consumed in place, so "
                "there is no work queue to lease against and no origin sequence to replay up "
                "to; to recompute a static partition, drain it into a new table") from None
        return v.config

    async def run(self) -> None:
        """Steps 1-5 of the module docstring."""
        if not await self.take_lease():
            return
        try:
            await self._rebuild()
        finally:
            await self.release_lease()

    async def plan(self) -> ReplayRange | None:
        """Step 2: the committed watermark and the origin range to replay (see the module
        docstring); None (status ``empty``) when nothing was committed yet. The last read of
        the watermark loads the snapshot the final replace is fenced against.

        Raises:
            RebuildError: no origin sequence recorded, or the origin stream lost part of the
                history (unless ``allow_partial``).
        """
        res = self.ctx.res
        watermark = await asyncio.to_thread(self.sink.watermark, self.ctx.app_id)
        res.watermark = watermark
        if watermark == 0:
            res.status, res.detail = "empty", "nothing committed yet: nothing to rebuild"
            return None
        origin_last = await asyncio.to_thread(self.sink.watermark, origin_marker(self.ctx.app_id))
        if origin_last == 0:
            raise RebuildError(
                f"partition {self.ctx.partition}: no origin sequence recorded with its commits "
                "(committed before cg_pipelines 0.2): drain it once more before a rebuild")
        # the snapshot the final replace is fenced against
        await asyncio.to_thread(self.sink.watermark, self.ctx.app_id)
        c = self.ctx
        info = await c.retry.call("stream info", lambda: c.api.stream_info(c.stream))
        state = info["state"]
        first = int(state.get("first_seq") or 1)
        deleted = int(state.get("num_deleted") or 0)
        if (first > 1 or deleted) and not self.allow_partial:
            raise RebuildError(
                f"origin stream {self.ctx.stream!r} no longer holds the partition's whole history: "
                f"its first retained sequence is {first}"
                + (f" and {deleted} messages were deleted" if deleted else "")
                + "; nothing was changed (rebuild with allow_partial to use what is left)")
        # Replay through the origin's last message the work queue's source has passed, but
        # before the partition's first queued message: gaps at the partition's tail are
        # repaired too, and what is still queued is left to the drain (no duplicate).
        origin_last = max(origin_last, await self._replay_through(
            int(state.get("last_seq") or 0), watermark, origin_last))
        res.origin_first_seq, res.origin_last_seq = first, origin_last
        direct = bool((info.get("config") or {}).get("allow_direct")) and \
            fast_path_available(self.ctx.nc)
        return ReplayRange(watermark, first, origin_last, direct)

    def replay(self, rng: ReplayRange) -> AsyncIterator[pa.Table]:
        """Step 3's reads: the partition's origin messages of ``rng`` in order, as batches
        (:data:`~cg_pipelines.core.record.RECORD_SCHEMA`, ``seq`` = origin sequence)."""
        part = SubjectPartitioner(self.config)
        return (self._replay_direct(rng.first, rng.through, part) if rng.direct
                else self._replay(rng.first, rng.through, part, self.config))

    async def _rebuild(self) -> None:
        res = self.ctx.res
        rng = await self.plan()
        if rng is None:
            return
        watermark, first, origin_last = rng.watermark, rng.first, rng.through
        c = self.ctx
        schema = await asyncio.to_thread(self.table_schema)
        spec = self.ctx.processor.state
        cache = KeyStateCache(spec, None, self.sink.write) if spec is not None else None
        self.ctx.state = cache
        out: queue.Queue[pa.Table | BaseException | None] = queue.Queue(maxsize=2)
        written = {"rows": 0}

        reader = pa.RecordBatchReader.from_batches(schema, queued_batches(out, written))
        # first_seq/last_seq: the work-queue sequences whose effects the version holds (the
        # partition's whole history through the watermark); coverage_through: every message
        # of the partition through that origin sequence is accounted for (the reconcile check)
        lineage = {"stream": c.stream, "group": c.group, "partition": c.partition,
                   "origin_first_seq": first, "origin_last_seq": origin_last,
                   "first_seq": 1, "last_seq": watermark, "last_origin_seq": origin_last,
                   COVERAGE_THROUGH_KEY: origin_last}
        writer = asyncio.create_task(asyncio.to_thread(
            self.sink.replace_partition, reader, self.ctx.partition, self.ctx.app_id, watermark,
            {origin_marker(self.ctx.app_id): origin_last}, lineage=lineage))
        try:
            async for batch in self.replay(rng):
                table = await self._process_rebuild(batch, schema, cache)
                if table is not None and table.num_rows:
                    await self.put(out, table, writer)
            await self.put(out, None, writer)
        except BaseException as e:
            with contextlib.suppress(queue.Full):
                out.put_nowait(RebuildError(f"rebuild stopped: {type(e).__name__}: {e}"))
            with contextlib.suppress(BaseException):
                await writer
            raise
        try:
            res.rows_replaced = await writer
        except FenceConflictError as e:
            res.fence_conflicts += 1
            res.status = "fenced"
            res.detail = f"{e}; another holder committed meanwhile: nothing was written"
            return
        # merge mode: the rows left in the table (each key's last), not the replay's output
        table_rows = self.sink.last_rows_written
        res.rows_written = written["rows"] if table_rows is None else int(table_rows)
        res.commits += 1  # the replacement is one Delta version
        res.status = "rebuilt"
        res.detail = (f"origin sequences {first}..{origin_last}: {res.messages_read} messages "
                      f"read, {res.processed} of partition {self.ctx.partition}, "
                      f"{res.rows_replaced} rows replaced by {res.rows_written}")
        self.ctx.step("rebuilt", origin_first_seq=first, origin_last_seq=origin_last)

    async def _replay_through(self, origin_last: int, watermark: int, committed: int) -> int:
        """The origin sequence to replay through: the origin's last one (``origin_last``, read
        before the work queue) unless the work queue's source has not passed it yet (then the
        origin sequence of the work queue's last message, or ``committed`` when that is
        unknown), and before the partition's first queued message. Only the leased partition
        is read; nothing is consumed."""
        c = self.ctx
        info = await c.retry.call("stream info", lambda: c.api.stream_info(c.read_stream))
        st = info.get("state") or {}
        sources = info.get("sources") or []
        # a live source: no lag, in contact within 30 s (a stalled one shows lag 0, active -1)
        live = bool(sources) and all(int(s.get("lag") or 0) == 0 and 0 <= int(
            s.get("active") if s.get("active") is not None else -1) <= 30_000_000_000
            for s in sources)
        through = origin_last
        wq_last = int(st.get("last_seq") or 0)
        top = await self._origin_of(wq_last, ">", wq_last) if wq_last else None
        if top is not None:
            through = min(through, top)
        elif not live:
            through = committed
        mine = await self._origin_of(watermark + 1, c.flt, None)
        if mine is not None:
            through = min(through, mine - 1)
        return through

    async def _origin_of(self, seq: int, flt: str, last: int | None) -> int | None:
        """Origin sequence of the work queue's first message at or after ``seq`` matching
        ``flt`` (at most ``last``), or None."""
        c = self.ctx
        got = await c.retry.call("read the work queue", lambda: read_range(
            c.nc, c.read_stream, seq, filter_subject=flt, max_msgs=1, last_seq=last,
            timeout_s=c.opt.timeout_s))
        col = got.table(origin=True)["origin_seq"]
        return None if not len(col) or col[0].as_py() is None else int(col[0].as_py())

    def table_schema(self) -> pa.Schema:
        stats = self.sink.stats()
        return stats.schema

    @staticmethod
    async def put(out: queue.Queue[Any], item: Any, writer: asyncio.Task[Any]) -> None:
        """Hand ``item`` to the writer thread (bounded: backpressure), unless it failed."""
        while True:
            if writer.done():
                writer.result()  # raises the writer's error
                raise RebuildError("the Delta writer stopped early")
            try:
                out.put_nowait(item)
                return
            except queue.Full:
                await asyncio.sleep(0.01)

    async def _replay_direct(self, first: int, last: int, part: SubjectPartitioner
                             ) -> AsyncIterator[pa.Table]:
        """As :meth:`_replay`, for an origin stream with ``allow_direct``: the history read in
        chunks of ``read_chunk_direct`` messages by batched direct get, cut into Arrow in bulk
        (:func:`~cg_pipelines.jetstream.rangeread.read_range`), and this partition's messages
        selected by computing the partition once per distinct subject (a dictionary encoding)
        instead of per message. Nothing is consumed or created on the server."""
        opt, res = self.ctx.opt, self.ctx.res
        pending: list[pa.Table] = []
        rows = nbytes = 0
        seq = first
        while seq <= last:
            t = time.monotonic()
            got = await self.ctx.retry.call("read the origin stream", functools.partial(
                read_range, self.ctx.nc, self.ctx.stream, seq, filter_subject=">",
                max_msgs=REPLAY_CHUNK, max_bytes=opt.batch_max_bytes, last_seq=last,
                timeout_s=opt.timeout_s, drop_nats_headers=True))
            self.ctx.timed("read", t)
            table = got.table()
            res.messages_read += table.num_rows
            if table.num_rows:
                mine = self._of_partition(table["subject"], part)
                if mine.true_count:
                    sel = table.filter(mine)
                    pending.append(sel.append_column("origin_seq", sel["seq"]))
                    rows += sel.num_rows
                    nbytes += _payload_bytes(sel)
            while rows >= opt.batch_max_msgs or (rows and nbytes >= opt.batch_max_bytes):
                whole = pa.concat_tables(pending)
                n = min(opt.batch_max_msgs, whole.num_rows)
                yield whole.slice(0, n).cast(RECORD_SCHEMA)
                rest = whole.slice(n)
                pending, rows, nbytes = [rest], rest.num_rows, _payload_bytes(rest)
            if got.ended or not table.num_rows:
                break
            seq = got.next_seq
        if rows:
            yield pa.concat_tables(pending).cast(RECORD_SCHEMA)

    def _of_partition(self, subjects: pa.ChunkedArray, part: SubjectPartitioner
                      ) -> pa.BooleanArray:
        """Mask of the subjects (origin subjects) that map to this run's partition."""
        enc = pc.dictionary_encode(subjects).combine_chunks()
        keep = np.fromiter((part(s) == self.ctx.partition for s in enc.dictionary.to_pylist()),
                           dtype=bool, count=len(enc.dictionary))
        idx = enc.indices.to_numpy(zero_copy_only=False)
        return pa.array(keep[idx])

    async def _pull(self, consumer: str, batch: int) -> PullResult:
        """One no-wait pull of the replay consumer; a pull JetStream could not serve just now
        (:attr:`~cg_pipelines.jetstream.api.PullResult.unavailable`) raises, so the caller's
        retry sends it again."""
        got = await self.ctx.api.pull(self.ctx.stream, consumer, batch=batch, expires_s=0,
                                      no_wait=True, group=None)
        if got.unavailable:
            got.raise_for_status()
        return got

    async def _replay(self, first: int, last: int, part: SubjectPartitioner,
                      config: ElasticConfig) -> AsyncIterator[pa.Table]:
        """The origin stream's messages of this partition from ``first`` to ``last``, in order,
        as batches (:data:`~cg_pipelines.core.record.RECORD_SCHEMA`, ``seq`` = origin
        sequence) of at most ``batch_max_msgs`` messages / ``batch_max_bytes`` bytes.

        Read through an ephemeral consumer (ack none, in memory, from ``first``, filtered by
        the group's partitioning filters): it works on any origin stream (direct get needs
        ``allow_direct``) and the server streams the history in order; it is deleted after."""
        opt, res = self.ctx.opt, self.ctx.res
        name = f"cg-rebuild-{self.ctx.group}-{self.ctx.partition}-{uuid.uuid4().hex[:8]}"
        filters = [p.filter for p in config.partitioning_filters] or None
        c = self.ctx
        await c.retry.call("create the replay consumer", lambda: c.api.create_consumer(
            c.stream, consumer_config(
                name, filter_subjects=filters, deliver_policy="by_start_sequence",
                opt_start_seq=first, ack_policy="none",
                inactive_threshold_s=max(60.0, 10 * opt.timeout_s),
                description="cg_pipelines rebuild replay (ephemeral)",
                extra={"mem_storage": True, "num_replicas": 1})))
        pending: list[Record] = []
        nbytes = 0
        try:
            done = False
            while not done:
                t = time.monotonic()
                got = await self.ctx.retry.call("read the origin stream", lambda: self._pull(
                    name, opt.read_chunk))
                self.ctx.timed("read", t)
                if not got.messages:
                    if got.status not in (404, 408):
                        got.raise_for_status()
                    break
                for m in got.messages:
                    md = m.metadata
                    seq = md.sequence.stream
                    if seq > last:
                        done = True
                        break
                    res.messages_read += 1
                    if part(m.subject) != self.ctx.partition:
                        continue
                    pending.append(Record(seq, m.subject, m.data,
                                          int(md.timestamp.timestamp() * 1_000_000_000),
                                          user_headers(m.headers), seq))
                    nbytes += len(m.data)
                    if len(pending) >= opt.batch_max_msgs or nbytes >= opt.batch_max_bytes:
                        yield records_to_arrow(pending)
                        pending, nbytes = [], 0
                    if seq >= last:
                        done = True
                        break
            if pending:
                yield records_to_arrow(pending)
        finally:
            with contextlib.suppress(Exception):
                await self.ctx.api.delete_consumer(self.ctx.stream, name)

    async def _process_rebuild(self, batch: pa.Table, schema: pa.Schema,
                               cache: KeyStateCache | None) -> pa.Table | None:
        seqs = batch["seq"]
        ctx = BatchContext(self.ctx.stream, self.ctx.group, self.ctx.partition, self.ctx.app_id,
                           seqs[0].as_py(), seqs[-1].as_py(), self.sink, cache, "rebuild")
        t = time.monotonic()
        processed = await asyncio.to_thread(self.ctx.processor.process, batch, ctx)
        self.ctx.timed("process", t)
        self.ctx.res.processed += batch.num_rows - len(processed.dead)
        self.ctx.res.dead_lettered += len(processed.dead)
        table = with_partition_column(processed.table, self.ctx.partition)
        if cache is not None:
            cache.update(table)
        self.ctx.step("processed", first_seq=ctx.first_seq, last_seq=ctx.last_seq)
        return fit_to_table(table, schema)


async def rebuild_partition(
    nc: Client,
    stream: str,
    group: str,
    partition: int,
    processor: Processor,
    sink: Sink,
    options: EngineOptions | None = None,
    *,
    allow_partial: bool = False,
    hook: Hook | None = None,
) -> RunResult:
    """Rebuild one partition of an elastic group from the origin stream's history (see module
    docstring): its rows replaced, its watermark kept, in one fenced Delta transaction.

    Args:
        nc: a connected nats-py client.
        stream, group, partition: as for :func:`~cg_pipelines.engine.run_partition`.
        processor: the processing step (today's code: the rows it gives replace the old ones).
        sink: a :class:`~cg_pipelines.sinks.delta.DeltaSink` (``replace_partition``).
        options: :class:`~cg_pipelines.engine.EngineOptions` (batch sizes, timeouts; a rebuild
            never halts: bad payloads are counted).
        allow_partial: rebuild from what the origin stream still holds when retention trimmed
            its beginning (the result then lacks the trimmed messages' effects).

    Returns:
        A :class:`~cg_pipelines.engine.result.RunResult` with ``status`` ``"rebuilt"``
        (``origin_first_seq``/``origin_last_seq``: the origin range; ``processed``: the
        partition's messages; ``messages_read``; ``rows_replaced``; ``rows_written``),
        ``"held"`` (another instance holds the partition), ``"empty"`` (nothing committed yet)
        or ``"fenced"`` (another holder committed meanwhile: nothing written).

    Raises:
        ConfigError: ``partition`` is negative.
        RebuildError: the rebuild cannot be done as asked (see the class); nothing is written.
        EngineConfigError: the sink cannot replace a partition.
        Exceptions of the processor (nothing is written, the old rows stay) and NATS errors as
        :func:`~cg_pipelines.engine.run_partition` raises them.
    """
    if not isinstance(sink, ReplaceSink):
        raise EngineConfigError(f"{type(sink).__name__} cannot replace a partition's rows "
                                "(no replace_partition): use DeltaSink")
    ctx = open_run(nc, stream, group, partition, processor, sink, options, hook)
    ctx.state = None  # a rebuild starts from empty state (set per run)
    run = PartitionRebuild(ctx, sink, allow_partial=allow_partial)
    return await run.lease.guard(run.ensure, run.run)

