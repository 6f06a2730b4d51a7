"""Consumer-group configs in JetStream KV, with compare-and-set on every update.

Buckets and keys are those of the reference implementation (synadia-io/orbit.go ``pcgroups``
v0.2.1), so its members read configs written here: ``static-consumer-groups`` /
``elastic-consumer-groups``, key ``<stream>.<group>``, file storage, replicas = the source
stream's. Buckets are created only by :meth:`ConfigStore.create` (never by consumers).
Unlike the reference, every update is a compare-and-set on the entry's revision, retried on
conflict, and an update that changes nothing writes nothing (watchers see no spurious change).
A stored config is parsed and validated before anything is computed from it, so a bad one
(e.g. ``max_members`` above :data:`~cg_pipelines.core.config.MAX_MEMBERS`, duplicate member
names) fails every read with a ``ConfigError`` and nothing is written.
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar, cast, overload

import nats.errors
import nats.js.errors as jserr
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from cg_pipelines.core.config import (
    ELASTIC_BUCKET,
    STATIC_BUCKET,
    ElasticConfig,
    StaticConfig,
    config_key,
    equivalent,
)
from cg_pipelines.core.errors import (
    ConcurrentUpdateError,
    ConfigError,
    GroupExistsError,
    GroupNotFoundError,
)

Kind = Literal["static", "elastic"]
C = TypeVar("C", StaticConfig, ElasticConfig)
T = TypeVar("T")

#: What a KV call gets while the bucket's stream has no leader: just after the bucket was made
#: on a cluster (its replicas are still electing one) or while a killed leader is replaced
#: (seconds: the raft election timeout): no responders, 503, or no answer at all. The call is
#: sent again (a write is a compare-and-set: one that did land is found by the next attempt).
_NO_LEADER = (nats.errors.NoRespondersError, jserr.NoStreamResponseError,
              jserr.ServiceUnavailableError, TimeoutError)


@dataclass(frozen=True, slots=True)
class Versioned(Generic[C]):
    """A config and the KV revision it was read at (or written as)."""

    config: C
    revision: int


class ConfigStore(Generic[C]):
    """Reads and writes one kind's group configs.

    Args:
        js: a nats-py JetStream context.
        kind: ``"static"`` or ``"elastic"``.
        timeout: seconds allowed for each KV call (``asyncio.TimeoutError`` past it).
        no_leader_s: seconds a KV read or write is sent again while the bucket's stream has no
            leader (no responders, 503 or no answer: a bucket just made on a cluster, a leader
            being replaced); past it the last such error is raised, with a note naming the
            bucket.
    """

    @overload
    def __init__(self: ConfigStore[StaticConfig], js: JetStreamContext,
                 kind: Literal["static"], timeout: float = 5.0,
                 no_leader_s: float = 20.0) -> None: ...

    @overload
    def __init__(self: ConfigStore[ElasticConfig], js: JetStreamContext,
                 kind: Literal["elastic"], timeout: float = 5.0,
                 no_leader_s: float = 20.0) -> None: ...

    def __init__(self, js: JetStreamContext, kind: Kind, timeout: float = 5.0,
                 no_leader_s: float = 20.0) -> None:
        self.js = js
        self.kind: Kind = kind
        self.bucket_name = STATIC_BUCKET if kind == "static" else ELASTIC_BUCKET
        # the overloads tie C to ``kind``: C is StaticConfig exactly when kind is "static"
        self.cls: type[C] = cast("type[C]", StaticConfig if kind == "static" else ElasticConfig)
        self.timeout = timeout
        self.no_leader_s = no_leader_s
        self._kv: KeyValue | None = None

    async def _call(self, op: Callable[[], Awaitable[T]]) -> T:
        """``await op()`` within ``timeout``, sent again while the bucket's stream has no leader
        (for up to ``no_leader_s`` seconds, backing off from 50 ms to 1 s). Safe for writes
        too: every write here is a compare-and-set on the key's revision (``create``: none
        yet), so an attempt that did land makes the next one conflict, which the caller
        resolves by reading."""
        deadline = time.monotonic() + self.no_leader_s
        delay = 0.05
        while True:
            try:
                return await asyncio.wait_for(op(), self.timeout)
            except _NO_LEADER as e:
                if time.monotonic() + delay > deadline:
                    e.add_note(f"no answer from stream KV_{self.bucket_name} (the "
                               f"{self.bucket_name} KV bucket) for {self.no_leader_s:g} s: it "
                               f"has no leader, or its servers do not answer; check it with "
                               f"`nats stream info KV_{self.bucket_name}`")
                    raise
                await asyncio.sleep(delay)
                delay = min(1.0, delay * 2)

    async def bucket(self, *, create_with_replicas: int | None = None) -> KeyValue | None:
        """The KV bucket, or ``None`` if it does not exist (created if ``create_with_replicas``)."""
        if self._kv is None:
            try:
                self._kv = await self._call(functools.partial(self.js.key_value,
                                                              self.bucket_name))
            except jserr.BucketNotFoundError:
                if create_with_replicas is None:
                    return None
                self._kv = await asyncio.wait_for(
                    self.js.create_key_value(
                        KeyValueConfig(
                            bucket=self.bucket_name,
                            replicas=create_with_replicas,
                            storage=StorageType.FILE,
                        )
                    ),
                    self.timeout,
                )
        return self._kv

    async def _require(self, stream: str, group: str) -> KeyValue:
        kv = await self.bucket()
        if kv is None:
            raise GroupNotFoundError(self.kind, stream, group,
                                     f"not found (no {self.bucket_name} bucket)")
        return kv

    def decode(self, data: bytes) -> C:
        """Parse and validate stored bytes. Raises ``ConfigError`` naming the problem."""
        cfg: C = self.cls.from_json(data).validate()
        return cfg

    async def get(self, stream: str, group: str) -> Versioned[C]:
        """The group's config and revision.

        Raises ``GroupNotFoundError`` if absent, ``ConfigError`` if the stored value is invalid
        (the message says which revision).
        """
        kv = await self._require(stream, group)
        try:
            entry = await self._call(lambda: kv.get(config_key(stream, group)))
        except jserr.KeyNotFoundError:
            raise GroupNotFoundError(self.kind, stream, group) from None
        try:
            cfg = self.decode(entry.value or b"")
        except ConfigError as e:
            raise ConfigError(
                e.field, f"{e.rule} (stored {self.kind} config {stream}.{group} at revision "
                f"{entry.revision})"
            ) from None
        return Versioned(cfg, entry.revision or 0)

    async def get_raw(self, stream: str, group: str) -> tuple[bytes, int]:
        """The stored bytes and revision, unparsed (to act on a config that does not validate,
        e.g. to delete it). Raises ``GroupNotFoundError`` if absent."""
        kv = await self._require(stream, group)
        try:
            entry = await self._call(lambda: kv.get(config_key(stream, group)))
        except jserr.KeyNotFoundError:
            raise GroupNotFoundError(self.kind, stream, group) from None
        return entry.value or b"", entry.revision or 0

    async def create(self, stream: str, group: str, cfg: C, *, replicas: int = 1) -> Versioned[C]:
        """Store a new group config (validated first); idempotent for an equal config.

        Raises ``ConfigError`` if invalid, ``GroupExistsError`` if a different config exists.
        """
        cfg.validate()
        kv = await self.bucket(create_with_replicas=replicas)
        assert kv is not None
        try:
            rev = await self._call(lambda: kv.create(config_key(stream, group), cfg.to_json()))
            return Versioned(cfg, rev)
        except jserr.KeyWrongLastSequenceError:
            pass
        existing = await self.get(stream, group)
        if existing.config != cfg:
            raise GroupExistsError(
                f"{self.kind} consumer group {group!r} on stream {stream!r} exists with a "
                f"different config; delete it first to change it"
            )
        return existing

    async def update(
        self, stream: str, group: str, change: Callable[[C], C], *, attempts: int = 30
    ) -> Versioned[C]:
        """Compare-and-set: apply ``change`` to the current config and write it at that revision.

        Retries on a concurrent write (re-reading each time, after a short random backoff of a
        few milliseconds that grows with the attempt). A result equal to the current
        config, or differing only in the order of members or mappings
        (:func:`~cg_pipelines.core.config.equivalent`), is not written. What is written keeps
        the stored JSON of every unchanged field and every unknown field
        (:meth:`~cg_pipelines.core.config.ElasticConfig.to_json`). Raises
        ``GroupNotFoundError``, ``ConfigError`` (the stored or the new config is invalid:
        nothing written), or ``ConcurrentUpdateError`` after ``attempts`` conflicts.
        """
        kv = await self._require(stream, group)
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(random.uniform(0.002, 0.01) * min(attempt, 10))
            cur = await self.get(stream, group)
            new = change(cur.config).validate()
            if new == cur.config or equivalent(new, cur.config):
                return cur
            try:
                rev = await self._call(functools.partial(
                    kv.update, config_key(stream, group), new.to_json(), last=cur.revision))
                return Versioned(new, rev)
            except jserr.KeyWrongLastSequenceError:
                continue
        raise ConcurrentUpdateError(
            f"{self.kind} consumer group {stream}.{group}: config changed concurrently "
            f"{attempts} times; try again"
        )

    async def delete(self, stream: str, group: str) -> bool:
        """Delete the group's config. Returns False if there was none."""
        kv = await self.bucket()
        if kv is None:
            return False
        try:
            await self._call(lambda: kv.get(config_key(stream, group)))
        except jserr.KeyNotFoundError:
            return False
        await self._call(lambda: kv.delete(config_key(stream, group)))
        return True

    async def list_groups(self, stream: str) -> list[str]:
        """Names of this kind's groups on ``stream``, sorted.

        Reads the bucket stream's subjects ``$KV.<bucket>.<stream>.*`` (then skips deleted
        keys) rather than ``kv.keys()``, whose watcher can report "no keys" when the messages
        arrive before its consumer-info check (nats-py 2.x race, seen on a loaded machine).
        """
        kv = await self.bucket()
        if kv is None:
            return []
        prefix = f"$KV.{self.bucket_name}.{stream}."
        info = await asyncio.wait_for(
            self.js.stream_info(f"KV_{self.bucket_name}", subjects_filter=prefix + "*"),
            self.timeout)
        out = []
        for subject in sorted(info.state.subjects or {}):
            group = subject[len(prefix):]
            try:
                await self._call(functools.partial(kv.get, config_key(stream, group)))
            except jserr.KeyNotFoundError:  # a delete or purge marker
                continue
            out.append(group)
        return out
