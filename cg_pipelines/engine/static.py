"""Draining one partition of a **static** consumer group (the origin stream holds
``<p>.<...>`` subjects, partitioned by the publishers, and is never purged).

Same lease rules (:class:`~cg_pipelines.engine.lease.LeaseHolder`), batch steps and fence
(:meth:`~cg_pipelines.engine.drain.Drain.process_and_commit`) and results as
:func:`~cg_pipelines.engine.runner.run_partition`; only the consumer and step 6 differ: the
partition's pinned consumer on the origin stream advances by acknowledging each delivered
message after its commit (:meth:`~cg_pipelines.engine.lease.LeaseHolder.ack_each`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from nats.aio.client import Client
from nats.aio.msg import Msg

from cg_pipelines.core.config import PRIORITY_GROUP
from cg_pipelines.core.record import user_headers
from cg_pipelines.core.subjects import strip_partition
from cg_pipelines.engine.context import RunContext, open_run
from cg_pipelines.engine.drain import Drain
from cg_pipelines.engine.lease import LeaseHolder
from cg_pipelines.engine.options import EngineConfigError, EngineOptions, Hook
from cg_pipelines.engine.processor import Processor, Record, records_to_arrow
from cg_pipelines.engine.result import RunResult
from cg_pipelines.engine.side import Side
from cg_pipelines.engine.step import SingleStep
from cg_pipelines.jetstream.api import consumer_config
from cg_pipelines.jetstream.errors import ConsumerAlreadyExistsError
from cg_pipelines.sinks.base import TableSink

__all__ = ["run_static_partition", "static_partition_consumer_name"]


def static_partition_consumer_name(group: str, partition: int) -> str:
    """A static group partition's pinned consumer on the origin stream:
    ``<group>-partition-<p>``."""
    return f"{group}-partition-{partition}"


def _record_of(m: Msg) -> Record:
    """A delivered message as a :class:`Record` (partition token stripped)."""
    md = m.metadata
    return Record(md.sequence.stream, strip_partition(m.subject)[1], m.data,
                  int(md.timestamp.timestamp() * 1_000_000_000), user_headers(m.headers))


class _StaticDrain:
    """Static groups: the origin stream holds ``<p>.<...>`` subjects and is never purged.

    A durable consumer per partition (``<group>-partition-<p>``, filters ``<p>.<filter>``,
    pinned, ``max_ack_pending`` = batch size) delivers a batch in stream order; the batch is
    held as one lease and goes through the drain pipeline (process, dead-letter, commit
    fenced), settled by acknowledging every delivered message (one ack each, one flush).
    Messages at or below the watermark are acknowledged without processing.
    """

    def __init__(self, ctx: RunContext, filters: Sequence[str]) -> None:
        self.ctx = ctx
        self.lease = LeaseHolder(ctx, static_partition_consumer_name(ctx.group, ctx.partition))
        self.drain = Drain([Side(ctx, self.lease, settle=self.lease.ack_each)],
                           SingleStep(ctx), ctx.hook)
        self.filters = [f"{ctx.partition}.{f}" for f in filters] or [ctx.flt]

    async def ensure(self) -> None:
        """Create the partition's pinned consumer on the origin stream (idempotent)."""
        ctx, cname = self.ctx, self.lease.cname
        cfg = consumer_config(
            durable_name=cname, filter_subjects=self.filters,
            ack_wait_s=ctx.opt.ack_wait_s, max_ack_pending=ctx.opt.batch_max_msgs,
            priority_groups=[PRIORITY_GROUP], priority_policy="pinned_client",
            priority_timeout_s=ctx.opt.priority_timeout_s,
            description="cg_pipelines static partition run")
        try:
            await ctx.retry.call("create the partition consumer", lambda: ctx.api.create_consumer(
                ctx.stream, cfg))
        except ConsumerAlreadyExistsError as e:
            raise EngineConfigError(
                f"consumer {cname} on {ctx.stream} exists with other settings: run every "
                f"instance with the same engine options ({e})") from e

    async def run(self) -> None:
        ctx, res, opt = self.ctx, self.ctx.res, self.ctx.opt
        start = await ctx.retry.call("stream info", lambda: ctx.api.stream_info(ctx.stream))
        start_last = int(start["state"].get("last_seq") or 0)
        if not await self.lease.has_backlog():
            return
        pin: str | None = None
        first = True
        while not ctx.limit_hit():
            got = await self.lease.pull(
                "pull a batch", batch=opt.batch_max_msgs,
                max_bytes=opt.batch_max_bytes, expires_s=opt.hold_wait_s if first
                else 0, no_wait=not first, pin_id=pin)
            if not got.messages:
                if first:
                    await self.lease.why_nothing()
                elif got.pin_lost:
                    res.status = "handed_over"
                elif got.status in (None, 404, 408):
                    res.status = "drained"
                else:
                    got.raise_for_status()
                return
            first, pin = False, got.pin_id
            watermark = await asyncio.to_thread(ctx.sink.watermark, ctx.app_id)
            ctx.side.watermark = watermark
            msgs = got.messages
            seqs = [m.metadata.sequence.stream for m in msgs]
            done = [m for m, q in zip(msgs, seqs, strict=True) if q <= watermark]
            later = [m for m, q in zip(msgs, seqs, strict=True) if q > start_last]
            fresh = [m for m, q in zip(msgs, seqs, strict=True) if watermark < q <= start_last]
            for m in done:
                await m.ack()
            ctx.side.duplicates_skipped += len(done)
            for m in later:
                await m.nak()
            if fresh:
                lease = self.lease.hold(fresh, pin)
                try:
                    records = records_to_arrow([_record_of(m) for m in fresh])
                    if await self.drain.process_and_commit(lease, records, watermark):
                        return
                finally:
                    await self.lease.release(lease)
            if later or (not fresh and not done):
                res.status = "drained"
                return
        res.status = "limit"


async def run_static_partition(
    nc: Client,
    stream: str,
    group: str,
    partition: int,
    processor: Processor,
    sink: TableSink,
    options: EngineOptions | None = None,
    *,
    filters: Sequence[str] = (),
    hook: Hook | None = None,
) -> RunResult:
    """Drain one partition of a static group (origin stream ``<p>.<...>`` subjects).

    Same contract and results as :func:`run_partition`; ``filters`` are the static group's
    subject filters (after the partition token). The origin stream is never purged: the
    partition's consumer advances by acknowledging each delivered message after its commit.
    """
    ctx = open_run(nc, stream, group, partition, processor, sink, options, hook,
                   read_stream=stream)
    run = _StaticDrain(ctx, filters)
    return await run.lease.guard(run.ensure, run.run)
