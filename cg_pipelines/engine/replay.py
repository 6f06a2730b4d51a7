"""One side of a rebuild (:class:`SideRebuild`): partition ``p`` of one elastic group, leased as
a drain leases it, its replay range planned and its origin history replayed.

1. **Lease** (:meth:`SideRebuild.take_lease`): with a backlog, pull and hold one message
   (renewed, never processed here); without one, keep one pull request waiting at the head of
   the lease consumer's queue for the whole rebuild, so a message arriving meanwhile is
   delivered to this run, which then holds it. A drain started during the rebuild finds the
   partition ``held`` and drains after it.
2. **Range** (:meth:`SideRebuild.plan`): the committed watermark ``W`` and the origin sequence
   ``O`` of the last committed message (each commit records it,
   :func:`~cg_pipelines.sinks.base.origin_marker`). Refused when the origin stream no longer
   holds its whole history (its first sequence is not 1, or messages were deleted) unless
   ``allow_partial``. The replay goes through ``X``: the origin's last message, unless the work
   queue's source has not passed it yet (then the origin sequence of the work queue's last
   message), and before the partition's first message still queued (the drain processes
   those); never below ``O``. So a gap at the partition's tail (messages that never reached
   the work queue after its last commit) is repaired too.
3. **Replay** (:meth:`SideRebuild.replay`): the origin stream from its first message up to
   ``X`` in order, the messages whose subject maps to ``p`` (:class:`~cg_pipelines.core.
   partitioning.SubjectPartitioner`: the work queue's own transform), in batches.

The rebuild run over its sides (processing, the one fenced replace) is
:mod:`cg_pipelines.engine.rebuild`. Cost: a replay reads the origin stream's whole history
(every partition's messages) to select one partition's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cg_pipelines.core.config import ElasticConfig
from cg_pipelines.core.errors import CgError, GroupNotFoundError
from cg_pipelines.core.partitioning import SubjectPartitioner
from cg_pipelines.core.record import RECORD_SCHEMA, user_headers
from cg_pipelines.engine.context import RunContext
from cg_pipelines.engine.lease import Lease, LeaseHolder, lease_consumer_name
from cg_pipelines.engine.processor import Record, records_to_arrow
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import PullResult, consumer_config
from cg_pipelines.jetstream.rangeread import fast_path_available, read_range
from cg_pipelines.sinks.base import TableSink, origin_marker

__all__ = ["REPLAY_CHUNK", "RebuildError", "ReplayRange", "SideRebuild"]

REPLAY_CHUNK = 50_000
"""Messages per direct-get read of the origin stream's history (a rebuild's replay)."""


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


class SideRebuild:
    """One side of a rebuild over its context ``ctx`` and the partition's elastic lease (the
    same consumer a drain leases on): its lease, its range and its replay (see the module
    docstring)."""

    def __init__(self, ctx: RunContext, sink: TableSink, allow_partial: bool = False) -> None:
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
        """Let go of the partition: the waiting pull cancelled, a held message nak'ed (for
        the drain that follows, at once)."""
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

    async def plan(self) -> ReplayRange | None:
        """Step 2: the committed watermark and the origin range to replay (see the module
        docstring); None (status ``empty``) when nothing was committed yet. The last read of
        the watermark loads the snapshot the final replace is fenced against.

        Raises:
            RebuildError: no origin sequence recorded, or the origin stream lost part of the
                history (unless ``allow_partial``).
        """
        res, side = self.ctx.res, self.ctx.side
        watermark = await asyncio.to_thread(self.sink.watermark, self.ctx.app_id)
        side.watermark = watermark
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
        side.origin_first_seq, side.origin_last_seq = first, origin_last
        direct = bool((info.get("config") or {}).get("allow_direct")) and \
            fast_path_available(self.ctx.nc)
        return ReplayRange(watermark, first, origin_last, direct)

    def replay(self, rng: ReplayRange) -> AsyncIterator[pa.Table]:
        """Step 3's reads: the partition's origin messages of ``rng`` in order, as batches
        (:data:`~cg_pipelines.core.record.RECORD_SCHEMA`, ``seq`` = origin sequence)."""
        part = SubjectPartitioner(self.config)
        return (self._replay_direct(rng.first, rng.through, part) if rng.direct
                else self._replay(rng.first, rng.through, part, self.config))
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

    async def _replay_direct(self, first: int, last: int, part: SubjectPartitioner
                             ) -> AsyncIterator[pa.Table]:
        """As :meth:`_replay`, for an origin stream with ``allow_direct``: the history read in
        chunks of ``read_chunk_direct`` messages by batched direct get, cut into Arrow in bulk
        (:func:`~cg_pipelines.jetstream.rangeread.read_range`), and this partition's messages
        selected by computing the partition once per distinct subject (a dictionary encoding)
        instead of per message. Nothing is consumed or created on the server."""
        opt, res = self.ctx.opt, self.ctx.side
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
        opt, res = self.ctx.opt, self.ctx.side
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

