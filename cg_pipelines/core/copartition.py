"""Co-partitioned group sets: elastic groups on different streams partitioned on the same key
into the same number of partitions, so partition ``p`` of every group holds the same keys (the
stream-join case of Apache Kafka's KIP-315, "Stream Join Sticky Assignor": "all of the topics
for a given partition must go to the same consumer").

Same partitioning, for NATS subject-token hashing. An elastic group's work-queue stream sources
its origin stream through one subject transform per partitioning filter,
``{{Partition(N,i,j)}}.<filter>``, as the reference implementation creates it
(synadia-io/orbit.go ``pcgroups`` v0.2.1, ``getPartitioningTransformDest``); nats-server's
subject transform hashes the selected wildcard tokens, in the order ``i, j`` lists them,
concatenated without separator, with 32-bit FNV-1a, modulo ``N``
(:func:`cg_pipelines.core.subjects.partition_for`). Two subjects of two groups therefore land in
the same partition number when the groups have the same ``N`` (``max_members``) and the
selected tokens carry the same values in the same order. What can be checked from the configs
alone (:func:`check_copartitioned`): the same ``N``, and every filter of every group selecting
the same number of tokens. A filter selecting none hashes the whole subject, the stream's own
tokens included, so two streams never agree: refused. That the selected tokens mean the same
key (a customer id in both, ordered alike) is the user's declaration; :func:`set_key_tokens`
shows the values a subject contributes.

Membership (:func:`set_assignment`, :func:`set_mappings`): one sticky assignment
(:func:`cg_pipelines.core.assignment.sticky_assignment`) for the whole set, written to every
group as the same ``member_mappings``, so reference members of each group compute the filters of
the same partitions.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cg_pipelines.core.assignment import (
    Assignment,
    as_mappings,
    assignment,
    owners,
    sticky_assignment,
)
from cg_pipelines.core.config import ElasticConfig, MemberMapping
from cg_pipelines.core.errors import ConfigError
from cg_pipelines.core.partitioning import SubjectPartitioner, subject_matches
from cg_pipelines.core.subjects import wildcard_positions

__all__ = [
    "CoPartitionError",
    "SetGroup",
    "check_copartitioned",
    "previous_set_assignment",
    "same_partition",
    "set_assignment",
    "set_key_tokens",
    "set_mappings",
]


@dataclass(frozen=True)
class SetGroup:
    """One elastic group of a co-partitioned set: its origin stream, name and config."""

    stream: str
    group: str
    config: ElasticConfig

    @property
    def name(self) -> str:
        """``"<stream>/<group>"``, as errors and the CLI name the group."""
        return f"{self.stream}/{self.group}"


class CoPartitionError(ConfigError):
    """A set of groups that cannot be shown to partition alike. ``field`` is the config field
    that differs (``max_members``, ``partitioning_filters``) or ``groups`` (the set itself);
    ``rule`` names both groups (``"<stream>/<group>"``) and the difference."""


def check_copartitioned(groups: Sequence[SetGroup]) -> int:
    """Return the shared partition count (``max_members``) of a co-partitioned set.

    Every group is compared with the first. Raises :class:`CoPartitionError` when: there are
    fewer than 2 groups; a ``(stream, group)`` pair repeats; the partition counts differ; a
    group has no partitioning filter, or a filter selecting no wildcard (the whole subject,
    stream prefix included, is hashed); two filters select different numbers of tokens. A
    config that breaks the reference's own rules raises ``ConfigError`` naming the group.
    Source of the rules: the work queue's ``{{Partition(N,i,j)}}`` transform (module docstring).
    """
    if len(groups) < 2:
        raise CoPartitionError("groups", f"a co-partitioned set needs at least 2 groups, got "
                                         f"{', '.join(g.name for g in groups) or 'none'}")
    _check_distinct(groups)
    for g in groups:
        _check_valid(g)
    first = groups[0]
    for other in groups[1:]:
        _check_counts(first, other)
        _check_selects_tokens(first, other)
        _check_selects_tokens(other, first)
        _check_token_counts(first, other)
    return first.config.max_members


def _check_distinct(groups: Sequence[SetGroup]) -> None:
    seen: set[tuple[str, str]] = set()
    for g in groups:
        if (g.stream, g.group) in seen:
            raise CoPartitionError("groups", f"{g.name} is listed twice in the set")
        seen.add((g.stream, g.group))


def _check_valid(g: SetGroup) -> None:
    try:
        g.config.validate()
    except ConfigError as e:
        raise ConfigError(e.field, f"{g.name}: {e.rule}") from None


def _check_counts(a: SetGroup, b: SetGroup) -> None:
    na, nb = a.config.max_members, b.config.max_members
    if na != nb:
        raise CoPartitionError(
            "max_members", f"{a.name} has {na} partitions but {b.name} has {nb}: every group "
                           "of a co-partitioned set needs the same max_members")


def _check_selects_tokens(g: SetGroup, other: SetGroup) -> None:
    pfs = g.config.partitioning_filters
    whole = [p.filter for p in pfs if not p.partitioning_wildcards]
    if pfs and not whole:
        return
    what = (f"its filter {whole[0]!r} selects no wildcard" if pfs
            else "it has no partitioning filter")
    raise CoPartitionError(
        "partitioning_filters",
        f"{g.name} cannot be co-partitioned with {other.name}: {what}, so the whole subject, "
        "stream-specific tokens included, is hashed; partition both on the key's wildcard "
        "tokens (e.g. 'orders.*.created:1')")


def _token_count(g: SetGroup) -> tuple[str, int]:
    """The first filter of ``g`` and its number of selected tokens; raises when the group's
    own filters differ."""
    pfs = g.config.partitioning_filters
    first = pfs[0]
    for pf in pfs[1:]:
        if len(pf.partitioning_wildcards) != len(first.partitioning_wildcards):
            raise CoPartitionError(
                "partitioning_filters",
                f"{g.name}'s filter {first.filter!r} selects "
                f"{len(first.partitioning_wildcards)} token(s) but its filter {pf.filter!r} "
                f"selects {len(pf.partitioning_wildcards)}: every filter of a co-partitioned "
                "set must select the same number of key tokens")
    return first.filter, len(first.partitioning_wildcards)


def _check_token_counts(a: SetGroup, b: SetGroup) -> None:
    (fa, ka), (fb, kb) = _token_count(a), _token_count(b)
    if ka != kb:
        raise CoPartitionError(
            "partitioning_filters",
            f"{a.name}'s filter {fa!r} selects {ka} token(s) but {b.name}'s filter {fb!r} "
            f"selects {kb}: every filter of a co-partitioned set must select the same number "
            "of key tokens")


def set_key_tokens(subject: str, config: ElasticConfig) -> tuple[str, ...] | None:
    """The token values ``subject`` contributes to its partition hash, in hashing order.

    The first partitioning filter matching ``subject`` decides, as for the work queue's
    sourcing. ``None`` when no filter matches (the work queue never holds the subject);
    ``(subject,)`` when the whole subject is hashed (no filter, or a filter selecting no
    wildcard). E.g. ``"orders.c42.created"`` under filter ``"orders.*.*"`` selecting
    ``(1,)`` gives ``("c42",)``.
    """
    pfs = config.partitioning_filters
    if not pfs:
        return (subject,)
    for pf in pfs:
        if not subject_matches(subject, pf.filter):
            continue
        if not pf.partitioning_wildcards:
            return (subject,)
        tokens, stars = subject.split("."), wildcard_positions(pf.filter)
        return tuple(tokens[stars[w - 1]] for w in pf.partitioning_wildcards)
    return None


def same_partition(subject_a: str, config_a: ElasticConfig,
                   subject_b: str, config_b: ElasticConfig) -> bool:
    """Whether ``subject_a`` (a subject of ``config_a``'s stream) and ``subject_b`` land in the
    same partition number of their groups' work queues; False when either is not sourced."""
    pa = SubjectPartitioner(config_a, max_cached=0)(subject_a)
    return pa is not None and pa == SubjectPartitioner(config_b, max_cached=0)(subject_b)


def previous_set_assignment(groups: Sequence[SetGroup]) -> Assignment:
    """The set's current assignment, ``{member: [partition, ...]}``, from every group's config
    (``member_mappings``, or the reference's default assignment of plain ``members``:
    :func:`cg_pipelines.core.assignment.assignment`).

    Where groups disagree about a partition's owner (a set written group by group and
    interrupted, or groups managed one at a time before), the first group in the given order
    that has an owner for it wins. Members and partitions ascending.
    """
    merged: dict[int, str] = {}
    for g in groups:
        for p, member in owners(assignment(g.config)).items():
            merged.setdefault(p, member)
    out: Assignment = {}
    for p in sorted(merged):
        out.setdefault(merged[p], []).append(p)
    return dict(sorted(out.items()))


def set_assignment(groups: Sequence[SetGroup], members: Iterable[str]) -> Assignment:
    """The set's new assignment for ``members``: sticky from :func:`previous_set_assignment`
    (:func:`cg_pipelines.core.assignment.sticky_assignment`: surviving owners keep their
    partitions up to a balanced share, released ones go to members below theirs).

    Deterministic for equal inputs. Raises :class:`CoPartitionError`
    (:func:`check_copartitioned`), ``UsageError`` when ``members`` is empty.
    """
    n = check_copartitioned(groups)
    return sticky_assignment(previous_set_assignment(groups), members, n)


def set_mappings(groups: Sequence[SetGroup], members: Iterable[str]
                 ) -> dict[tuple[str, str], tuple[MemberMapping, ...]]:
    """``{(stream, group): member_mappings}``: :func:`set_assignment` as the same mappings for
    every group (sorted by member, partitions ascending), so partition ``p`` of every group is
    owned by one member. Raises as :func:`set_assignment`."""
    mappings = as_mappings(set_assignment(groups, members))
    return {(g.stream, g.group): mappings for g in groups}
