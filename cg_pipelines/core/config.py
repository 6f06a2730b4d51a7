"""Consumer-group configurations and their JSON codec, byte-compatible with the reference.

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
did not change, the exact JSON that was read (``null`` stays ``null``, ``[]`` stays ``[]``, an
absent field stays absent, members stay in their order), keeps unknown fields (a newer reference
version's, or a typo) in their place, and writes only the changed fields anew, in Go struct
order; a config written back unchanged gives the bytes that were read. This matters because the
reference's watcher compares configs with ``reflect.DeepEqual``, where a nil slice differs from
an empty one: rewriting ``"partitioning_wildcards":null`` as ``[]`` stops every running Go
member. Unknown fields are listed by ``unknown_fields``.

A config built in Python (no JSON read) is written as Go's ``json.Marshal`` writes the
reference struct built with Go's zero values: an empty ``partitioning_filters``,
``partitioning_wildcards`` or ``partitions`` is a nil slice, ``null`` (what the Go API writes for
``PartitioningFilter{Filter: f}``; the Go ``cg`` tool cannot create a filter without wildcards:
an empty answer to its wildcard prompt fails ``strconv.Atoi`` and leaves index 0, which
``validateConfig`` rejects).

The older names of the ADR (seed 000) are read too: ``member-mappings``, ``filter``,
``partitioning-wildcards``, ``msg-buffer-size``; a config read through them is written with the
code's names.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from cg_pipelines.core.errors import ConfigError
from cg_pipelines.core.subjects import name_error, subject_error

STATIC_BUCKET = "static-consumer-groups"
ELASTIC_BUCKET = "elastic-consumer-groups"

MAX_MEMBERS = 4096
"""Upper bound of ``max_members`` (the number of partitions), checked when a config is read and
before one is written, before any assignment is computed.

Source: a member holding every partition (a group's first member always does) gets a consumer
with one filter subject per partition, and nats-server checks a consumer's filters pairwise for
overlap when the consumer is created (``checkConsumerCfg`` in server/consumer.go, "Check subject
filters do not overlap": O(N²)). Measured on nats-server 2.15.1 (loopback, 2 cores): 1024
filters 0.1 s, 4096 filters 1.05 s, 10,000 filters 8.3 s, 20,000 filters 28 s. 4096 keeps that
creation well inside the 5 s JetStream API timeout that applies to the reference's members (they
create consumers with ``context.Background()``, so nats.go's ``defaultAPITimeout``, 5 s, in
jetstream/jetstream.go) and to this library's (5 s default), on slower machines too. The
create request (about 10 bytes per filter plus the filter's length: 4096 filters of 200 bytes
make about 860 KB) also fits the server's default 1 MiB ``max_payload``, and a mapping covering
every partition is about 20 KB of KV value. The other limits are much higher and do not
bind: the reference stores ``max_members`` as a Go ``uint`` (its JSON decoding rejects values of
2**64 and more), and the server parses ``{{Partition(N)}}`` with ``N <= math.MaxInt32``
(server/subject_transform.go, ``indexPlaceHolders``). Without a bound a stored
``max_members`` of 10**8 makes every assignment loop for tens of seconds, 10**30 forever.
"""


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


# ------------------------------------------------------------------------ what was read (raw)


@dataclass(frozen=True, slots=True, eq=False)
class _Raw:
    """A JSON object as read, kept by the config parsed from it so writing it back keeps what
    did not change.

    ``obj``: the object (key order kept). ``parsed``: each code field's typed value as read.
    ``present``: the code fields whose value was read under the code's name (their JSON is
    written back as it was while the value is unchanged). ``adr``: ADR keys that were read,
    with the code field they fed. ``data``: the bytes read (top level only).
    """

    obj: dict[str, Any]
    parsed: dict[str, Any]
    present: frozenset[str]
    adr: dict[str, str]
    data: bytes | None = None

    def unknown(self) -> dict[str, Any]:
        """Keys that are neither the code's fields nor ADR names that were used."""
        return {k: v for k, v in self.obj.items()
                if k not in self.parsed and k not in self.adr}


# One Go struct field of a config as it is now: (JSON name, typed value, written when built
# from scratch (omitempty), its JSON value when built from scratch).
_GoField = tuple[str, Any, bool, Any]


def _unchanged(go: Sequence[_GoField], raw: _Raw) -> bool:
    return all(name in raw.parsed and raw.parsed[name] == value for name, value, _, _ in go)


def _merge(go: Sequence[_GoField], raw: _Raw | None) -> dict[str, Any]:
    """The JSON object to write: the Go fields (``go``, in struct order) merged into what was
    read (``raw``).

    A field whose value is unchanged keeps its JSON as read (or stays absent if it was absent);
    a changed field, or one read through an ADR name, is written as Go would. Unknown keys keep
    their place; a field not in ``raw`` goes right after the nearest preceding Go field.
    """
    if raw is None:
        return {name: js for name, _, emit, js in go if emit}
    chosen: dict[str, tuple[bool, Any]] = {}
    for name, value, emit, js in go:
        if name in raw.parsed and raw.parsed[name] == value:
            if name in raw.present:
                chosen[name] = (True, raw.obj[name])
            elif name in raw.adr.values():
                chosen[name] = (emit, js)
            else:
                chosen[name] = (False, None)  # absent as read
        else:
            chosen[name] = (emit, js)
    order: list[tuple[bool, str]] = []  # (is a Go field, key)
    placed: set[str] = set()
    for key in raw.obj:
        name = key if key in chosen else raw.adr.get(key)
        if name is None:
            order.append((False, key))
        elif name not in placed:
            order.append((True, name))
            placed.add(name)
    names = [name for name, _, _, _ in go]
    for i, name in enumerate(names):
        if name in placed:
            continue
        pos = 0
        for prev in reversed(names[:i]):
            if prev in placed:
                pos = order.index((True, prev)) + 1
                break
        order.insert(pos, (True, name))
        placed.add(name)
    out: dict[str, Any] = {}
    for is_field, key in order:
        if not is_field:
            out[key] = raw.obj[key]
        elif chosen[key][0]:
            out[key] = chosen[key][1]
    return out


def _encode(go: Sequence[_GoField], raw: _Raw | None) -> bytes:
    if raw is not None and raw.data is not None and not raw.adr and _unchanged(go, raw):
        return raw.data
    return go_json(_merge(go, raw))


def _nested_unknown(prefix: str, items: Sequence[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, item in enumerate(items):
        for k, v in item.unknown_fields.items():
            out[f"{prefix}[{i}].{k}"] = v
    return out


# ----------------------------------------------------------------------------- the parts


@dataclass(frozen=True, slots=True)
class MemberMapping:
    """One member's explicitly assigned partitions (``{"member": str, "partitions": [int]}``)."""

    member: str
    partitions: tuple[int, ...]
    _raw: _Raw | None = field(default=None, compare=False, repr=False)

    def _go(self) -> list[_GoField]:
        return [("member", self.member, True, self.member),
                ("partitions", self.partitions, True, list(self.partitions) or None)]

    def to_dict(self) -> dict[str, Any]:
        """The JSON object (what was read kept for unchanged fields, see the module doc)."""
        return _merge(self._go(), self._raw)

    @property
    def unknown_fields(self) -> dict[str, Any]:
        """Fields of the JSON read that the reference v0.2.1 does not have."""
        return self._raw.unknown() if self._raw else {}

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
        parsed = {"member": member, "partitions": tuple(parts)}
        raw = _Raw(d, parsed, frozenset(k for k in parsed if k in d), {})
        return cls(member, tuple(parts), raw)


@dataclass(frozen=True, slots=True)
class PartitioningFilter:
    """An elastic group's subject filter and the 1-based ``*`` indexes hashed into the key.

    ``PartitioningFilter("flights.*.*", (2,))`` partitions ``flights.<carrier>.<tailnum>`` on the
    tail number. No wildcards means the whole subject is hashed; built here, that is written
    ``"partitioning_wildcards":null`` (Go's nil slice), read from JSON it is written back as it
    was read (``null`` or ``[]``).
    """

    filter: str
    partitioning_wildcards: tuple[int, ...] = ()
    _raw: _Raw | None = field(default=None, compare=False, repr=False)

    def _go(self) -> list[_GoField]:
        return [("filter", self.filter, True, self.filter),
                ("partitioning_wildcards", self.partitioning_wildcards, True,
                 list(self.partitioning_wildcards) or None)]

    def to_dict(self) -> dict[str, Any]:
        """The JSON object (what was read kept for unchanged fields, see the module doc)."""
        return _merge(self._go(), self._raw)

    @property
    def unknown_fields(self) -> dict[str, Any]:
        """Fields of the JSON read that the reference v0.2.1 does not have."""
        return self._raw.unknown() if self._raw else {}

    @classmethod
    def from_dict(cls, d: Any) -> PartitioningFilter:
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
        if not isinstance(wcs, list) or not all(_is_int(w) for w in wcs):
            raise ConfigError("partitioning_filters", "'partitioning_wildcards' must be integers")
        parsed = {"filter": flt, "partitioning_wildcards": tuple(wcs)}
        raw = _Raw(d, parsed, frozenset(k for k in parsed if k in d), adr)
        return cls(flt, tuple(wcs), raw)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _no_constant(name: str) -> Any:
    # Python's json reads NaN/Infinity; Go's encoding/json (the reference) rejects them.
    raise ValueError(f"{name} is not JSON")


def _load(data: bytes | str) -> tuple[dict[str, Any], bytes]:
    raw = data.encode() if isinstance(data, str) else bytes(data)
    try:
        obj = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ConfigError("config", f"not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ConfigError("config", "must be a JSON object")
    return obj, raw


def _str_list(obj: dict[str, Any], key: str) -> tuple[str, ...]:
    v = obj.get(key) or []
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise ConfigError(key, "must be a list of strings")
    return tuple(v)


def _shown(n: int) -> str:
    s = str(n)
    return s if len(s) <= 24 else f"{s[:12]}...({len(s)} digits)"


def check_max_members(v: int) -> None:
    """The ``max_members`` rules: in [1, MAX_MEMBERS] (see :data:`MAX_MEMBERS`). Raises
    ``ConfigError`` naming the field and the rule."""
    if v < 1:
        raise ConfigError("max_members", f"must be >= 1, got {_shown(v)}")
    if v > MAX_MEMBERS:
        raise ConfigError(
            "max_members",
            f"must be <= {MAX_MEMBERS}, got {_shown(v)} (cg_pipelines' limit: a member holding "
            "every partition gets one consumer filter per partition, which nats-server checks "
            "pairwise when it creates the consumer)")


def _max_members(obj: dict[str, Any]) -> int:
    v = obj.get("max_members")
    if not _is_int(v):
        raise ConfigError("max_members", "must be an integer")
    if v > MAX_MEMBERS:  # before anything loops over the partitions
        check_max_members(v)
    return v


def _mappings(obj: dict[str, Any], adr: dict[str, str]) -> tuple[MemberMapping, ...]:
    if "member_mappings" in obj:
        v = obj["member_mappings"] or []
    else:
        v = obj.get("member-mappings") or []
        if "member-mappings" in obj:
            adr["member-mappings"] = "member_mappings"
    if not isinstance(v, list):
        raise ConfigError("member_mappings", "must be a list")
    return tuple(MemberMapping.from_dict(m) for m in v)


def _validate_membership(
    max_members: int, members: Sequence[str], mappings: Sequence[MemberMapping]
) -> None:
    """Membership rules shared by both kinds (reference ``validateConfig``, plus name checks,
    the :data:`MAX_MEMBERS` bound and unique member names)."""
    check_max_members(max_members)
    if members and mappings:
        raise ConfigError("members", "either members or member_mappings may be set, not both")
    seen_names: set[str] = set()
    for m in members:
        if err := name_error(m):
            raise ConfigError("members", f"member name {m!r} {err}")
        if m in seen_names:
            raise ConfigError("members", f"member {m!r} is listed more than once")
        seen_names.add(m)
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
                    f"partition {_shown(p)} of {mm.member!r} is outside [0, {max_members})",
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
    _raw: _Raw | None = field(default=None, compare=False, repr=False)

    def validate(self) -> StaticConfig:
        """Return ``self`` if valid; raise ``ConfigError`` naming the field and rule otherwise.

        Rules: reference ``validateStaticConfig`` (max_members >= 1; members xor mappings;
        mappings cover [0, max_members) exactly once with unique member names), plus:
        max_members <= :data:`MAX_MEMBERS`, member names valid and unique, filters valid.
        """
        _validate_membership(self.max_members, self.members, self.member_mappings)
        for f in self.filters:
            if err := subject_error(f):
                raise ConfigError("filters", f"filter {f!r} {err}")
        return self

    def _go(self) -> list[_GoField]:
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
        return _encode(self._go(), self._raw)

    @property
    def unknown_fields(self) -> dict[str, Any]:
        """Fields of the JSON read that the reference v0.2.1 does not have (a newer version's,
        or a typo), ``{"path": value}`` in the order read; kept when the config is written
        back. Nested ones are named like ``"member_mappings[0].weight"``."""
        out = self._raw.unknown() if self._raw else {}
        return {**out, **_nested_unknown("member_mappings", self.member_mappings)}

    @classmethod
    def from_json(cls, data: bytes | str) -> StaticConfig:
        """Parse reference JSON (new or ADR field names). Raises ``ConfigError`` on bad shapes
        and on a ``max_members`` above :data:`MAX_MEMBERS`.

        Does not validate the other rules: call :meth:`validate`.
        """
        obj, data = _load(data)
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
        return cls(max_members, filters, members, mappings, _Raw(obj, parsed, present, adr, data))

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
    _raw: _Raw | None = field(default=None, compare=False, repr=False)

    def validate(self) -> ElasticConfig:
        """Return ``self`` if valid; raise ``ConfigError`` naming the field and rule otherwise.

        Rules (reference ``validateConfig``): max_members >= 1; each filter non-empty and a valid
        subject filter; a filter with no ``*`` must end in ``>``; no more partitioning wildcards
        than ``*``s; indexes unique and within [1, number of ``*``]; members xor mappings;
        mappings cover [0, max_members) exactly once with unique member names. Added here:
        max_members <= :data:`MAX_MEMBERS`; member names valid and unique.
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

    def _go(self) -> list[_GoField]:
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
        return _encode(self._go(), self._raw)

    @property
    def unknown_fields(self) -> dict[str, Any]:
        """Fields of the JSON read that the reference v0.2.1 does not have (a newer version's,
        or a typo), ``{"path": value}`` in the order read; kept when the config is written
        back. Nested ones are named like ``"partitioning_filters[0].hash"``."""
        out = self._raw.unknown() if self._raw else {}
        return {**out, **_nested_unknown("partitioning_filters", self.partitioning_filters),
                **_nested_unknown("member_mappings", self.member_mappings)}

    @classmethod
    def from_json(cls, data: bytes | str) -> ElasticConfig:
        """Parse reference JSON (new or ADR field names). Raises ``ConfigError`` on bad shapes
        and on a ``max_members`` above :data:`MAX_MEMBERS`.

        Does not validate the other rules: call :meth:`validate`.
        """
        obj, data = _load(data)
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
        if not _is_int(msgs):
            raise ConfigError("max_buffered_msg", "must be an integer")
        if not _is_int(nbytes):
            raise ConfigError("max_buffered_bytes", "must be an integer")
        members = _str_list(obj, "members")
        mappings = _mappings(obj, adr)
        parsed = {"max_members": max_members, "partitioning_filters": pfs,
                  "max_buffered_msg": msgs, "max_buffered_bytes": nbytes, "members": members,
                  "member_mappings": mappings}
        present = frozenset(k for k in parsed if k in obj and k not in adr.values())
        return cls(max_members, pfs, msgs, nbytes, members, mappings,
                   _Raw(obj, parsed, present, adr, data))

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
        def shown(pfs: tuple[PartitioningFilter, ...]) -> list[dict[str, Any]]:
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


def equivalent(a: StaticConfig | ElasticConfig, b: StaticConfig | ElasticConfig) -> bool:
    """True if ``a`` and ``b`` are equal but for the order of ``members``, of
    ``member_mappings`` and of the partitions within a mapping: every member gets the same
    partitions (the reference sorts members before assigning), so writing one over the other
    would only make reference members rebuild their consumers for nothing."""
    if type(a) is not type(b):
        return False

    def norm(c: Any) -> Any:
        return replace(c, members=tuple(sorted(c.members)), member_mappings=tuple(sorted(
            (MemberMapping(m.member, tuple(sorted(m.partitions))) for m in c.member_mappings),
            key=lambda m: (m.member, m.partitions))))

    return bool(norm(a) == norm(b))


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
