"""Partition-to-member assignment: the reference algorithm and an optional sticky strategy.

The default is the reference implementation's ``GeneratePartitionFilters`` (synadia-io/orbit.go
``pcgroups`` v0.2.1; "Partition to member distribution" in the NATS design proposal
"(Partitioned) Consumer Groups for JetStream"): de-duplicate, sort and cap the members to
``max_members``; with ``per = max_members // n``, partition ``i < n * per`` goes to member
``(i // per) % n`` and the remainder round-robin. Every member computes its own filters from the
config alone, so the default must stay exactly the reference's.

The sticky strategy (the minimal-movement idea of Apache Kafka's KIP-315, a sticky assignor)
keeps every partition whose owner is still a member and balances the rest; it is expressed as
``member_mappings`` in the config so reference members still compute the same filters from the
stored JSON.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from cg_pipelines.core.config import (
    ElasticConfig,
    MemberMapping,
    StaticConfig,
    check_max_members,
)
from cg_pipelines.core.errors import UsageError

Assignment = dict[str, list[int]]


def effective_members(members: Iterable[str], max_members: int) -> list[str]:
    """Members as the reference uses them: de-duplicated, sorted, capped to ``max_members``."""
    return sorted(set(members))[:max_members]


def _owner_by_partition(members: Sequence[str], max_members: int) -> list[str]:
    check_max_members(max_members)  # never loop over an unbounded number of partitions
    n = len(members)
    per = max_members // n
    owners = []
    for i in range(max_members):
        if i < n * per:
            owners.append(members[(i // per) % n])
        else:
            owners.append(members[(i - n * per) % n])
    return owners


def member_partitions(
    members: Sequence[str],
    max_members: int,
    member_mappings: Sequence[MemberMapping],
    member_name: str,
) -> list[int]:
    """Partitions of ``member_name`` in the reference's order (ascending for members, mapping
    order for mappings). Empty if the member has none. Raises ``ConfigError`` if
    ``max_members`` is outside [1, MAX_MEMBERS] (nothing loops over an unbounded range)."""
    if members:
        eff = effective_members(members, max_members)
        owners = _owner_by_partition(eff, max_members)
        return [i for i, m in enumerate(owners) if m == member_name]
    out: list[int] = []
    for mm in member_mappings:
        if mm.member == member_name:
            out.extend(mm.partitions)
    return out


def generate_partition_filters(
    members: Sequence[str],
    max_members: int,
    member_mappings: Sequence[MemberMapping],
    member_name: str,
    filters: Sequence[str] = (),
) -> list[str]:
    """Consumer filter subjects for ``member_name``, as the reference computes them.

    With ``members`` (reference ``GeneratePartitionFilters``, members branch, called once per
    filter by ``ElasticGetPartitionFilters`` and ``joinMemberConsumerStatic``):
    ``"<p>.<filter>"`` for each filter (outer) and each of the member's partitions (inner); no
    filters means ``"<p>.>"``.

    With ``member_mappings`` (and no ``members``; the mappings branch of
    ``GeneratePartitionFilters``, synadia-io/orbit.go pcgroups/stream_consumer_group.go
    v0.2.1): ``"<p>.>"`` for each of the member's partitions in mapping order, whatever the
    filters: the reference ignores its ``filter`` argument there. Unlike the reference, which
    writes ``"<p>.>"`` once per filter (duplicates, which nats-server refuses as overlapping
    filters, error 10138), each filter is written once (first kept).
    """
    parts = member_partitions(members, max_members, member_mappings, member_name)
    flts: Sequence[str] = filters or (">",)
    if not members and member_mappings:
        flts = (">",)
    out: list[str] = []
    seen: set[str] = set()
    for flt in flts:
        for p in parts:
            f = f"{p}.{flt}"
            if f not in seen:
                seen.add(f)
                out.append(f)
    return out


def assignment(config: StaticConfig | ElasticConfig) -> Assignment:
    """Every member's partitions under ``config``: ``{member: [partition, ...]}``.

    Members with no partition (beyond the cap) are absent. Keys are sorted.
    """
    if config.members:
        eff = effective_members(config.members, config.max_members)
        out: Assignment = {m: [] for m in eff}
        for i, m in enumerate(_owner_by_partition(eff, config.max_members)):
            out[m].append(i)
        return {m: ps for m, ps in out.items() if ps}
    return {
        mm.member: sorted(mm.partitions)
        for mm in sorted(config.member_mappings, key=lambda m: m.member)
        if mm.partitions
    }


def owners(assign: Mapping[str, Sequence[int]]) -> dict[int, str]:
    """Invert an assignment: ``{partition: member}``."""
    return {p: m for m, ps in assign.items() for p in ps}


def moved_partitions(
    old: Mapping[str, Sequence[int]], new: Mapping[str, Sequence[int]]
) -> dict[int, tuple[str | None, str | None]]:
    """Partitions whose owner differs: ``{partition: (old_owner, new_owner)}``, ``None`` = none."""
    o, n = owners(old), owners(new)
    return {p: (o.get(p), n.get(p)) for p in sorted(set(o) | set(n)) if o.get(p) != n.get(p)}


def sticky_assignment(
    previous: Mapping[str, Sequence[int]], members: Iterable[str], max_members: int
) -> Assignment:
    """Balanced assignment that moves as few partitions as possible from ``previous``.

    Every member of ``effective_members(members, max_members)`` gets ``max_members // n`` or one
    more partition; members that already hold the most keep the larger shares. A member keeps its
    lowest-numbered partitions up to its share; released and unowned partitions go, ascending, to
    members below their share in name order. Deterministic for equal inputs.
    Raises ``UsageError`` if there are no members, ``ConfigError`` (a ``ValueError``) if
    ``max_members`` is outside [1, MAX_MEMBERS].
    """
    check_max_members(max_members)
    eff = effective_members(members, max_members)
    if not eff:
        raise UsageError("a sticky assignment needs at least one member")
    n = len(eff)
    base, extra = divmod(max_members, n)
    kept = {m: sorted(p for p in previous.get(m, ()) if 0 <= p < max_members) for m in eff}
    # The ``extra`` members holding the most partitions (ties: name order) get base + 1.
    by_load = sorted(eff, key=lambda m: (-len(kept[m]), m))
    target = {m: base + (1 if i < extra else 0) for i, m in enumerate(by_load)}
    out: Assignment = {}
    taken: set[int] = set()
    for m in eff:
        mine: list[int] = []
        for p in kept[m]:
            if len(mine) < target[m] and p not in taken:
                mine.append(p)
                taken.add(p)
        out[m] = mine
    pool = [p for p in range(max_members) if p not in taken]
    for m in eff:
        while len(out[m]) < target[m]:
            out[m].append(pool.pop(0))
        out[m].sort()
    return {m: ps for m, ps in out.items() if ps}


def as_mappings(assign: Mapping[str, Sequence[int]]) -> tuple[MemberMapping, ...]:
    """An assignment as ``member_mappings`` (sorted by member, partitions ascending)."""
    return tuple(MemberMapping(m, tuple(sorted(ps))) for m, ps in sorted(assign.items()) if ps)
