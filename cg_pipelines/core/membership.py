"""Membership: who holds a group's partitions, and the rules for it shared by both kinds of
config.

A config lists either ``members`` (the partitions spread over them automatically) or
``member_mappings`` (:class:`MemberMapping`: one member's partitions, given explicitly; the CLI
syntax is :func:`parse_mapping`). :func:`validate_membership` holds the rules (reference
``validateConfig`` plus name checks, unique names and :data:`MAX_MEMBERS`). The configs are in
:mod:`cg_pipelines.core.config`, which re-exports these names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from cg_pipelines.core.errors import ConfigError
from cg_pipelines.core.gojson import GoField, GoObject, RawJson, is_int
from cg_pipelines.core.subjects import name_error

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


@dataclass(frozen=True, slots=True)
class MemberMapping(GoObject):
    """One member's explicitly assigned partitions (``{"member": str, "partitions": [int]}``)."""

    member: str
    partitions: tuple[int, ...]
    _raw: RawJson | None = field(default=None, compare=False, repr=False)

    def _go(self) -> list[GoField]:
        return [("member", self.member, True, self.member),
                ("partitions", self.partitions, True, list(self.partitions) or None)]

    @classmethod
    def from_dict(cls, d: object) -> MemberMapping:
        if not isinstance(d, dict):
            raise ConfigError("member_mappings", "each mapping must be an object")
        member = d.get("member")
        parts = d.get("partitions") or []
        if not isinstance(member, str):
            raise ConfigError("member_mappings", "mapping 'member' must be a string")
        if not isinstance(parts, list) or not all(is_int(p) for p in parts):
            raise ConfigError("member_mappings", f"partitions of {member!r} must be integers")
        parsed = {"member": member, "partitions": tuple(parts)}
        raw = RawJson(d, parsed, frozenset(k for k in parsed if k in d), {})
        return cls(member, tuple(parts), raw)


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


def validate_membership(
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
