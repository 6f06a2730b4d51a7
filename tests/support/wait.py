"""Polling helpers for tests that wait on asynchronous effects."""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client


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
        await asyncio.sleep(interval)  # poll interval


async def still_running(h: Any) -> bool:
    """True if a member's :class:`~cg_pipelines.jetstream.members.ConsumeHandle` has not ended
    (its ``done()`` does not return within 50 ms)."""
    try:
        await asyncio.wait_for(h.done(), 0.05)
    except TimeoutError:
        return True
    return False


async def pulls_waiting(api: Any, stream: str, consumer: str,
                        ok: Callable[[int], bool] = lambda n: n >= 1,
                        timeout: float = 30.0, what: str = "") -> None:
    """Wait until the number of pull requests waiting at ``consumer`` of ``stream`` (consumer
    info's ``num_waiting``; ``api`` is a :class:`~cg_pipelines.jetstream.api.JetStreamAPI`)
    satisfies ``ok`` (default: at least one): e.g. the pull a test just started has reached
    the server, not "0.3 s have passed". At least one is conclusive only while no other
    client's pull may be waiting there (:class:`SentRequests` tells them apart). A consumer info
    also makes the server drop waiting requests whose inbox is gone, so ``lambda n: n == 0``
    waits for an abandoned pull to be dropped."""
    async def count() -> bool:
        return ok(int((await api.consumer_info(stream, consumer)).get("num_waiting") or 0))

    await wait_for(count, timeout, what or f"pull requests waiting at {stream}/{consumer}")


class SentRequests:
    """Requests clients send to ``subject`` (e.g. a pull:
    ``$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>``, a consumer info:
    ``$JS.API.CONSUMER.INFO.<stream>.<consumer>``), seen by a plain subscription on ``nc``:
    the server relays each request to it as to JetStream. It tells one client's request from
    another's (by its JSON body: a pull's ``batch``, ``expires`` in ns, ``id`` = pin id) where
    consumer info cannot. Use as ``async with``: the subscription is queued before the first
    yield (nats-py sends SUB without awaiting first), so a request sent on the same
    connection by a task created just before is seen."""

    def __init__(self, nc: Client, subject: str,
                 match: Callable[[dict[str, Any]], bool] = lambda body: True) -> None:
        self.nc, self.subject, self.match = nc, subject, match
        self.seen: list[dict[str, Any]] = []
        self.sub: Any = None

    async def _got(self, msg: Any) -> None:
        try:
            body = json.loads(msg.data or b"{}")
        except ValueError:
            return
        if isinstance(body, dict) and self.match(body):
            self.seen.append(body)

    async def __aenter__(self) -> SentRequests:
        self.sub = await self.nc.subscribe(self.subject, cb=self._got)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.sub.unsubscribe()

    async def wait(self, timeout: float, what: str) -> dict[str, Any]:
        """The first matching request's body, once one was sent (``wait_for`` semantics)."""
        await wait_for(lambda: self.seen, timeout, what)
        return self.seen[0]
