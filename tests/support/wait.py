"""Polling helpers for tests that wait on asynchronous effects."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any


async def wait_for(cond: Callable[[], Any], timeout: float, what: str,
                   interval: float = 0.02) -> Any:
    """Poll ``cond`` (sync or async) every ``interval`` seconds until it returns something
    truthy, and return that; raise ``AssertionError`` naming ``what`` after ``timeout``
    seconds."""
    deadline = time.monotonic() + timeout
    while True:
        r = cond()
        if inspect.isawaitable(r):
            r = await r
        if r:
            return r
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


async def still_running(h: Any) -> bool:
    """True if a member's :class:`~cg_pipelines.jetstream.members.ConsumeHandle` has not ended
    (its ``done()`` does not return within 50 ms)."""
    try:
        await asyncio.wait_for(h.done(), 0.05)
    except TimeoutError:
        return True
    return False
