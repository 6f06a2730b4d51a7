"""Streaming members: ``static_consume`` / ``elastic_consume`` with pinned HA (one instance of a
member receives, the others stand by), as the NATS design proposal "(Partitioned) Consumer
Groups for JetStream" (J.-N. Moyne, 2024; revised 2025 for nats-server 2.11 priority groups)
describes them.

Behaviour follows the reference implementation (synadia-io/orbit.go ``pcgroups`` v0.2.1,
``StaticConsume`` / ``ElasticConsume``) so members interoperate with members written against it:

- The caller's consumer config is used with ``name``/``durable_name``, ``filter_subjects``,
  priority group ``PCG``, ``pinned_client`` and ``priority_timeout = max(ack_wait, 1 s)``
  overwritten; ``ack_wait`` defaults to 5 s. Static members use the durable consumer
  ``<group>-<member>`` on the origin stream and must be in the membership; elastic members use
  the consumer ``<member>`` on ``<stream>-<group>`` with explicit acks and
  ``inactive_threshold = ack_wait``, and wait until they are in the membership.
- Pulls carry the last ``Nats-Pin-Id`` seen; a 423 (the pin moved) drops it.
- The config key is watched: on an elastic membership change the pinned instance deletes the
  member's consumer at once, the others wait 400–499 ms, then every instance creates it again
  (action ``create``; a different existing config, error 10148, is deleted and re-created).
  A self-heal runs every ``ack_wait + 0.5 s``.

Config written to KV by another tool (each watched revision is parsed and validated):

- the key deleted or purged → the member stops cleanly (``done()`` is ``None``);
- invalid (not JSON, wrong shapes, or rules broken, e.g. mappings that miss a partition) → the
  revision is ignored: the member keeps consuming with the last valid config, logs a warning
  naming the revision and the reason, and exposes it as :attr:`ConsumeHandle.config_error`
  (with :attr:`ConsumeHandle.config_revision`, the revision in use); the next valid revision
  is applied as usual and clears it;
- an elastic group's ``max_members``, ``partitioning_filters`` or buffer limits changed → the
  member stops with a :class:`~cg_pipelines.core.errors.ConfigError` such as ``max_members:
  changed from 4 to 3 at revision 9 ...``: the work-queue stream's subject transform was fixed
  when the group was created, so the group must be deleted and created again;
- a static group's config changed at all → the member deletes its consumer and stops with a
  :class:`~cg_pipelines.core.errors.MembershipError` (static groups are re-created, not
  updated).

Fixed relative to the reference: a consume loop that hits a terminal error (the consumer was
deleted under it, reference issue #41) re-creates the consumer instead of staying a zombie;
active-member checks are per member (:func:`cg_pipelines.jetstream.admin.member_status`);
mappings plus several filters give no duplicate filters.

Units: seconds in this API (nanoseconds on the wire, converted by
:func:`cg_pipelines.jetstream.api.consumer_config`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from cg_pipelines.core.assignment import generate_partition_filters
from cg_pipelines.core.config import (
    PRIORITY_GROUP,
    ElasticConfig,
    StaticConfig,
    config_key,
    static_member_consumer_name,
    work_queue_stream_name,
)
from cg_pipelines.core.errors import ConfigError, MembershipError, UsageError
from cg_pipelines.core.subjects import strip_partition
from cg_pipelines.jetstream.api import JetStreamAPI, consumer_config
from cg_pipelines.jetstream.api_admin import pinned_client_id
from cg_pipelines.jetstream.errors import (
    ConsumerAlreadyExistsError,
    ConsumerNotFoundError,
    JetStreamError,
    StreamNotFoundError,
    WorkQueueConsumerNotUniqueError,
)
from cg_pipelines.jetstream.kv import ConfigStore

log = logging.getLogger(__name__)

DEFAULT_ACK_WAIT_S = 5.0
MIN_PRIORITY_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class MemberConfig:
    """The caller's consumer settings (the rest is set by the group).

    Attributes:
        ack_wait_s: seconds before an unacknowledged message is redelivered (default 5).
        max_ack_pending: messages in flight per member (1 = strict per-member order).
        max_deliver: deliveries before a message is given up (``None``: unlimited).
        extra: other consumer config fields, in wire form (nanoseconds for durations).
    """

    ack_wait_s: float = DEFAULT_ACK_WAIT_S
    max_ack_pending: int = 1
    max_deliver: int | None = None
    extra: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.ack_wait_s <= 0:
            raise ConfigError("ack_wait_s", f"must be > 0 seconds, got {self.ack_wait_s}")
        if self.max_ack_pending < 1:
            raise ConfigError("max_ack_pending", f"must be >= 1, got {self.max_ack_pending}")


class GroupMsg:
    """A delivered message with the partition token stripped from its subject.

    Everything else is the nats-py message: ``data``, ``headers``, ``metadata``, ``reply``,
    ``ack()``, ``ack_sync()`` (double ack: waits for the server's confirmation), ``nak()``,
    ``term()``, ``in_progress()``. ``partition`` is the stripped token.
    """

    __slots__ = ("msg", "subject", "partition")

    def __init__(self, msg: Msg) -> None:
        self.msg = msg
        self.partition, self.subject = strip_partition(msg.subject)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.msg, name)

    def __repr__(self) -> str:
        return f"GroupMsg(subject={self.subject!r}, partition={self.partition})"


Handler = Callable[[GroupMsg], Awaitable[None] | None]


class ConsumeHandle:
    """A running member instance: :meth:`stop` ends it; ``await done()`` returns the error that
    ended it (``ConfigError`` when an elastic group's shape changed, ``MembershipError`` when a
    static group's config changed), or ``None`` after a clean stop (``stop()`` or the group's
    config deleted)."""

    def __init__(self, task: asyncio.Task[BaseException | None], member: _Member) -> None:
        self._task = task
        self._member = member

    def stop(self) -> None:
        self._member.stopping.set()

    async def done(self) -> BaseException | None:
        return await asyncio.shield(self._task)

    @property
    def pin_id(self) -> str | None:
        """The pin id this instance last saw (``None`` when it is a standby)."""
        return self._member.pin_id

    @property
    def joined(self) -> bool:
        """True while the member's consumer exists as this instance created it."""
        return self._member.consumer_ok

    @property
    def config_revision(self) -> int:
        """The KV revision of the config this member applies (the last valid one)."""
        return self._member.revision

    @property
    def config_error(self) -> ConfigError | None:
        """Why the latest config revision written was ignored (invalid), naming that revision
        and the one kept; ``None`` when the latest revision was applied."""
        return self._member.config_error


class _Member:
    def __init__(self, js: JetStreamContext, kind: str, stream: str, group: str, member: str,
                 handler: Handler, config: MemberConfig) -> None:
        self.js, self.kind, self.stream, self.group, self.member = (
            js, kind, stream, group, member)
        self.handler = handler
        self.is_async = inspect.iscoroutinefunction(handler)
        self.config = config
        self.api = JetStreamAPI.from_js(js)
        self.store: ConfigStore[StaticConfig] | ConfigStore[ElasticConfig] = (
            ConfigStore(js, "static") if kind == "static" else ConfigStore(js, "elastic"))
        if kind == "static":
            self.on_stream = stream
            self.cname = static_member_consumer_name(group, member)
        else:
            self.on_stream = work_queue_stream_name(stream, group)
            self.cname = member
        self.cfg: StaticConfig | ElasticConfig | None = None
        self.revision = 0  # KV revision of self.cfg
        self.config_error: ConfigError | None = None
        self.pin_id: str | None = None
        self.consumer_ok = False
        self.stopping = asyncio.Event()
        self.paused = asyncio.Event()  # set while a membership change is being applied
        self.lock = asyncio.Lock()

    # -- consumer ------------------------------------------------------------------------------

    def filters(self) -> list[str]:
        assert self.cfg is not None
        flt = (self.cfg.filters if isinstance(self.cfg, StaticConfig)
               else self.cfg.consumer_filters())
        return generate_partition_filters(self.cfg.members, self.cfg.max_members,
                                          self.cfg.member_mappings, self.member, flt)

    def consumer_wire_config(self, filters: list[str]) -> dict[str, Any]:
        c = self.config
        timeout = max(c.ack_wait_s, MIN_PRIORITY_TIMEOUT_S)
        durable, name = (self.cname, None) if self.kind == "static" else (None, self.cname)
        return consumer_config(
            durable_name=durable, name=name,
            filter_subjects=filters, ack_wait_s=c.ack_wait_s, max_ack_pending=c.max_ack_pending,
            max_deliver=c.max_deliver,
            inactive_threshold_s=c.ack_wait_s if self.kind == "elastic" else None,
            priority_groups=[PRIORITY_GROUP], priority_policy="pinned_client",
            priority_timeout_s=timeout, extra=c.extra)

    async def join(self) -> None:
        """Create the member's consumer for the current config (no-op when not a member)."""
        filters = self.filters()
        if not filters:
            self.consumer_ok = False
            return
        wire = self.consumer_wire_config(filters)
        try:
            try:
                await self.api.create_consumer(self.on_stream, wire)
            except ConsumerAlreadyExistsError:
                # Another config (an older membership): replace it; others retry if they race.
                with contextlib.suppress(ConsumerNotFoundError):
                    await self.api.delete_consumer(self.on_stream, self.cname)
                await self.api.create_consumer(self.on_stream, wire)
            self.consumer_ok = True
        except WorkQueueConsumerNotUniqueError:
            # Another member still holds some of these partitions (it has not applied the
            # change yet): the self-heal tries again.
            self.consumer_ok = False
        except JetStreamError as e:
            log.warning("member %s of %s.%s: cannot create its consumer: %s", self.member,
                        self.stream, self.group, e)
            self.consumer_ok = False

    async def is_pinned(self) -> bool:
        if self.pin_id is None:
            return False
        try:
            info = await self.api.consumer_info(self.on_stream, self.cname)
        except JetStreamError:
            return False
        return pinned_client_id(info) == self.pin_id

    # -- loops ---------------------------------------------------------------------------------

    async def pull_loop(self) -> None:
        expires = max(MIN_PRIORITY_TIMEOUT_S, min(self.config.ack_wait_s / 2, 5.0))
        batch = self.config.max_ack_pending
        while not self.stopping.is_set():
            if not self.consumer_ok or self.paused.is_set():
                await asyncio.sleep(0.05)
                continue
            got = await self.api.pull(self.on_stream, self.cname, batch=batch,
                                      expires_s=expires, pin_id=self.pin_id)
            if got.pin_lost:
                self.pin_id = None
                continue
            if got.status in (409, 503) and not got.messages:
                # The consumer was deleted under us (409 Consumer Deleted) or is gone (no
                # responders): the self-heal re-creates it (the reference stays a zombie, #41).
                self.consumer_ok = False
                await asyncio.sleep(0.05)
                continue
            if got.pin_id:
                self.pin_id = got.pin_id
            for msg in got.messages:
                if self.stopping.is_set():
                    await msg.nak()
                    continue
                try:
                    result = self.handler(GroupMsg(msg))
                    if self.is_async:
                        await result  # type: ignore[misc]
                except Exception as e:  # a handler bug must not stop the member
                    # Never lost: the message is nak'ed (redelivered); a message the handler
                    # already acked ignores the nak.
                    log.warning("member %s: handler failed on %s #%s: %s: %s; nak'ed",
                                self.member, msg.subject, msg.metadata.sequence.stream,
                                type(e).__name__, e)
                    with contextlib.suppress(Exception):
                        await msg.nak()

    async def watch_loop(self) -> BaseException | None:
        kv = await self.store.bucket()
        assert kv is not None
        watcher = await kv.watch(config_key(self.stream, self.group))
        try:
            while not self.stopping.is_set():
                try:
                    entry = await watcher.updates(timeout=0.5)  # type: ignore[no-untyped-call]
                except (TimeoutError, nats.errors.TimeoutError):
                    continue
                if entry is None:
                    continue
                if entry.operation in ("DEL", "PURGE"):
                    return None
                if entry.revision <= self.revision:
                    continue  # the watcher's first entry: the config already applied
                try:
                    new = self.store.decode(entry.value or b"")
                except ConfigError as e:
                    self.reject(entry.revision, e)
                    continue
                err = await self.apply(new, entry.revision)
                if err is not None:
                    return err
            return None
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()  # type: ignore[no-untyped-call]

    def reject(self, revision: int, e: ConfigError) -> None:
        """An invalid revision: keep the last valid config, say why (no payload echoed)."""
        self.config_error = ConfigError(
            e.field, f"{e.rule} ({self.kind} config {self.stream}.{self.group} revision "
            f"{revision} ignored; still applying revision {self.revision})")
        log.warning("member %s: %s", self.member, self.config_error)

    async def apply(self, new: StaticConfig | ElasticConfig, revision: int
                    ) -> BaseException | None:
        """Apply a valid config written at ``revision``; returns an error to stop with, or
        ``None``."""
        old = self.cfg
        assert old is not None
        if isinstance(new, StaticConfig):
            if new != old:
                with contextlib.suppress(JetStreamError):
                    await self.api.delete_consumer(self.on_stream, self.cname)
                return MembershipError(f"static consumer group {self.stream}.{self.group} "
                                       f"config changed at revision {revision}: static groups "
                                       "are deleted and re-created, not updated; stopping")
            self.revision, self.config_error = revision, None
            return None
        assert isinstance(old, ElasticConfig)
        changes = old.shape_changes(new)
        if changes:
            (field, a0, b0), rest = changes[0], changes[1:]
            what = f"changed from {a0} to {b0}" + "".join(
                f" (and {f} from {a} to {b})" for f, a, b in rest)
            return ConfigError(field, f"{what} at revision {revision} of elastic consumer group "
                               f"{self.stream}.{self.group}: the work-queue stream "
                               f"{self.on_stream} was created for the old values (its subject "
                               "transform is fixed); delete the group and create it again; "
                               "stopping")
        self.revision, self.config_error = revision, None
        if (new.members, new.member_mappings) == (old.members, old.member_mappings) and \
                self.consumer_ok:
            return None
        async with self.lock:
            self.cfg = new
            self.paused.set()
            try:
                pinned = await self.is_pinned()
                if pinned:
                    with contextlib.suppress(JetStreamError):
                        await self.api.delete_consumer(self.on_stream, self.cname)
                else:
                    await asyncio.sleep(random.uniform(0.4, 0.499))
                self.consumer_ok = False
                await self.join()
            finally:
                self.paused.clear()
        return None

    async def heal_loop(self) -> None:
        every = self.config.ack_wait_s + 0.5
        while not self.stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), every)
            if self.stopping.is_set():
                return
            async with self.lock:
                if self.cfg is not None and self.cfg.is_member(self.member):
                    if not self.consumer_ok:
                        await self.join()
                    else:
                        # The consumer may have been deleted under us (reference #41).
                        try:
                            await self.api.consumer_info(self.on_stream, self.cname)
                        except ConsumerNotFoundError:
                            await self.join()

    async def run(self) -> BaseException | None:
        stop_wait = asyncio.create_task(self.stopping.wait())
        tasks = [asyncio.create_task(self.pull_loop()), asyncio.create_task(self.heal_loop())]
        watch = asyncio.create_task(self.watch_loop())
        try:
            done, _ = await asyncio.wait([watch, stop_wait, *tasks],
                                         return_when=asyncio.FIRST_COMPLETED)
            if watch in done:
                return watch.result()
            for t in tasks:
                if t in done and t.exception() is not None:
                    return t.exception()
            return None
        finally:
            self.stopping.set()
            every: list[asyncio.Task[Any]] = [*tasks, watch, stop_wait]
            for t in every:
                t.cancel()
            for t in every:
                with contextlib.suppress(BaseException):
                    await t
            await self.api.close()


async def _consume(kind: str, js: JetStreamContext, stream: str, group: str, member: str,
                   handler: Handler, config: MemberConfig | None) -> ConsumeHandle:
    if handler is None:
        raise UsageError("a message handler must be provided")
    m = _Member(js, kind, stream, group, member, handler, config or MemberConfig())
    try:
        v = await m.store.get(stream, group)  # first: a missing group is named as such
        m.cfg, m.revision = v.config, v.revision
        try:
            await m.api.stream_info(m.on_stream)
        except StreamNotFoundError as e:
            raise StreamNotFoundError(e.status, e.err_code, f"stream {m.on_stream!r} of {kind} "
                                      f"consumer group {stream}.{group} not found") from None
        if kind == "static" and not m.cfg.is_member(member):
            raise MembershipError(f"{member!r} is not in the membership of static consumer "
                                  f"group {stream}.{group}")
        if m.cfg.is_member(member):
            await m.join()
    except BaseException:
        await m.api.close()
        raise
    return ConsumeHandle(asyncio.create_task(m.run()), m)


async def static_consume(js: JetStreamContext, stream: str, group: str, member: str,
                         handler: Handler, config: MemberConfig | None = None) -> ConsumeHandle:
    """Join a static group as ``member`` and hand its messages to ``handler``.

    ``handler(msg: GroupMsg)`` may be sync or async; it acks (or naks) the message. A handler
    that raises gets the message nak'ed (redelivered) and the member goes on.
    Raises ``GroupNotFoundError``, ``StreamNotFoundError`` (naming the stream),
    ``MembershipError`` (not a member), ``ConfigError`` (stored config invalid); nothing is
    created when it raises.
    """
    return await _consume("static", js, stream, group, member, handler, config)


async def elastic_consume(js: JetStreamContext, stream: str, group: str, member: str,
                          handler: Handler, config: MemberConfig | None = None) -> ConsumeHandle:
    """Join an elastic group as ``member`` (messages flow once it is in the membership and this
    instance is pinned). Same handler contract and errors as :func:`static_consume`, except
    that not being a member yet is not an error."""
    return await _consume("elastic", js, stream, group, member, handler, config)
