"""``side.drop_prefetch``: a prefetch nobody uses is cancelled and waited for, its own failure is
dropped, and a cancellation of the run while it waits still propagates."""

from __future__ import annotations

import asyncio

import pyarrow as pa
import pytest

from cg_pipelines.engine.side import drop_prefetch as _drop


async def _slow_to_stop(stopped: asyncio.Event) -> pa.Table:
    try:
        await asyncio.sleep(60)  # a long read: it is cancelled, never completes
    except asyncio.CancelledError:
        await asyncio.sleep(0.3)  # e.g. a read finishing its request before it stops
        stopped.set()
        raise
    return pa.table({})


async def _fails() -> pa.Table:
    raise OSError("read failed")


async def test_drop_waits_for_the_prefetch_to_end() -> None:
    stopped = asyncio.Event()
    task = asyncio.create_task(_slow_to_stop(stopped))
    await asyncio.sleep(0)
    await _drop((1, task))
    assert task.done() and task.cancelled() and stopped.is_set()


async def test_drop_retrieves_a_failed_prefetch() -> None:
    task = asyncio.create_task(_fails())
    await asyncio.sleep(0)  # it fails before the drop
    await _drop((1, task))
    assert task.done() and isinstance(task.exception(), OSError)


async def test_drop_lets_the_callers_cancellation_through() -> None:
    stopped = asyncio.Event()
    prefetch = asyncio.create_task(_slow_to_stop(stopped))
    await asyncio.sleep(0)
    dropping = asyncio.create_task(_drop((1, prefetch)))
    await asyncio.sleep(0.05)  # _drop is waiting for the prefetch to stop
    dropping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await dropping
    assert dropping.cancelled()
    await asyncio.wait([prefetch])
    assert stopped.is_set()


async def test_drop_of_nothing() -> None:
    await _drop(None)
