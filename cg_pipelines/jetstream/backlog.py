"""Per-partition backlog of an elastic group's work-queue stream (for sensors and schedules).

One batched direct get per partition (``seq=1``, ``next_by_subj="<p>.>"``, ``batch=1``): the
first pending message gives the partition's first sequence and age, and its
``Nats-Num-Pending`` header the number of messages after it.
"""

from __future__ import annotations

import asyncio
import time

from cg_pipelines.core.config import work_queue_stream_name
from cg_pipelines.core.triggers import PartitionBacklog
from cg_pipelines.jetstream.api import JetStreamAPI


async def partition_backlog(
    api: JetStreamAPI, stream: str, group: str, partitions: range | list[int]
) -> list[PartitionBacklog]:
    """Backlog of each partition, in the order given (requests run concurrently).

    Raises ``JetStreamUnavailableError`` if the work-queue stream is missing.
    """
    wq = work_queue_stream_name(stream, group)
    now_ns = time.time_ns()

    async def one(p: int) -> PartitionBacklog:
        msgs = await api.direct_get_batch(wq, 1, f"{p}.>", 1)
        if not msgs:
            return PartitionBacklog(p, 0, None, 0.0)
        m = msgs[0]
        pending = 1 + (m.num_pending or 0)
        return PartitionBacklog(p, pending, m.seq, max(0.0, (now_ns - m.time_ns) / 1e9))

    return list(await asyncio.gather(*(one(p) for p in partitions)))
