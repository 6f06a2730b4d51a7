"""A partition's table upkeep on its own, for teams that want it on a schedule
(:func:`maintain_partition`; CLI: ``cg maintain STREAM GROUP TABLE -p P``).

Every partition run already maintains its partition after its last commit (the sink's optional
``maintain`` hook, :class:`~cg_pipelines.sinks.base.MaintainedSink`). This entry point does
the same without processing anything: it takes the partition's lease like a run (a pull that
pins this instance when the partition has a backlog; nothing is leased when it has none, and
then no run can be committing), calls ``sink.maintain(partition, app_id)``, and gives the lease
back untouched (nak + unpin): the messages stay for the next run. When another instance holds
the partition it does nothing (status ``held``). Maintenance is safe even without the lease
(compaction changes no row, a commit that loses a race to it is retried by the sink); the lease
keeps it from competing with a run for the same files.
"""

from __future__ import annotations

import asyncio

import pyarrow as pa
from nats.aio.client import Client

from cg_pipelines.core.errors import InvariantError
from cg_pipelines.engine.context import open_run
from cg_pipelines.engine.lease import LeaseHolder, lease_consumer_name
from cg_pipelines.engine.options import EngineConfigError, EngineOptions
from cg_pipelines.engine.processor import BatchContext, Processed, ProcessorBase
from cg_pipelines.engine.result import RunResult
from cg_pipelines.sinks.base import MaintainedSink, TableSink

__all__ = ["maintain_partition"]


class _NoProcessing(ProcessorBase):
    """The upkeep processes no message."""

    def process(self, batch: pa.Table, ctx: BatchContext) -> Processed:
        raise InvariantError("maintain_partition processes no message")


async def maintain_partition(nc: Client, stream: str, group: str, partition: int,
                             sink: TableSink, options: EngineOptions | None = None
                             ) -> RunResult:
    """Maintain one partition's table under its lease (see the module docstring).

    Args:
        nc: a connected nats-py client. stream, group: the origin stream and elastic group.
        partition: 0 <= partition < max_members. sink: a sink with ``maintain`` (e.g.
        :class:`~cg_pipelines.sinks.delta.DeltaSink`). options: timeouts, hold wait.

    Returns:
        A :class:`~cg_pipelines.engine.result.RunResult` with ``maintenance`` (the figures;
        empty when ``held``) and ``status`` ``"held"`` (another instance holds the partition:
        nothing done), ``"empty"`` (no backlog, maintained) or ``"limit"`` (maintained while
        holding the lease, which was given back).

    Raises:
        ConfigError: ``partition < 0``.
        EngineConfigError: ``sink`` has no ``maintain``.
        NatsUnavailableError / JetStreamError: as for a run (nothing changed then).
    """
    if not isinstance(sink, MaintainedSink):
        raise EngineConfigError(f"{type(sink).__name__} has no maintain(partition, app_id) "
                                "method")
    ctx = open_run(nc, stream, group, partition, _NoProcessing(), sink, options, None)
    holder = LeaseHolder(ctx, lease_consumer_name(partition))

    async def body() -> None:
        lease = await holder.take()
        if ctx.res.status == "held":
            return
        assert isinstance(sink, MaintainedSink)
        try:
            ctx.res.maintenance = await asyncio.to_thread(sink.maintain, partition, ctx.app_id)
        finally:
            if lease is not None:
                ctx.res.status = "limit"
                await holder.put_back(lease)

    return await holder.guard(holder.ensure, body)
