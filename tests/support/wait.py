"""Polling helper for tests that wait on asynchronous effects."""

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
