"""Consumer-group configurations: the validated config types, byte-compatible with the
reference when written as JSON.

The JSON is what synadia-io/orbit.go ``pcgroups`` (v0.2.1) stores in the KV buckets
``static-consumer-groups`` and ``elastic-consumer-groups`` under the key ``<stream>.<group>``:
compact, fields in Go struct order, with Go's ``encoding/json`` escaping of ``<``, ``>``, ``&``
(``\\u003c``, ``\\u003e``, ``\\u0026``). Static (``StaticConsumerGroupConfig``): ``max_members``,
``filters``, ``members``, ``member_mappings`` (all three ``omitempty``). Elastic
(``ElasticConsumerGroupConfig``): ``max_members``, ``partitioning_filters`` (no ``omitempty``:
``null`` for a nil slice), ``max_buffered_msg`` and ``max_buffered_bytes`` (``omitempty``),
``members``, ``member_mappings`` (``omitempty``). ``PartitioningFilter``: ``filter``,
``partitioning_wildcards``; ``MemberMapping``: ``member``, ``partitions`` (neither
``omitempty``: a nil slice is ``null``).

Round trip. A config read from JSON remembers what it was read from. Writing it back
(:meth:`StaticConfig.to_json` / :meth:`ElasticConfig.to_json`) keeps, for every field whose value
did not change, the exact JSON that was read, keeps unknown fields in their place, and writes
only the changed fields anew, in Go struct order; a config written back unchanged gives the
bytes that were read. The codec that does it (and why it matters) is
:mod:`cg_pipelines.core.gojson`; each config describes itself to it as a list of
:data:`~cg_pipelines.core.gojson.GoField`. Unknown fields are listed by ``unknown_fields``.

Membership (``MemberMapping``, the membership rules, ``MAX_MEMBERS``, ``parse_mapping``) is in
:mod:`cg_pipelines.core.membership`; every name is importable from here too.

A config built in Python (no JSON read) is written as Go's ``json.Marshal`` writes the
reference struct built with Go's zero values: an empty ``partitioning_filters``,
``partitioning_wildcards`` or ``partitions`` is a nil slice, ``null`` (what the Go API writes for
``PartitioningFilter{Filter: f}``; the Go ``cg`` tool cannot create a filter without wildcards:
an empty answer to its wildcard prompt fails ``strconv.Atoi`` and leaves index 0, which
``validateConfig`` rejects).

The older names of the NATS design proposal "(Partitioned) Consumer Groups for JetStream"
(the ADR the reference implementation grew from) are read too: ``member-mappings``, ``filter``,
``partitioning-wildcards``, ``msg-buffer-size``; a config read through them is written with the
code's names.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TypeVar

from cg_pipelines.core.errors import ConfigError
from cg_pipelines.core.gojson import (
    GoField,
    GoObject,
    JsonObject,
    RawJson,
    encode_fields,
    go_json,
    is_int,
    load_object,
    nested_unknown,
)
from cg_pipelines.core.membership import (
    MAX_MEMBERS,
    MemberMapping,
    check_max_members,
    parse_mapping,
    validate_membership,
)
from cg_pipelines.core.subjects import subject_error

__all__ = [
    "ELASTIC_BUCKET",
    "MAX_MEMBERS",
    "PRIORITY_GROUP",
    "STATIC_BUCKET",
    "ElasticConfig",
    "MemberMapping",
    "PartitioningFilter",
    "StaticConfig",
    "check_max_members",
    "config_key",
    "dlq_stream_name",
    "equivalent",
    "go_json",
    "parse_mapping",
    "static_member_consumer_name",
    "with_mappings",
    "with_members",
    "work_queue_stream_name",
]

STATIC_BUCKET = "static-consumer-groups"
ELASTIC_BUCKET = "elastic-consumer-groups"


def config_key(stream: str, group: str) -> str:
    """KV key of a group's config: ``"<stream>.<group>"``."""
    return f"{stream}.{group}"


PRIORITY_GROUP = "PCG"
"""The priority group of every consumer the library pins a client on (static member consumers,
elastic member consumers, partition-run lease consumers): ``priority_groups=["PCG"]`` with policy
``pinned_client``, as synadia-io/orbit.go ``pcgroups`` names it."""


def static_member_consumer_name(group: str, member: str) -> str:
    """Durable consumer name of a static group's member on the origin stream:
    ``"<group>-<member>"`` (a static group run by partition runs uses
    :func:`cg_pipelines.engine.static.static_partition_consumer_name` instead)."""
    return f"{group}-{member}"


def work_queue_stream_name(stream: str, group: str) -> str:
    """Name of an elastic group's work-queue stream: ``"<stream>-<group>"``."""
    return f"{stream}-{group}"


def dlq_stream_name(stream: str, group: str) -> str:
    """Name of a group's dead-letter stream: ``"<stream>-<group>-dlq"`` (subjects
    ``<name>.<partition>`` and ``<name>.halted.<partition>``, see
    :mod:`cg_pipelines.engine.deadletter`)."""
    return f"{work_queue_stream_name(stream, group)}-dlq"


# ----------------------------------------------------------------------------- the parts


@dataclass(frozen=True, slots=True)
class PartitioningFilter(GoObject):
    """An elastic group's subject filter and the 1-based ``*`` indexes hashed into the key.

    ``PartitioningFilter("flights.*.*", (2,))`` partitions ``flights.<carrier>.<tailnum>`` on the
    tail number. No wildcards means the whole subject is hashed; built here, that is written
    ``"partitioning_wildcards":null`` (Go's nil slice), read from JSON it is written back as it
    was read (``null`` or ``[]``).
    """

    filter: str
    partitioning_wildcards: tuple[int, ...] = ()
    _raw: RawJson | None = field(default=None, compare=False, repr=False)

    def _go(self) -> list[GoField]:
        return [("filter", self.filter, True, self.filter),
                ("partitioning_wildcards", self.partitioning_wildcards, True,
                 list(self.partitioning_wildcards) or None)]

    @classmethod
    def from_dict(cls, d: object) -> PartitioningFilter:
        if not isinstance(d, dict):
            raise ConfigError("partitioning_filters", "each partitioning filter must be an object")
        flt = d.get("filter")
        adr: dict[str, str] = {}
        if "partitioning_wildcards" in d:
            wcs = d["partitioning_wildcards"] or []
        else:
            wcs = d.get("partitioning-wildcards") or []
            if "partitioning-wildcards" in d:
                adr["partitioning-wildcards"] = "partitioning_wildcards"
        if not isinstance(flt, str):
            raise ConfigError("partitioning_filters", "'filter' must be a string")
        if not isinstance(wcs, list) or not all(is_int(w) for w in wcs):
            raise ConfigError("partitioning_filters", "'partitioning_wildcards' must be integers")
        parsed = {"filter": flt, "partitioning_wildcards": tuple(wcs)}
        raw = RawJson(d, parsed, frozenset(k for k in parsed if k in d), adr)
        return cls(flt, tuple(wcs), raw)


def _str_list(obj: JsonObject, key: str) -> tuple[str, ...]:
    v = obj.get(key) or []
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise ConfigError(key, "must be a list of strings")
    return tuple(v)


def _max_members(obj: JsonObject) -> int:
    v = obj.get("max_members")
    if not is_int(v):
        raise ConfigError("max_members", "must be an integer")
    if v > MAX_MEMBERS:  # before anything loops over the partitions
        check_max_members(v)
    return v


def _mappings(obj: JsonObject, adr: dict[str, str]) -> tuple[MemberMapping, ...]:
    if "member_mappings" in obj:
        v = obj["member_mappings"] or []
    else:
        v = obj.get("member-mappings") or []
        if "member-mappings" in obj:
            adr["member-mappings"] = "member_mappings"
    if not isinstance(v, list):
        raise ConfigError("member_mappings", "must be a list")
    return tuple(MemberMapping.from_dict(m) for m in v)


# --------------------------------------------------------------------------------- configs


@dataclass(frozen=True, slots=True)
class StaticConfig:
    """Static consumer group: partition number already the first token of the stream's subjects.

    ``filters`` are subject filters applied after the partition token (empty: everything).
    Either ``members`` (partitions spread automatically) or ``member_mappings``.
    """

    max_members: int
    filters: tuple[str, ...] = ()
    members: tuple[str, ...] = ()
    member_mappings: tuple[MemberMapping, ...] = ()
    _raw: RawJson | None = field(default=None, compare=False, repr=False)

    def validate(self) -> StaticConfig:
        """Return ``self`` if valid; raise ``ConfigError`` naming the field and rule otherwise.

        Rules: reference ``validateStaticConfig`` (max_members >= 1; members xor mappings;
        mappings cover [0, max_members) exactly once with unique member names), plus:
        max_members <= :data:`MAX_MEMBERS`, member names valid and unique, filters valid.
        """
        validate_membership(self.max_members, self.members, self.member_mappings)
        for f in self.filters:
            if err := subject_error(f):
                raise ConfigError("filters", f"filter {f!r} {err}")
        return self

    def _go(self) -> list[GoField]:
        return [
            ("max_members", self.max_members, True, self.max_members),
            ("filters", self.filters, bool(self.filters), list(self.filters)),
            ("members", self.members, bool(self.members), list(self.members)),
            ("member_mappings", self.member_mappings, bool(self.member_mappings),
             [m.to_dict() for m in self.member_mappings]),
        ]

    def to_json(self) -> bytes:
        """Reference JSON bytes (compact, Go field order, empty fields omitted); for a config
        read from JSON, unchanged fields and unknown fields as they were read."""
        return encode_fields(self._go(), self._raw)

    @property
    def unknown_fields(self) -> JsonObject:
        """Fields of the JSON read that the reference v0.2.1 does not have (a newer version's,
        or a typo), ``{"path": value}`` in the order read; kept when the config is written
        back. Nested ones are named like ``"member_mappings[0].weight"``."""
        out = self._raw.unknown() if self._raw else {}
        return {**out, **nested_unknown("member_mappings", self.member_mappings)}

    @classmethod
    def from_json(cls, data: bytes | str) -> StaticConfig:
        """Parse reference JSON (new or ADR field names). Raises ``ConfigError`` on bad shapes
        and on a ``max_members`` above :data:`MAX_MEMBERS`.

        Does not validate the other rules: call :meth:`validate`.
        """
        obj, data = load_object(data)
        adr: dict[str, str] = {}
        max_members = _max_members(obj)
        filters = _str_list(obj, "filters")
        if not filters and isinstance(obj.get("filter"), str) and obj["filter"]:
            filters = (obj["filter"],)
            adr["filter"] = "filters"
        members = _str_list(obj, "members")
        mappings = _mappings(obj, adr)
        parsed = {"max_members": max_members, "filters": filters, "members": members,
                  "member_mappings": mappings}
        present = frozenset(k for k in parsed if k in obj and k not in adr.values())
        return cls(max_members, filters, members, mappings,
                   RawJson(obj, parsed, present, adr, data))

    def is_member(self, name: str) -> bool:
        """True if ``name`` is in ``members`` or has a mapping."""
        return name in self.members or any(m.member == name for m in self.member_mappings)


@dataclass(frozen=True, slots=True)
class ElasticConfig:
    """Elastic consumer group: partitions computed by the work-queue stream's subject transform.

    Only ``members`` / ``member_mappings`` may change after creation. ``max_buffered_msgs`` and
    ``max_buffered_bytes`` bound the work-queue stream (0 = unlimited).
    """

    max_members: int
    partitioning_filters: tuple[PartitioningFilter, ...] = ()
    max_buffered_msgs: int = 0
    max_buffered_bytes: int = 0
    members: tuple[str, ...] = ()
    member_mappings: tuple[MemberMapping, ...] = ()
    _raw: RawJson | None = field(default=None, compare=False, repr=False)

    def validate(self) -> ElasticConfig:
        """Return ``self`` if valid; raise ``ConfigError`` naming the field and rule otherwise.

        Rules (reference ``validateConfig``): max_members >= 1; each filter non-empty and a valid
        subject filter; a filter with no ``*`` must end in ``>``; no more partitioning wildcards
        than ``*``s; indexes unique and within [1, number of ``*``]; members xor mappings;
        mappings cover [0, max_members) exactly once with unique member names. Added here:
        max_members <= :data:`MAX_MEMBERS`; member names valid and unique.
        """
        validate_membership(self.max_members, self.members, self.member_mappings)
        if self.max_buffered_msgs < 0:
            raise ConfigError("max_buffered_msg", "must be >= 0")
        if self.max_buffered_bytes < 0:
            raise ConfigError("max_buffered_bytes", "must be >= 0")
        for pf in self.partitioning_filters:
            if not pf.filter:
                raise ConfigError("partitioning_filters", "a filter must not be empty")
            if err := subject_error(pf.filter):
                raise ConfigError("partitioning_filters", f"filter {pf.filter!r} {err}")
            tokens = pf.filter.split(".")
            stars = tokens.count("*")
            if stars == 0 and tokens[-1] != ">":
                raise ConfigError(
                    "partitioning_filters",
                    f"filter {pf.filter!r} must have at least one '*' wildcard or end with '>'",
                )
            if len(pf.partitioning_wildcards) > stars:
                raise ConfigError(
                    "partitioning_filters",
                    f"filter {pf.filter!r} has {stars} '*' wildcards but "
                    f"{len(pf.partitioning_wildcards)} partitioning wildcards",
                )
            if len(set(pf.partitioning_wildcards)) != len(pf.partitioning_wildcards):
                raise ConfigError(
                    "partitioning_filters",
                    f"partitioning wildcard indexes of {pf.filter!r} must be unique",
                )
            for w in pf.partitioning_wildcards:
                if w < 1 or w > stars:
                    raise ConfigError(
                        "partitioning_filters",
                        f"partitioning wildcard index {w} of {pf.filter!r} must be between 1 "
                        f"and {stars}",
                    )
        return self

    def _go(self) -> list[GoField]:
        return [
            ("max_members", self.max_members, True, self.max_members),
            ("partitioning_filters", self.partitioning_filters, True,
             [p.to_dict() for p in self.partitioning_filters] or None),
            ("max_buffered_msg", self.max_buffered_msgs, bool(self.max_buffered_msgs),
             self.max_buffered_msgs),
            ("max_buffered_bytes", self.max_buffered_bytes, bool(self.max_buffered_bytes),
             self.max_buffered_bytes),
            ("members", self.members, bool(self.members), list(self.members)),
            ("member_mappings", self.member_mappings, bool(self.member_mappings),
             [m.to_dict() for m in self.member_mappings]),
        ]

    def to_json(self) -> bytes:
        """Reference JSON bytes (compact, Go field order; ``partitioning_filters`` null if none
        were given); for a config read from JSON, unchanged fields and unknown fields as they
        were read."""
        return encode_fields(self._go(), self._raw)

    @property
    def unknown_fields(self) -> JsonObject:
        """Fields of the JSON read that the reference v0.2.1 does not have (a newer version's,
        or a typo), ``{"path": value}`` in the order read; kept when the config is written
        back. Nested ones are named like ``"partitioning_filters[0].hash"``."""
        out = self._raw.unknown() if self._raw else {}
        return {**out, **nested_unknown("partitioning_filters", self.partitioning_filters),
                **nested_unknown("member_mappings", self.member_mappings)}

    @classmethod
    def from_json(cls, data: bytes | str) -> ElasticConfig:
        """Parse reference JSON (new or ADR field names). Raises ``ConfigError`` on bad shapes
        and on a ``max_members`` above :data:`MAX_MEMBERS`.

        Does not validate the other rules: call :meth:`validate`.
        """
        obj, data = load_object(data)
        adr: dict[str, str] = {}
        max_members = _max_members(obj)
        raw = obj.get("partitioning_filters")
        if raw is None and isinstance(obj.get("filter"), str):
            # ADR form: one filter at the top level (read, then written with the code's names).
            raw = [{"filter": obj["filter"]}]
            adr["filter"] = "partitioning_filters"
            if "partitioning-wildcards" in obj:
                raw[0]["partitioning_wildcards"] = obj["partitioning-wildcards"]
                adr["partitioning-wildcards"] = "partitioning_filters"
        if raw is not None and not isinstance(raw, list):
            raise ConfigError("partitioning_filters", "must be a list")
        pfs = tuple(PartitioningFilter.from_dict(p) for p in raw or [])
        if adr.get("filter"):
            pfs = tuple(PartitioningFilter(p.filter, p.partitioning_wildcards) for p in pfs)
        for i, p in enumerate(pfs):
            if p._raw is not None and p._raw.adr:  # written with the code's names
                adr[f"partitioning_filters[{i}]"] = "partitioning_filters"
        if "max_buffered_msg" in obj:
            msgs = obj["max_buffered_msg"] or 0
        else:
            msgs = obj.get("msg-buffer-size") or 0
            if "msg-buffer-size" in obj:
                adr["msg-buffer-size"] = "max_buffered_msg"
        nbytes = obj.get("max_buffered_bytes", 0) or 0
        if not is_int(msgs):
            raise ConfigError("max_buffered_msg", "must be an integer")
        if not is_int(nbytes):
            raise ConfigError("max_buffered_bytes", "must be an integer")
        members = _str_list(obj, "members")
        mappings = _mappings(obj, adr)
        parsed = {"max_members": max_members, "partitioning_filters": pfs,
                  "max_buffered_msg": msgs, "max_buffered_bytes": nbytes, "members": members,
                  "member_mappings": mappings}
        present = frozenset(k for k in parsed if k in obj and k not in adr.values())
        return cls(max_members, pfs, msgs, nbytes, members, mappings,
                   RawJson(obj, parsed, present, adr, data))

    def is_member(self, name: str) -> bool:
        """True if ``name`` is in ``members`` or has a mapping."""
        return name in self.members or any(m.member == name for m in self.member_mappings)

    def consumer_filters(self) -> tuple[str, ...]:
        """The filters consumers append after ``<p>.`` (``(">",)`` when there are none).

        With ``member_mappings`` the reference ignores them and uses ``">"``: see
        :func:`cg_pipelines.core.assignment.generate_partition_filters`.
        """
        return tuple(p.filter for p in self.partitioning_filters) or (">",)

    def same_shape(self, other: ElasticConfig) -> bool:
        """True if everything but the membership is equal (what may never change)."""
        return (self.max_members, self.partitioning_filters, self.max_buffered_msgs,
                self.max_buffered_bytes) == (other.max_members, other.partitioning_filters,
                                             other.max_buffered_msgs, other.max_buffered_bytes)

    def shape_changes(self, new: ElasticConfig) -> list[tuple[str, str, str]]:
        """What differs from ``new`` outside the membership, as ``(field, old, new)`` with the
        reference JSON field names and compact JSON values, e.g.
        ``[("max_members", "4", "3")]``; empty when :meth:`same_shape`."""
        def shown(pfs: tuple[PartitioningFilter, ...]) -> list[JsonObject]:
            return [{"filter": p.filter, "partitioning_wildcards": list(p.partitioning_wildcards)}
                    for p in pfs]

        pairs = [
            ("max_members", self.max_members, new.max_members),
            ("partitioning_filters", shown(self.partitioning_filters),
             shown(new.partitioning_filters)),
            ("max_buffered_msg", self.max_buffered_msgs, new.max_buffered_msgs),
            ("max_buffered_bytes", self.max_buffered_bytes, new.max_buffered_bytes),
        ]
        sep = (",", ":")
        return [(f, json.dumps(a, separators=sep), json.dumps(b, separators=sep))
                for f, a, b in pairs if a != b]


_Config = TypeVar("_Config", StaticConfig, ElasticConfig)


def equivalent(a: StaticConfig | ElasticConfig, b: StaticConfig | ElasticConfig) -> bool:
    """True if ``a`` and ``b`` are equal but for the order of ``members``, of
    ``member_mappings`` and of the partitions within a mapping: every member gets the same
    partitions (the reference sorts members before assigning), so writing one over the other
    would only make reference members rebuild their consumers for nothing."""
    if type(a) is not type(b):
        return False

    def norm(c: StaticConfig | ElasticConfig) -> StaticConfig | ElasticConfig:
        return replace(c, members=tuple(sorted(c.members)), member_mappings=tuple(sorted(
            (MemberMapping(m.member, tuple(sorted(m.partitions))) for m in c.member_mappings),
            key=lambda m: (m.member, m.partitions))))

    return bool(norm(a) == norm(b))


def with_members(cfg: _Config, members: Iterable[str]) -> _Config:
    """Copy of ``cfg`` with ``members`` set sorted and de-duplicated and mappings cleared."""
    return replace(cfg, members=tuple(sorted(set(members))), member_mappings=())


def with_mappings(cfg: _Config, mappings: Iterable[MemberMapping]) -> _Config:
    """Copy of ``cfg`` with ``member_mappings`` set (sorted by member) and members cleared."""
    ordered = tuple(sorted(mappings, key=lambda m: m.member))
    return replace(cfg, members=(), member_mappings=ordered)
