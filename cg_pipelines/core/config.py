"""Consumer-group configurations and their JSON codec, byte-compatible with the reference.

The JSON is what synadia-io/orbit.go ``pcgroups`` (v0.2.1) stores in the KV buckets
``static-consumer-groups`` and ``elastic-consumer-groups`` under the key ``<stream>.<group>``:
compact, fields in Go struct order, with Go's ``encoding/json`` escaping of ``<``, ``>``, ``&``
(``\\u003c``, ``\\u003e``, ``\\u0026``). Static: ``max_members``, ``filters`` (omitted when empty),
``members`` (omitted when empty), ``member_mappings`` (omitted when empty). Elastic:
``max_members``, ``partitioning_filters`` (``null`` when absent), ``max_buffered_msg`` and
``max_buffered_bytes`` (omitted when 0), ``members``, ``member_mappings`` (omitted when empty).
The older names of the ADR (seed 000) are read too: ``member-mappings``, ``filter``,
``partitioning-wildcards``, ``msg-buffer-size``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from cg_pipelines.core.errors import ConfigError
from cg_pipelines.core.subjects import name_error, subject_error

STATIC_BUCKET = "static-consumer-groups"
ELASTIC_BUCKET = "elastic-consumer-groups"


def config_key(stream: str, group: str) -> str:
    """KV key of a group's config: ``"<stream>.<group>"``."""
    return f"{stream}.{group}"


def work_queue_stream_name(stream: str, group: str) -> str:
    """Name of an elastic group's work-queue stream: ``"<stream>-<group>"``."""
    return f"{stream}-{group}"


def go_json(obj: Any) -> bytes:
    """Compact JSON exactly as Go's ``json.Marshal`` writes it (HTML characters escaped)."""
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    for ch, esc in (("&", "\\u0026"), ("<", "\\u003c"), (">", "\\u003e"),
                    ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(ch, esc)
    return text.encode()


@dataclass(frozen=True, slots=True)
class MemberMapping:
    """One member's explicitly assigned partitions (``{"member": str, "partitions": [int]}``)."""

    member: str
    partitions: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"member": self.member, "partitions": list(self.partitions)}

    @classmethod
    def from_dict(cls, d: Any) -> MemberMapping:
        if not isinstance(d, dict):
            raise ConfigError("member_mappings", "each mapping must be an object")
        member = d.get("member")
        parts = d.get("partitions") or []
        if not isinstance(member, str):
            raise ConfigError("member_mappings", "mapping 'member' must be a string")
        if not isinstance(parts, list) or not all(_is_int(p) for p in parts):
            raise ConfigError("member_mappings", f"partitions of {member!r} must be integers")
        return cls(member, tuple(parts))


@dataclass(frozen=True, slots=True)
class PartitioningFilter:
    """An elastic group's subject filter and the 1-based ``*`` indexes hashed into the key.

    ``PartitioningFilter("flights.*.*", (2,))`` partitions ``flights.<carrier>.<tailnum>`` on the
    tail number. No wildcards means the whole subject is hashed.
    """

    filter: str
    partitioning_wildcards: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"filter": self.filter, "partitioning_wildcards": list(self.partitioning_wildcards)}

    @classmethod
    def from_dict(cls, d: Any) -> PartitioningFilter:
        if not isinstance(d, dict):
            raise ConfigError("partitioning_filters", "each partitioning filter must be an object")
        flt = d.get("filter")
        wcs = d.get("partitioning_wildcards", d.get("partitioning-wildcards")) or []
        if not isinstance(flt, str):
            raise ConfigError("partitioning_filters", "'filter' must be a string")
        if not isinstance(wcs, list) or not all(_is_int(w) for w in wcs):
            raise ConfigError("partitioning_filters", "'partitioning_wildcards' must be integers")
        return cls(flt, tuple(wcs))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _load(data: bytes | str) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError("config", f"not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ConfigError("config", "must be a JSON object")
    return obj


def _str_list(obj: dict[str, Any], key: str) -> tuple[str, ...]:
    v = obj.get(key) or []
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise ConfigError(key, "must be a list of strings")
    return tuple(v)


def _max_members(obj: dict[str, Any]) -> int:
    v = obj.get("max_members")
    if not _is_int(v):
        raise ConfigError("max_members", "must be an integer")
    return v


def _mappings(obj: dict[str, Any]) -> tuple[MemberMapping, ...]:
    v = obj.get("member_mappings", obj.get("member-mappings")) or []
    if not isinstance(v, list):
        raise ConfigError("member_mappings", "must be a list")
    return tuple(MemberMapping.from_dict(m) for m in v)


def _validate_membership(
    max_members: int, members: Sequence[str], mappings: Sequence[MemberMapping]
) -> None:
    """Membership rules shared by both kinds (reference ``validateConfig``, plus name checks)."""
    if max_members < 1:
        raise ConfigError("max_members", f"must be >= 1, got {max_members}")
    if members and mappings:
        raise ConfigError("members", "either members or member_mappings may be set, not both")
    for m in members:
        if err := name_error(m):
            raise ConfigError("members", f"member name {m!r} {err}")
    if not mappings:
        return
    if len(mappings) > max_members:
        raise ConfigError(
            "member_mappings",
            f"the number of mappings ({len(mappings)}) must be between 1 and max_members "
            f"({max_members})",
        )
    seen_members: set[str] = set()
    seen_parts: set[int] = set()
    for mm in mappings:
        if err := name_error(mm.member):
            raise ConfigError("member_mappings", f"member name {mm.member!r} {err}")
        if mm.member in seen_members:
            raise ConfigError("member_mappings", f"member {mm.member!r} is mapped twice")
        seen_members.add(mm.member)
        for p in mm.partitions:
            if p < 0 or p >= max_members:
                raise ConfigError(
                    "member_mappings",
                    f"partition {p} of {mm.member!r} is outside [0, {max_members})",
                )
            if p in seen_parts:
                raise ConfigError("member_mappings", f"partition {p} is mapped more than once")
            seen_parts.add(p)
    missing = sorted(set(range(max_members)) - seen_parts)
    if missing:
        raise ConfigError(
            "member_mappings",
            f"every partition in [0, {max_members}) must be mapped; missing {missing}",
        )


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

    def validate(self) -> StaticConfig:
        """Return ``self`` if valid; raise ``ConfigError`` naming the field and rule otherwise."""
        _validate_membership(self.max_members, self.members, self.member_mappings)
        for f in self.filters:
            if err := subject_error(f):
                raise ConfigError("filters", f"filter {f!r} {err}")
        return self

    def to_json(self) -> bytes:
        """Reference JSON bytes (compact, Go field order, empty fields omitted)."""
        d: dict[str, Any] = {"max_members": self.max_members}
        if self.filters:
            d["filters"] = list(self.filters)
        if self.members:
            d["members"] = list(self.members)
        if self.member_mappings:
            d["member_mappings"] = [m.to_dict() for m in self.member_mappings]
        return go_json(d)

    @classmethod
    def from_json(cls, data: bytes | str) -> StaticConfig:
        """Parse reference JSON (new or ADR field names). Raises ``ConfigError`` on bad shapes.

        Does not validate the rules: call :meth:`validate`.
        """
        obj = _load(data)
        filters = _str_list(obj, "filters")
        if not filters and isinstance(obj.get("filter"), str) and obj["filter"]:
            filters = (obj["filter"],)
        return cls(_max_members(obj), filters, _str_list(obj, "members"), _mappings(obj))

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

    def validate(self) -> ElasticConfig:
        """Return ``self`` if valid; raise ``ConfigError`` naming the field and rule otherwise.

        Rules (reference ``validateConfig``): max_members >= 1; each filter non-empty and a valid
        subject filter; a filter with no ``*`` must end in ``>``; no more partitioning wildcards
        than ``*``s; indexes unique and within [1, number of ``*``]; members xor mappings;
        mappings cover [0, max_members) exactly once with unique member names.
        """
        _validate_membership(self.max_members, self.members, self.member_mappings)
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

    def to_json(self) -> bytes:
        """Reference JSON bytes (compact, Go field order; ``partitioning_filters`` null if none)."""
        d: dict[str, Any] = {
            "max_members": self.max_members,
            "partitioning_filters": [p.to_dict() for p in self.partitioning_filters] or None,
        }
        if self.max_buffered_msgs:
            d["max_buffered_msg"] = self.max_buffered_msgs
        if self.max_buffered_bytes:
            d["max_buffered_bytes"] = self.max_buffered_bytes
        if self.members:
            d["members"] = list(self.members)
        if self.member_mappings:
            d["member_mappings"] = [m.to_dict() for m in self.member_mappings]
        return go_json(d)

    @classmethod
    def from_json(cls, data: bytes | str) -> ElasticConfig:
        """Parse reference JSON (new or ADR field names). Raises ``ConfigError`` on bad shapes.

        Does not validate the rules: call :meth:`validate`.
        """
        obj = _load(data)
        raw = obj.get("partitioning_filters")
        if raw is None and isinstance(obj.get("filter"), str):
            raw = [{"filter": obj["filter"],
                    "partitioning_wildcards": obj.get("partitioning-wildcards") or []}]
        if raw is not None and not isinstance(raw, list):
            raise ConfigError("partitioning_filters", "must be a list")
        pfs = tuple(PartitioningFilter.from_dict(p) for p in raw or [])
        msgs = obj.get("max_buffered_msg", obj.get("msg-buffer-size", 0)) or 0
        nbytes = obj.get("max_buffered_bytes", 0) or 0
        if not _is_int(msgs):
            raise ConfigError("max_buffered_msg", "must be an integer")
        if not _is_int(nbytes):
            raise ConfigError("max_buffered_bytes", "must be an integer")
        return cls(_max_members(obj), pfs, msgs, nbytes, _str_list(obj, "members"), _mappings(obj))

    def is_member(self, name: str) -> bool:
        """True if ``name`` is in ``members`` or has a mapping."""
        return name in self.members or any(m.member == name for m in self.member_mappings)

    def consumer_filters(self) -> tuple[str, ...]:
        """The filters consumers append after ``<p>.`` (``(">",)`` when there are none)."""
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
        pairs = [
            ("max_members", self.max_members, new.max_members),
            ("partitioning_filters", [p.to_dict() for p in self.partitioning_filters],
             [p.to_dict() for p in new.partitioning_filters]),
            ("max_buffered_msg", self.max_buffered_msgs, new.max_buffered_msgs),
            ("max_buffered_bytes", self.max_buffered_bytes, new.max_buffered_bytes),
        ]
        sep = (",", ":")
        return [(f, json.dumps(a, separators=sep), json.dumps(b, separators=sep))
                for f, a, b in pairs if a != b]


def with_members(cfg: StaticConfig | ElasticConfig, members: Iterable[str]) -> Any:
    """Copy of ``cfg`` with ``members`` set sorted and de-duplicated and mappings cleared."""
    return replace(cfg, members=tuple(sorted(set(members))), member_mappings=())


def with_mappings(cfg: StaticConfig | ElasticConfig, mappings: Iterable[MemberMapping]) -> Any:
    """Copy of ``cfg`` with ``member_mappings`` set (sorted by member) and members cleared."""
    ordered = tuple(sorted(mappings, key=lambda m: m.member))
    return replace(cfg, members=(), member_mappings=ordered)


def parse_mapping(text: str) -> MemberMapping:
    """Parse the CLI mapping syntax ``"member:0,1,2"`` (ranges ``"member:0-3"`` allowed).

    Raises ``ConfigError`` (field ``member_mappings``) naming what is wrong.
    """
    member, sep, parts = text.partition(":")
    if not sep or not member or not parts:
        raise ConfigError("member_mappings", f"mapping {text!r} must look like 'member:0,1,2'")
    out: list[int] = []
    for item in parts.split(","):
        lo, dash, hi = item.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise ConfigError(
                "member_mappings", f"mapping {text!r}: {item!r} is not a partition number"
            ) from None
        if last < first:
            raise ConfigError("member_mappings", f"mapping {text!r}: range {item!r} is reversed")
        out.extend(range(first, last + 1))
    return MemberMapping(member, tuple(out))
