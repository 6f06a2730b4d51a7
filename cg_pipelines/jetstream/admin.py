"""Consumer-group administration, static and elastic, wire-compatible with the reference.

Mirrors synadia-io/orbit.go ``pcgroups`` (v0.2.1) admin calls, fixing that version's defects
(there, membership and mapping updates are not compare-and-set, members are written in random
order, static delete removes every consumer whose name starts with ``<group>-``, and the
active-member check ignores the member name): here membership and mapping updates are
compare-and-set; members are written sorted and de-duplicated; static delete removes only this
group's member consumers (``<group>-<member>``); the active-member check is per member.

A stored config is parsed and validated before anything is computed from it: one that breaks
the rules (e.g. ``max_members`` above :data:`~cg_pipelines.core.config.MAX_MEMBERS`, duplicate
member names) makes every call but the deletes raise ``ConfigError`` at once, writing nothing.
Updates keep the stored JSON of every field they do not change, and unknown fields
(:attr:`~cg_pipelines.core.config.ElasticConfig.unknown_fields`), as they were.

All calls take a nats-py ``JetStreamContext`` and raise:
``ConfigError`` (invalid config or arguments, nothing written), ``GroupNotFoundError``,
``GroupExistsError``, ``MembershipError``, ``ConcurrentUpdateError`` (cg_pipelines.core.errors)
and ``JetStreamError`` subclasses for server errors (cg_pipelines.jetstream.errors).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from nats.js import JetStreamContext

from cg_pipelines.core.assignment import (
    Assignment,
    as_mappings,
    assignment,
    moved_partitions,
    sticky_assignment,
)
from cg_pipelines.core.config import (
    ELASTIC_BUCKET,
    PRIORITY_GROUP,
    STATIC_BUCKET,
    ElasticConfig,
    MemberMapping,
    StaticConfig,
    static_member_consumer_name,
    with_mappings,
    with_members,
    work_queue_stream_name,
)
from cg_pipelines.core.copartition import SetGroup, previous_set_assignment, set_assignment
from cg_pipelines.core.errors import (
    ConcurrentUpdateError,
    ConfigError,
    GroupExistsError,
    MembershipError,
)
from cg_pipelines.core.subjects import name_error, transform_destination
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.errors import (
    ConsumerNotFoundError,
    JetStreamError,
    StreamNotFoundError,
)
from cg_pipelines.jetstream.kv import ConfigStore, Kind, Versioned


def _check_names(**names: str) -> None:
    for what, value in names.items():
        if err := name_error(value):
            raise ConfigError(what, f"{value!r} {err}")


def _api(js: JetStreamContext, timeout: float) -> JetStreamAPI:
    return JetStreamAPI.from_js(js, timeout=timeout)


async def _stream_info(api: JetStreamAPI, stream: str) -> dict[str, Any]:
    """Stream info; raises ``StreamNotFoundError`` naming ``stream`` if it does not exist."""
    try:
        return await api.stream_info(stream)
    except StreamNotFoundError as e:
        raise StreamNotFoundError(e.status, e.err_code, f"stream {stream!r} not found") from None


async def _step_down(js: JetStreamContext, kind: Kind, stream: str, group: str, member: str,
                     timeout: float) -> None:
    """Unpin ``member``'s consumer after checking the group and the membership."""
    cfg = (await ConfigStore(js, kind, timeout).get(stream, group)).config
    if not cfg.is_member(member):
        raise MembershipError(f"{member!r} is not a member of {kind} consumer group "
                              f"{stream}.{group}")
    if kind == "static":
        on_stream, consumer = stream, static_member_consumer_name(group, member)
    else:
        on_stream, consumer = work_queue_stream_name(stream, group), member
    try:
        await _api(js, timeout).unpin(on_stream, consumer, PRIORITY_GROUP)
    except (ConsumerNotFoundError, StreamNotFoundError):
        raise MembershipError(f"member {member!r} of {kind} consumer group {stream}.{group} has "
                              f"no consumer {consumer!r} on {on_stream!r}: no instance has "
                              "joined, nothing to step down") from None


# --------------------------------------------------------------------------------------- static


async def create_static(
    js: JetStreamContext, stream: str, group: str, config: StaticConfig, *, timeout: float = 5.0
) -> Versioned[StaticConfig]:
    """Create a static group (config in KV only; members create their consumers).

    The stream must exist; idempotent for an equal config. Raises ``ConfigError``,
    ``StreamNotFoundError`` (naming the stream), ``GroupExistsError``; nothing is written
    when it raises.
    """
    _check_names(stream=stream, group=group)
    config.validate()
    api = _api(js, timeout)
    info = await _stream_info(api, stream)
    replicas = int(info["config"].get("num_replicas") or 1)
    ver = await ConfigStore(js, "static", timeout).create(stream, group, config, replicas=replicas)
    await raise_replicas(api, f"KV_{STATIC_BUCKET}", replicas)
    return ver


async def get_static(
    js: JetStreamContext, stream: str, group: str, *, timeout: float = 5.0
) -> Versioned[StaticConfig]:
    """The static group's config and KV revision. Raises ``GroupNotFoundError``, ``ConfigError``."""
    return await ConfigStore(js, "static", timeout).get(stream, group)


async def list_static(js: JetStreamContext, stream: str, *, timeout: float = 5.0) -> list[str]:
    """Static group names on ``stream``, sorted."""
    return await ConfigStore(js, "static", timeout).list_groups(stream)


async def delete_static(js: JetStreamContext, stream: str, group: str, *, timeout: float = 5.0
                        ) -> list[str]:
    """Delete a static group: its KV config and exactly its members' consumers.

    Works on a stored config that does not validate too (its member names are read as they
    stand), so a broken config can always be removed. Returns the names of the consumers
    deleted. Raises ``GroupNotFoundError`` if absent.
    """
    store = ConfigStore(js, "static", timeout)
    try:
        members = _members_of((await store.get(stream, group)).config)
    except ConfigError:
        members = _stored_member_names((await store.get_raw(stream, group))[0])
    await store.delete(stream, group)
    names = {static_member_consumer_name(group, m) for m in members}
    api = _api(js, timeout)
    deleted = []
    for name in sorted(names & set(await api.list_consumer_names(stream))):
        try:
            await api.delete_consumer(stream, name)
            deleted.append(name)
        except ConsumerNotFoundError:
            pass
    return deleted


async def static_step_down(
    js: JetStreamContext, stream: str, group: str, member: str, *, timeout: float = 5.0
) -> None:
    """Unpin the active instance of a static member (another joined instance takes over).

    Raises ``GroupNotFoundError``, ``ConfigError`` (stored config invalid), ``MembershipError``
    (not a member, or no instance joined: no consumer).
    """
    await _step_down(js, "static", stream, group, member, timeout)


# -------------------------------------------------------------------------------------- elastic


def work_queue_stream_config(
    stream: str, group: str, config: ElasticConfig, *, replicas: int, storage: str
) -> dict[str, Any]:
    """Wire config of the elastic group's work-queue stream ``<stream>-<group>``.

    Retention workqueue, no subjects, one source (the origin stream) with one subject transform
    per partitioning filter (``>`` when none), discard new, direct get allowed, limits from the
    config (0 = unlimited).
    """
    pfs = config.partitioning_filters
    transforms = [
        {"src": pf.filter,
         "dest": transform_destination(pf.filter, pf.partitioning_wildcards, config.max_members)}
        for pf in pfs
    ] or [{"src": ">", "dest": transform_destination(">", (), config.max_members)}]
    return {
        "name": work_queue_stream_name(stream, group),
        "retention": "workqueue",
        "storage": storage,
        "num_replicas": replicas,
        "max_msgs": config.max_buffered_msgs or -1,
        "max_bytes": config.max_buffered_bytes or -1,
        "discard": "new",
        "allow_direct": True,
        "sources": [{"name": stream, "subject_transforms": transforms}],
    }


async def create_elastic(
    js: JetStreamContext, stream: str, group: str, config: ElasticConfig, *, timeout: float = 5.0
) -> Versioned[ElasticConfig]:
    """Create an elastic group: the KV config and the work-queue stream ``<stream>-<group>``.

    The origin stream must exist; its replicas and storage are used for both (the KV bucket,
    shared by every elastic group, is raised to its replicas when it has fewer). Idempotent for an
    equal config shape (membership may differ: the stored one is kept). Raises ``ConfigError``,
    ``StreamNotFoundError`` (naming the stream), ``GroupExistsError`` (a different shape
    exists); nothing is written when it raises.
    """
    _check_names(stream=stream, group=group)
    config.validate()
    api = _api(js, timeout)
    info = await _stream_info(api, stream)
    replicas = int(info["config"].get("num_replicas") or 1)
    storage = str(info["config"].get("storage") or "file")
    store = ConfigStore(js, "elastic", timeout)
    try:
        ver = await store.create(stream, group, config, replicas=replicas)
    except GroupExistsError:
        ver = await store.get(stream, group)
        if not ver.config.same_shape(config):
            raise
    await raise_replicas(api, f"KV_{ELASTIC_BUCKET}", replicas)
    wq = work_queue_stream_config(stream, group, ver.config, replicas=replicas, storage=storage)
    await api.create_stream(wq)
    return ver


async def raise_replicas(api: JetStreamAPI, name: str, replicas: int) -> bool:
    """Give stream ``name`` (e.g. a KV bucket's ``KV_<bucket>``, shared by every group of a
    kind and created with the first group's origin replicas) at least ``replicas`` replicas.
    Best effort: returns True when it was raised, False when it already had enough, is missing
    or the server refused (e.g. not enough servers up; the next create tries again)."""
    try:
        info = await api.stream_info(name)
    except JetStreamError:
        return False
    config = dict(info.get("config") or {})
    if int(config.get("num_replicas") or 1) >= replicas:
        return False
    config["num_replicas"] = replicas
    try:
        await api.update_stream(config)
    except JetStreamError:
        return False
    return True


async def get_elastic(
    js: JetStreamContext, stream: str, group: str, *, timeout: float = 5.0
) -> Versioned[ElasticConfig]:
    """The elastic group's config and KV revision.

    Raises ``GroupNotFoundError``, ``ConfigError``.
    """
    return await ConfigStore(js, "elastic", timeout).get(stream, group)


async def list_elastic(js: JetStreamContext, stream: str, *, timeout: float = 5.0) -> list[str]:
    """Elastic group names on ``stream``, sorted."""
    return await ConfigStore(js, "elastic", timeout).list_groups(stream)


async def delete_elastic(
    js: JetStreamContext, stream: str, group: str, *, timeout: float = 5.0
) -> bool:
    """Delete an elastic group: KV config, then the work-queue stream (and its consumers).

    Returns False if neither existed (idempotent: not an error here; ``cg elastic delete``
    reports it as one, exit 2).
    """
    found = await ConfigStore(js, "elastic", timeout).delete(stream, group)
    try:
        await _api(js, timeout).delete_stream(work_queue_stream_name(stream, group))
        return True
    except StreamNotFoundError:
        return found


def _members_of(cfg: StaticConfig | ElasticConfig) -> list[str]:
    return list(cfg.members) or [m.member for m in cfg.member_mappings]


def _stored_member_names(data: bytes) -> list[str]:
    """Member names in stored JSON that may break the rules, best effort (``members`` and the
    mappings' ``member``, the ADR's ``member-mappings`` too); [] if unreadable."""
    try:
        obj = json.loads(data)
    except ValueError:
        return []
    if not isinstance(obj, dict):
        return []
    members = obj.get("members")
    names = [m for m in members if isinstance(m, str)] if isinstance(members, list) else []
    for key in ("member_mappings", "member-mappings"):
        maps = obj.get(key)
        if isinstance(maps, list):
            names += [m["member"] for m in maps
                      if isinstance(m, dict) and isinstance(m.get("member"), str)]
    return names


def _membership_change(
    cfg: ElasticConfig, new_members: Iterable[str], *, sticky: bool
) -> ElasticConfig:
    members = sorted(set(new_members))
    if sticky:
        if not members:
            return with_members(cfg, [])
        return with_mappings(
            cfg, as_mappings(sticky_assignment(assignment(cfg), members, cfg.max_members))
        )
    if cfg.member_mappings:
        raise MembershipError(
            "the group uses member mappings: change them with set/delete mappings "
            "(or use the sticky strategy)"
        )
    return with_members(cfg, members)


async def add_members(
    js: JetStreamContext,
    stream: str,
    group: str,
    members: Sequence[str],
    *,
    sticky: bool = False,
    timeout: float = 5.0,
) -> Versioned[ElasticConfig]:
    """Add members (compare-and-set; written sorted and de-duplicated).

    Default: the reference's ``members`` list. ``sticky=True``: the sticky strategy — partitions
    stay with surviving owners and the result is written as ``member_mappings`` (so reference
    members compute the same filters). Raises ``ConfigError`` (bad name, nothing written),
    ``MembershipError`` (group uses mappings and not sticky), ``GroupNotFoundError``.
    """
    if not members:
        raise ConfigError("members", "give at least one member name")
    for m in members:
        _check_names(member=m)
    return await ConfigStore(js, "elastic", timeout).update(
        stream, group,
        lambda c: _membership_change(c, [*_members_of(c), *members], sticky=sticky),
    )


async def drop_members(
    js: JetStreamContext,
    stream: str,
    group: str,
    members: Sequence[str],
    *,
    sticky: bool = False,
    timeout: float = 5.0,
) -> Versioned[ElasticConfig]:
    """Drop members (compare-and-set). Unknown names are ignored. Errors as :func:`add_members`."""
    if not members:
        raise ConfigError("members", "give at least one member name")
    gone = set(members)
    return await ConfigStore(js, "elastic", timeout).update(
        stream, group,
        lambda c: _membership_change(c, [m for m in _members_of(c) if m not in gone],
                                     sticky=sticky),
    )


async def set_member_mappings(
    js: JetStreamContext,
    stream: str,
    group: str,
    mappings: Sequence[MemberMapping],
    *,
    timeout: float = 5.0,
) -> Versioned[ElasticConfig]:
    """Replace the membership with explicit mappings (validated, compare-and-set).

    Raises ``ConfigError`` naming the broken rule (nothing written), ``GroupNotFoundError``.
    """
    if not mappings:
        raise ConfigError("member_mappings", "give at least one mapping")
    return await ConfigStore(js, "elastic", timeout).update(
        stream, group, lambda c: with_mappings(c, mappings)
    )


async def delete_member_mappings(
    js: JetStreamContext, stream: str, group: str, *, timeout: float = 5.0
) -> Versioned[ElasticConfig]:
    """Remove the mappings (the group then has no members). Compare-and-set."""
    return await ConfigStore(js, "elastic", timeout).update(
        stream, group, lambda c: with_members(c, []) if c.member_mappings else c
    )


@dataclass(frozen=True, slots=True)
class SetMembership:
    """What :func:`set_set_mappings` did: the set's assignment before (as
    :func:`~cg_pipelines.core.copartition.previous_set_assignment` reads it) and after, and
    every group's config as written, by ``(stream, group)`` in the order given."""

    previous: Assignment
    assignment: Assignment
    configs: dict[tuple[str, str], Versioned[ElasticConfig]]

    @property
    def moved(self) -> dict[int, tuple[str | None, str | None]]:
        """``{partition: (old_owner, new_owner)}`` for the partitions that changed owner."""
        return moved_partitions(self.previous, self.assignment)


async def set_set_mappings(
    js: JetStreamContext,
    groups: Sequence[tuple[str, str]],
    members: Sequence[str],
    *,
    timeout: float = 5.0,
) -> SetMembership:
    """Give a co-partitioned set of elastic groups ``members``: partition ``p`` of every group
    to the same member, sticky (:func:`~cg_pipelines.core.copartition.set_assignment`),
    written as each group's ``member_mappings`` (``members`` cleared: the reference allows
    members or mappings, not both) so reference members compute the same partitions.

    Every config is read and the set checked before anything is written
    (:func:`~cg_pipelines.core.copartition.check_copartitioned`); then each group is written
    in the given order, compare-and-set, a group already holding the mappings not at all. The
    groups are not written atomically: between two writes, and if a write fails, members of
    the groups written so far already follow the new mappings. Running the same call again
    completes the set (the first group's owners win when groups disagree). Raises
    ``ConfigError`` (a bad name, no member: nothing written), ``CoPartitionError`` (nothing
    written), ``GroupNotFoundError``, ``ConcurrentUpdateError`` (a group was recreated with
    another shape while the set was written).
    """
    if not members:
        raise ConfigError("members", "give at least one member name")
    for m in members:
        _check_names(member=m)
    for stream, group in groups:
        _check_names(stream=stream, group=group)
    store: ConfigStore[ElasticConfig] = ConfigStore(js, "elastic", timeout)
    read = [SetGroup(s, g, (await store.get(s, g)).config) for s, g in groups]
    new = set_assignment(read, members)
    mappings = as_mappings(new)
    written: dict[tuple[str, str], Versioned[ElasticConfig]] = {}
    for sg in read:
        def change(c: ElasticConfig, sg: SetGroup = sg) -> ElasticConfig:
            return _set_membership(c, sg, mappings)
        written[(sg.stream, sg.group)] = await store.update(sg.stream, sg.group, change)
    return SetMembership(previous_set_assignment(read), new, written)


def _set_membership(cfg: ElasticConfig, read: SetGroup,
                    mappings: Sequence[MemberMapping]) -> ElasticConfig:
    if not cfg.same_shape(read.config):
        raise ConcurrentUpdateError(
            f"elastic consumer group {read.stream}.{read.group} was recreated with another "
            "config while its co-partitioned set was written; check the set and run again")
    return with_mappings(cfg, mappings)


async def elastic_step_down(
    js: JetStreamContext, stream: str, group: str, member: str, *, timeout: float = 5.0
) -> None:
    """Unpin the active instance of an elastic member (another joined instance takes over).

    Raises as :func:`static_step_down`.
    """
    await _step_down(js, "elastic", stream, group, member, timeout)


# ------------------------------------------------------------------------------- active members


@dataclass(frozen=True, slots=True)
class MemberStatus:
    """One member's state: in the config's membership; its consumer exists; an instance is
    active (pinned, or a pull request waiting); its partitions under the current config."""

    member: str
    in_membership: bool
    consumer_exists: bool
    active: bool
    pinned_id: str | None
    partitions: tuple[int, ...]


async def member_status(
    js: JetStreamContext,
    kind: str,
    stream: str,
    group: str,
    *,
    members: Sequence[str] | None = None,
    timeout: float = 5.0,
) -> list[MemberStatus]:
    """Status of each member (default: every member of the config), checked per member name.

    ``kind`` is ``"static"`` or ``"elastic"``. The reference's check answers "active" for a
    member when any member's consumer exists; here each member is judged by its own consumer.
    """
    store: ConfigStore[StaticConfig] | ConfigStore[ElasticConfig] = (
        ConfigStore(js, "static", timeout) if kind == "static"
        else ConfigStore(js, "elastic", timeout))
    cfg = (await store.get(stream, group)).config
    assign = assignment(cfg)
    api = _api(js, timeout)
    static = kind == "static"
    on_stream = stream if static else work_queue_stream_name(stream, group)
    infos = {ci["name"]: ci for ci in await api.list_consumers(on_stream)}
    out = []
    for m in members if members is not None else sorted(_members_of(cfg)):
        ci = infos.get(static_member_consumer_name(group, m) if static else m)
        pinned = None
        if ci:
            for pg in ci.get("priority_groups") or []:
                if pg.get("group") == PRIORITY_GROUP and pg.get("pinned_client_id"):
                    pinned = pg["pinned_client_id"]
        active = ci is not None and (pinned is not None
                                     or int(ci.get("num_waiting") or 0) > 0)
        out.append(MemberStatus(m, cfg.is_member(m), ci is not None, active, pinned,
                                tuple(assign.get(m, ()))))
    return out


async def active_members(
    js: JetStreamContext, kind: str, stream: str, group: str, *, timeout: float = 5.0
) -> list[str]:
    """Members of the config with an active instance, sorted."""
    return [s.member for s in await member_status(js, kind, stream, group, timeout=timeout)
            if s.active]
