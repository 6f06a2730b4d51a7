"""The partition lease: the one owner of the pin, keep-alive and acknowledgement rules.

A partition is leased through a durable consumer on the stream read, pinned in the priority
group ``PCG`` (``pinned_client``). For an elastic group it is the lease consumer
``partition-<p>`` on the work queue (filter ``<p>.>``, explicit ack, ``max_ack_pending=1``):
pulling one message makes the run the pinned holder, and with one ack pending the server hands
no other message of the partition to anyone. The rules, in the order a run meets them:

1. **Ensure** the consumer exists with the config every instance uses
   (:func:`ensure_lease_consumer`; a mismatch is an :class:`~cg_pipelines.engine.options.
   EngineConfigError`).
2. **Take**: the first pull waits up to ``hold_wait_s`` for the pin; getting nothing while the
   partition has a backlog means another instance holds it: the run's status is ``held``, its
   detail names the pinned holder (:meth:`LeaseHolder.take`).
3. **Keep**: while a batch is processed, ``+WPI`` on the held messages every third of the ack
   wait, and a short pull carrying the pin id every third of the pin timeout
   (:meth:`LeaseHolder.keep`).
4. **Ack** after the commit (and, for a work queue, after the purge), verified when the reply
   is lost (:meth:`LeaseHolder.ack`); then **next**: release and pull the partition's next
   message with the pin id (:meth:`LeaseHolder.next`).
5. **Re-pin** when the pin is gone: a restarted server forgets pins; another holder named by
   the server means the partition was handed over (:meth:`LeaseHolder.repin`).
6. **Unpin** when the run ends on its own, so the next run is pinned at once; **give back**
   on any failure: nak the held messages and unpin, so a retry is not ``held``
   (:meth:`LeaseHolder.guard`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import nats.errors
from nats.aio.msg import Msg

from cg_pipelines.core.config import PRIORITY_GROUP
from cg_pipelines.engine.context import RunContext
from cg_pipelines.engine.options import EngineConfigError, EngineOptions
from cg_pipelines.engine.result import RunResult
from cg_pipelines.jetstream.api import JetStreamAPI, PullResult, consumer_config
from cg_pipelines.jetstream.api_admin import pinned_client_id
from cg_pipelines.jetstream.errors import (
    ConsumerAlreadyExistsError,
    RequestTimeoutError,
    WorkQueueConsumerNotUniqueError,
)

__all__ = [
    "Lease",
    "LeaseHolder",
    "Repin",
    "ensure_lease_consumer",
    "guard_all",
    "guard_each",
    "lease_consumer_config",
    "lease_consumer_name",
]


def lease_consumer_name(partition: int) -> str:
    """The partition's lease consumer on the work-queue stream: ``partition-<p>``."""
    return f"partition-{partition}"


def lease_consumer_config(partition: int, options: EngineOptions) -> dict[str, Any]:
    """Wire config of the lease consumer; identical for every instance (required by
    action ``create``)."""
    return consumer_config(
        durable_name=lease_consumer_name(partition),
        filter_subjects=[f"{partition}.>"],
        ack_wait_s=options.ack_wait_s,
        max_ack_pending=1,
        priority_groups=[PRIORITY_GROUP],
        priority_policy="pinned_client",
        priority_timeout_s=options.priority_timeout_s,
        description="cg_pipelines lease-and-range partition lease",
    )


async def ensure_lease_consumer(
    api: JetStreamAPI, wq: str, partition: int, options: EngineOptions
) -> None:
    """Create the partition's lease consumer (idempotent). Raises :class:`EngineConfigError`."""
    try:
        await api.create_consumer(wq, lease_consumer_config(partition, options))
    except ConsumerAlreadyExistsError as e:
        raise EngineConfigError(
            f"lease consumer {lease_consumer_name(partition)} on {wq} exists with other "
            f"settings (ack wait / priority timeout): run every instance with the same engine "
            f"options, or delete the consumer while no run is active ({e})"
        ) from e
    except WorkQueueConsumerNotUniqueError as e:
        raise EngineConfigError(
            f"partition {partition} of {wq} is held by another consumer (streaming members?): "
            f"a group is consumed either by members or by partition runs, not both ({e})"
        ) from e


@dataclass(frozen=True, slots=True)
class Repin:
    """How :meth:`LeaseHolder.repin` ended.

    Attributes:
        outcome: ``"pinned"`` (the server pinned this run again: ``pull`` got the next
            message), ``"handed_over"`` (another instance holds the partition now, or the
            server gave this run nothing while it has a backlog: the run stops) or
            ``"drained"`` (the partition has nothing left: the run stops).
        pull: the pull that got the message (``pinned`` only).
        detail: why the run stops, for ``RunResult.detail`` (``handed_over``), else "".
    """

    outcome: Literal["pinned", "handed_over", "drained"]
    pull: PullResult | None = None
    detail: str = ""


@dataclass
class Lease:
    """Delivered, unacknowledged messages a run holds (one for the elastic lease; a static
    group's batch), the stream sequence of the first, and the pin id the server gave.

    ``keeper`` is the keep-alive task (:meth:`LeaseHolder.keep`), stopped by ``stop``."""

    msgs: list[Msg]
    seq: int
    pin_id: str | None
    keeper: asyncio.Task[None] | None = field(default=None)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def msg(self) -> Msg:
        """The first held message (the elastic lease's only one)."""
        return self.msgs[0]


class LeaseHolder:
    """Holds a partition's pinned consumer ``cname`` on ``ctx.read_stream`` for one run (see
    the module docstring). Sets the side's status (:meth:`RunContext.end
    <cg_pipelines.engine.context.RunContext.end>`: the run's, unless the side ends on its own)
    when the lease decides how it ends (``held``, ``empty``, ``drained``, ``handed_over``)."""

    def __init__(self, ctx: RunContext, cname: str) -> None:
        self.ctx, self.cname = ctx, cname
        self.was_pinned = False  # a lease (so the pin) was held at some point
        self.current: Lease | None = None  # the newest lease taken (nak'ed on failure)
        #: give the pin up as soon as the partition is drained, not when the run ends (a side
        #: of a run over several partitions: the others may go on for long)
        self.unpin_when_drained = False
        self.unpinned = False  # the pin was given up early (the run's end leaves it alone)

    # ------------------------------------------------------------------ the run around it

    async def guard(self, ensure: Callable[[], Awaitable[None]],
                    body: Callable[[], Awaitable[None]]) -> RunResult:
        """Ensure the consumer, run ``body``, unpin; on any failure (the transform's, the
        sink's, NATS', a cancellation) give the partition back on the way out, so a retry
        starts at once instead of finding it ``held`` until the ack wait / pin timeout. The
        exception is re-raised as it is, with a :class:`~cg_pipelines.core.errors.
        PartitionRunError` attached (what was in flight, committed and acknowledged; read it
        with ``PartitionRunError.of(exc)``)."""
        ctx = self.ctx
        try:
            await ensure()
            await body()
            await self.unpin()
        except BaseException as e:
            await self.give_back()
            if isinstance(e, Exception):
                ctx.failure(e).attach()
            raise
        finally:
            await ctx.api.close()
            ctx.res.seconds = time.monotonic() - ctx.t0
        return ctx.res

    async def ensure(self) -> None:
        """Create the elastic lease consumer (idempotent; retried while NATS is unreachable)."""
        ctx = self.ctx
        await ctx.retry.call("create the lease consumer", lambda: ensure_lease_consumer(
            ctx.api, ctx.read_stream, ctx.partition, ctx.opt))

    async def give_back(self) -> None:
        """After a failure: nak the messages of the lease still held (so they are delivered
        again at once, not after the ack wait) and unpin (unless the pin was given up already
        or moved to another instance: the unpin would take it from that one). Best effort and
        bounded: with NATS gone the ack wait and pin timeout do the same later."""
        lease, timeout = self.current, self.ctx.opt.timeout_s
        if lease is not None:
            await self.release(lease)
            for msg in lease.msgs:
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(msg.nak(), timeout)
        if self.was_pinned and not self.unpinned and self.ctx.status != "handed_over":
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self.ctx.api.unpin(self.ctx.read_stream, self.cname),
                                       timeout)

    async def unpin(self) -> None:
        """A run that held the pin and ended on its own gives the pin up, so the next run of
        the partition (another deployment after a membership change, say) is pinned at once
        instead of after ``priority_timeout_s``. Best effort: the pin times out anyway."""
        if not self.was_pinned or self.unpinned or self.ctx.status in ("handed_over", "held"):
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ctx.api.unpin(self.ctx.read_stream, self.cname),
                                   self.ctx.opt.timeout_s)

    async def unpin_now(self) -> None:
        """Give the pin up now (best effort, as :meth:`unpin`): the partition is drained and
        this run will not pull from it again, so the next run of it (a one-partition run, a
        run over another range) is pinned at once instead of after ``priority_timeout_s``.
        Called only while the pin is this run's (its last pull carried the pin id and was
        answered "nothing left"); the run's end then leaves the pin alone."""
        if not self.was_pinned or self.unpinned:
            return
        self.unpinned = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ctx.api.unpin(self.ctx.read_stream, self.cname),
                                   self.ctx.opt.timeout_s)

    # ------------------------------------------------------------------ pulls

    async def pull(self, step: str, **kw: Any) -> PullResult:
        """A pull request, retried while NATS is unreachable. A pull the server never
        answered (no message, no status) counts as unreachable, and so does one it answered
        with :attr:`~cg_pipelines.jetstream.api.PullResult.unavailable` (503, or 409
        ``Leadership Change`` when the consumer's leader moved while the pull waited)."""
        ctx = self.ctx

        async def once() -> PullResult:
            got = await ctx.api.pull(ctx.read_stream, self.cname, **kw)
            if got.unavailable:
                got.raise_for_status()
            if not got.messages and got.status is None:
                raise RequestTimeoutError(f"pull {ctx.read_stream} > {self.cname}",
                                          float(kw.get("expires_s") or 0) + ctx.opt.timeout_s)
            return got
        return await ctx.retry.call(step, once)

    async def info(self) -> dict[str, Any]:
        """The consumer's info (retried)."""
        ctx = self.ctx
        return await ctx.retry.call("consumer info", lambda: ctx.api.consumer_info(
            ctx.read_stream, self.cname))

    async def has_backlog(self) -> bool:
        """Whether the partition has messages (pending or delivered); records the backlog in
        ``ctx.pending``; status ``empty`` when it has none."""
        info = await self.info()
        self.ctx.pending = (int(info.get("num_pending") or 0)
                            + int(info.get("num_ack_pending") or 0))
        if self.ctx.pending:
            return True
        self.ctx.end("empty")
        return False

    async def take(self) -> Lease | None:
        """The run's first lease: None when the partition is empty or held by another
        instance (status set)."""
        if not await self.has_backlog():
            return None
        got = await self.pull("pull the lease", batch=1, expires_s=self.ctx.opt.hold_wait_s)
        if got.messages:
            return self.hold(got.messages[0], got.pin_id)
        await self.why_nothing()
        return None

    async def why_nothing(self) -> None:
        """Set ``held`` (another instance holds the partition) or ``empty`` after a first pull
        that returned nothing."""
        info, opt = await self.info(), self.ctx.opt
        if info.get("num_ack_pending") or info.get("num_pending"):
            holder = pinned_client_id(info)
            who = (f"pinned client {holder}" if holder else
                   f"{int(info.get('num_ack_pending') or 0)} message(s) delivered and not yet "
                   f"acknowledged; an earlier holder's lease returns after the ack wait "
                   f"({opt.ack_wait_s:g} s)")
            self.ctx.end("held", f"partition {self.ctx.partition} held by another instance "
                                 f"({who}; waited {opt.hold_wait_s:g} s); nothing processed")
        else:
            self.ctx.end("empty")

    def hold(self, msg: Msg | list[Msg], pin_id: str | None) -> Lease:
        """Hold the delivered ``msg`` (or messages) as the run's lease and start keeping it."""
        msgs = msg if isinstance(msg, list) else [msg]
        lease = Lease(msgs, msgs[0].metadata.sequence.stream, pin_id)
        self.was_pinned = True
        self.current = lease
        lease.keeper = asyncio.create_task(self.keep(lease))
        self.ctx.step("leased", first_seq=lease.seq, last_seq=lease.seq)
        return lease

    async def next(self, done: Lease) -> Lease | None:
        """Release the finished lease ``done`` and pull the partition's next message (None:
        the run stops, status set)."""
        await self.release(done)
        got = await self.pull("pull the next lease", batch=1, expires_s=0, no_wait=True,
                              pin_id=done.pin_id)
        if got.pin_lost:
            repin = await self.repin()
            if repin.pull is not None:
                return self.hold(repin.pull.messages[0], repin.pull.pin_id)
            if self.unpin_when_drained:
                self.unpinned = True  # the pin is gone: nothing to give up, now or later
            self.ctx.end("handed_over" if repin.outcome == "handed_over" else "drained",
                         repin.detail or None)
            return None
        if got.messages:
            return self.hold(got.messages[0], got.pin_id)
        if got.status in (None, 404, 408):
            self.ctx.end("drained")
            if self.unpin_when_drained:
                await self.unpin_now()
        else:
            got.raise_for_status()
        return None

    async def repin(self) -> Repin:
        """The pin this run held is gone. Either another instance holds it now (a step-down
        or a pin timeout moved it), or nobody does: a restarted server forgets pins, whether
        or not any step of this run had to be retried. Pull without a pin id until the server
        pins this run again or names another holder (consumer info's ``pinned_client_id``),
        for up to ``hold_wait_s`` seconds.

        Returns:
            A :class:`Repin`: ``pinned`` with the pull that got a message (counted in
            ``RunResult.repins``), ``handed_over`` (another instance holds the pin, or the
            server gave this run nothing for ``hold_wait_s`` although the partition has a
            backlog; ``detail`` says which), or ``drained`` (the partition has nothing left).

        Raises:
            NatsUnavailableError / JetStreamError: as :meth:`pull` and :meth:`info`.
        """
        opt = self.ctx.opt
        deadline = time.monotonic() + opt.hold_wait_s
        while True:
            got = await self.pull("re-pin", batch=1,
                                  expires_s=max(0.1, min(1.0, deadline - time.monotonic())))
            if got.messages:
                self.ctx.side.repins += 1
                return Repin("pinned", got)
            info = await self.info()
            holder = pinned_client_id(info)
            if holder is not None:
                return Repin("handed_over", detail=(
                    f"the pin moved to another instance (pin id {holder}): step-down or pin "
                    "timeout"))
            if not (info.get("num_pending") or info.get("num_ack_pending")):
                return Repin("drained")
            if time.monotonic() >= deadline:
                return Repin("handed_over", detail=(
                    f"partition {self.ctx.partition} has a backlog but the server gave this "
                    f"run no message for {opt.hold_wait_s:g} s and names no pinned holder"))

    # ------------------------------------------------------------------ holding

    async def keep(self, lease: Lease) -> None:
        """Keep the lease while a batch is processed: ``+WPI`` on the held messages every third
        of the ack wait, and, every third of the pin timeout, a short pull carrying the pin id
        (a pinned client that does not pull within the pin timeout loses the pin). With the
        lease unacknowledged (``max_ack_pending=1``) such a pull gets nothing, unless the lease
        itself was redelivered: then the newest delivery replaces it (that is the one to ack).
        """
        ctx = self.ctx
        renew_every = ctx.opt.ack_wait_s / 3
        pin_every = ctx.opt.priority_timeout_s / 3
        loop = asyncio.get_running_loop()
        next_renew = loop.time() + renew_every
        next_pin = loop.time() + pin_every
        while not lease.stop.is_set():
            wait = max(0.0, min(next_renew, next_pin) - loop.time())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(lease.stop.wait(), wait)
            if lease.stop.is_set():
                return
            now = loop.time()
            if now >= next_renew:
                next_renew = now + renew_every
                for msg in lease.msgs:
                    with contextlib.suppress(Exception):
                        await msg.in_progress()
            if now >= next_pin and len(lease.msgs) == 1:
                next_pin = now + pin_every
                try:
                    got = await ctx.api.pull(ctx.read_stream, self.cname, batch=1,
                                             pin_id=lease.pin_id,
                                             expires_s=min(1.0, pin_every / 2))
                except Exception:  # NATS lost: the fence covers a lost lease
                    continue
                for m in got.messages:
                    if m.metadata.sequence.stream == lease.seq:
                        lease.msgs[0] = m
                    else:
                        await m.nak()
                if got.pin_id:
                    lease.pin_id = got.pin_id

    @staticmethod
    async def release(lease: Lease) -> None:
        """Stop keeping the lease (waits for an in-flight keep-alive pull to end, so no pull
        of ours is left waiting at the server when the next one is sent)."""
        lease.stop.set()
        if lease.keeper is not None:
            with contextlib.suppress(BaseException):
                await lease.keeper

    async def put_back(self, lease: Lease) -> None:
        """Release the lease and nak its message: it is left for the next run, at once."""
        await self.release(lease)
        await lease.msg.nak()

    async def ack(self, lease: Lease) -> None:
        """Acknowledge the lease (after its range was committed and purged), retried while
        NATS is unreachable. An ack whose reply is lost may have been applied, and a restarted
        server may have forgotten the delivery: both count as done once the consumer holds no
        unacknowledged message at or below the lease (the purge already removed the range)."""
        ctx = self.ctx

        async def once() -> None:
            try:
                await lease.msg.ack_sync(timeout=ctx.opt.timeout_s)
            except nats.errors.MsgAlreadyAckdError:
                return
            except TimeoutError:
                info = await ctx.api.consumer_info(ctx.read_stream, self.cname)
                floor = int((info.get("ack_floor") or {}).get("stream_seq") or 0)
                if floor >= lease.seq or not info.get("num_ack_pending"):
                    return
                raise
        await ctx.retry.call("ack", once)

    async def ack_each(self, lease: Lease, last: int, read: int | None = None) -> None:
        """Static groups: ack every held message up to ``last``, nak the rest, and flush (one
        round trip for all). ``read`` (the messages read, a side's settle argument) is not
        needed: a static group's messages are acked one by one, nothing is purged."""
        ctx = self.ctx
        for m in lease.msgs:
            if m.metadata.sequence.stream <= last:
                await m.ack()
            else:
                await m.nak()
        # nats-py annotates flush(timeout: int), but the timeout is seconds as a float
        # (asyncio.wait_for), as everywhere else in this library.
        await ctx.retry.call("flush acks", lambda: ctx.nc.flush(
            timeout=ctx.opt.timeout_s))  # type: ignore[arg-type]


async def guard_all(guards: Sequence[tuple[LeaseHolder, Callable[[], Awaitable[None]]]],
                    body: Callable[[], Awaitable[None]]) -> None:
    """Run ``body`` inside every ``(holder, ensure)`` pair's :meth:`LeaseHolder.guard`, the
    first outermost (a run over several sides: each side's partition is given back on any
    failure, and each consumer ensured before ``body`` starts)."""

    async def nest(k: int) -> None:
        if k == len(guards):
            await body()
            return
        holder, ensure = guards[k]
        await holder.guard(ensure, lambda: nest(k + 1))

    await nest(0)


async def guard_each(holders: Sequence[LeaseHolder], body: Callable[[], Awaitable[None]]
                     ) -> None:
    """:func:`guard_all` for a run over many independent sides, without nesting one guard in
    another (a run over 256 partitions would nest 256 deep): ensure each holder's consumer in
    order, run ``body``, then unpin each (in reverse order); on any failure give every holder
    ensured so far back (reverse order) and re-raise, a :class:`~cg_pipelines.core.errors.
    PartitionRunError` attached for the side with a batch in flight (else the first). Every
    side's NATS API is closed on the way out and the run's ``seconds`` set."""
    ensured: list[LeaseHolder] = []
    try:
        for h in holders:
            ensured.append(h)
            await h.ensure()
        await body()
        for h in reversed(holders):
            await h.unpin()
    except BaseException as e:
        for h in reversed(ensured):
            await h.give_back()
        if isinstance(e, Exception) and holders:
            culprit = next((h for h in holders if h.ctx.inflight is not None), holders[0])
            culprit.ctx.failure(e).attach()
        raise
    finally:
        for h in holders:
            await h.ctx.api.close()
        if holders:
            first = holders[0].ctx
            first.res.seconds = time.monotonic() - min(h.ctx.t0 for h in holders)
