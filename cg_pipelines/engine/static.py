"""Draining one partition of a **static** consumer group (the seed's static groups: the origin
stream holds ``<p>.<...>`` subjects and is never purged).

Same lease, fence and results as :func:`~cg_pipelines.engine.runner.run_partition`; the
partition's pinned consumer advances by acknowledging each delivered message after its commit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from cg_pipelines.core.subjects import strip_partition
from cg_pipelines.engine.model import Processor, Record, RunResult, Sink, records_to_arrow
from cg_pipelines.engine.runner import (
    PRIORITY_GROUP,
    EngineConfigError,
    EngineOptions,
    Hook,
    _Lease,
    _PartitionRun,
    _user_headers,
)
from cg_pipelines.jetstream.api import consumer_config
from cg_pipelines.jetstream.errors import ConsumerAlreadyExistsError

__all__ = ["run_static_partition"]


def _record_of(m: Msg) -> Record:
    """A delivered message as a :class:`Record` (partition token stripped)."""
    md = m.metadata
    return Record(md.sequence.stream, strip_partition(m.subject)[1], m.data,
                  int(md.timestamp.timestamp() * 1_000_000_000), _user_headers(m.headers))


class _StaticPartitionRun(_PartitionRun):
    """Static groups: the origin stream holds ``<p>.<...>`` subjects and is never purged.

    A durable consumer per partition (``<group>-partition-<p>``, filters ``<p>.<filter>``,
    pinned, ``max_ack_pending`` = batch size) delivers a batch in stream order; after the commit
    every delivered message is acknowledged (one ack each). Messages at or below the watermark
    are acknowledged without processing.
    """

    def __init__(self, *args: Any, filters: Sequence[str] = ()) -> None:
        super().__init__(*args)
        self.wq = self.stream
        self.cname = f"{self.group}-partition-{self.partition}"
        self.filters = [f"{self.partition}.{f}" for f in filters] or [self.flt]

    async def _ensure_consumer(self) -> None:
        cfg = consumer_config(
            durable_name=self.cname, filter_subjects=self.filters,
            ack_wait_s=self.opt.ack_wait_s, max_ack_pending=self.opt.batch_max_msgs,
            priority_groups=[PRIORITY_GROUP], priority_policy="pinned_client",
            priority_timeout_s=self.opt.priority_timeout_s,
            description="cg_pipelines static partition run")
        try:
            await self.retry.call("create the partition consumer", lambda: self.api.create_consumer(
                self.stream, cfg))
        except ConsumerAlreadyExistsError as e:
            raise EngineConfigError(
                f"consumer {self.cname} on {self.stream} exists with other settings: run every "
                f"instance with the same engine options ({e})") from e

    async def _loop(self) -> None:
        start = await self.retry.call("stream info", lambda: self.api.stream_info(self.stream))
        start_last = int(start["state"].get("last_seq") or 0)
        if not await self._has_backlog():
            return
        pin: str | None = None
        first = True
        while not self._limit_hit():
            got = await self._pull(
                "pull a batch", batch=self.opt.batch_max_msgs,
                max_bytes=self.opt.batch_max_bytes, expires_s=self.opt.hold_wait_s if first
                else 0, no_wait=not first, pin_id=pin)
            if not got.messages:
                if first:
                    await self._why_nothing()
                elif got.pin_lost:
                    self.res.status = "handed_over"
                elif got.status in (None, 404, 408):
                    self.res.status = "drained"
                else:
                    got.raise_for_status()
                return
            first, pin = False, got.pin_id
            watermark = await asyncio.to_thread(self.sink.watermark, self.app_id)
            self.res.watermark = watermark
            msgs = got.messages
            seqs = [m.metadata.sequence.stream for m in msgs]
            done = [m for m, q in zip(msgs, seqs, strict=True) if q <= watermark]
            later = [m for m, q in zip(msgs, seqs, strict=True) if q > start_last]
            fresh = [m for m, q in zip(msgs, seqs, strict=True) if watermark < q <= start_last]
            for m in done:
                await m.ack()
            self.res.duplicates_skipped += len(done)
            for m in later:
                await m.nak()
            if fresh:
                lease = self._lease_of(fresh, pin)
                try:
                    records = records_to_arrow([_record_of(m) for m in fresh])
                    if await self._process_and_commit(lease, records, watermark):
                        return
                finally:
                    await self._release(lease)
            if later or (not fresh and not done):
                self.res.status = "drained"
                return
        self.res.status = "limit"

    async def _settle(self, lease: _Lease, last: int) -> None:
        """After a commit: ack every delivered message up to ``last``; nak the rest."""
        for m in lease.msgs:
            if m.metadata.sequence.stream <= last:
                await m.ack()
            else:
                await m.nak()
        await self.retry.call("flush acks", lambda: self.nc.flush(timeout=self.opt.timeout_s))


async def run_static_partition(
    nc: Client,
    stream: str,
    group: str,
    partition: int,
    processor: Processor,
    sink: Sink,
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
    if partition < 0:
        raise ValueError(f"partition must be >= 0, got {partition}")
    run = _StaticPartitionRun(nc, stream, group, partition, processor, sink,
                              options or EngineOptions(), hook, filters=filters)
    return await run.run()
