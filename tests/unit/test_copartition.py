"""Co-partitioned group sets (issue 39): the checks, the key tokens, the set's sticky
assignment (KIP-315's worked example) and its mappings."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cg_pipelines.core.assignment import Assignment, as_mappings, moved_partitions
from cg_pipelines.core.config import (
    ConfigError,
    ElasticConfig,
    MemberMapping,
    PartitioningFilter,
    with_mappings,
)
from cg_pipelines.core.copartition import (
    CoPartitionError,
    SetGroup,
    check_copartitioned,
    previous_set_assignment,
    same_partition,
    set_assignment,
    set_key_tokens,
    set_mappings,
)
from cg_pipelines.core.errors import UsageError
from cg_pipelines.core.partitioning import SubjectPartitioner

MM = MemberMapping
PF = PartitioningFilter


def group(stream: str, n: int = 10, *filters: PF, **membership: object) -> SetGroup:
    """``stream/join`` partitioned by ``filters`` (default ``<stream>.*.*`` on the first
    wildcard) into ``n`` partitions."""
    pfs = filters or (PF(f"{stream}.*.*", (1,)),)
    return SetGroup(stream, "join", ElasticConfig(n, pfs, **membership))  # type: ignore[arg-type]


def applied(groups: list[SetGroup], assign: Assignment) -> list[SetGroup]:
    """The groups as the set's mappings leave them."""
    return [replace(g, config=with_mappings(g.config, as_mappings(assign))) for g in groups]


IMPRESSIONS = group("impressions", 10, PF("impressions.*.shown", (1,)))
CLICKS = group("clicks", 10, PF("clicks.*.*", (2,)))
PAIR = [IMPRESSIONS, CLICKS]


# ------------------------------------------------------------------------------------- checks


@pytest.mark.parametrize("groups", [
    PAIR,
    [group("a"), group("b"), group("c")],
    [group("a", 4, PF("a.*.*", (2, 1))), group("b", 4, PF("b.*.x.*", (1, 2)))],
    # several filters per group, each selecting one token
    [group("a", 3, PF("a.x.*", (1,)), PF("a.y.*.*", (2,))), group("b", 3)],
    [SetGroup("s", "g1", IMPRESSIONS.config), SetGroup("s", "g2", IMPRESSIONS.config)],
], ids=["pair", "three", "two-tokens", "several-filters", "same-stream"])
def test_a_co_partitioned_set_gives_its_partition_count(groups: list[SetGroup]) -> None:
    assert check_copartitioned(groups) == groups[0].config.max_members


@pytest.mark.parametrize(("groups", "field", "message"), [
    ([IMPRESSIONS], "groups",
     "a co-partitioned set needs at least 2 groups, got impressions/join"),
    ([], "groups", "a co-partitioned set needs at least 2 groups, got none"),
    ([IMPRESSIONS, CLICKS, IMPRESSIONS], "groups",
     "impressions/join is listed twice in the set"),
    ([IMPRESSIONS, group("clicks", 8)], "max_members",
     "impressions/join has 10 partitions but clicks/join has 8: every group of a "
     "co-partitioned set needs the same max_members"),
    ([IMPRESSIONS, group("clicks", 10, PF("clicks.>"))], "partitioning_filters",
     "clicks/join cannot be co-partitioned with impressions/join: its filter 'clicks.>' "
     "selects no wildcard, so the whole subject, stream-specific tokens included, is hashed; "
     "partition both on the key's wildcard tokens (e.g. 'orders.*.created:1')"),
    ([SetGroup("raw", "join", ElasticConfig(10)), CLICKS], "partitioning_filters",
     "raw/join cannot be co-partitioned with clicks/join: it has no partitioning filter, so "
     "the whole subject"),
    ([IMPRESSIONS, group("clicks", 10, PF("clicks.*.*", (1, 2)))], "partitioning_filters",
     "impressions/join's filter 'impressions.*.shown' selects 1 token(s) but clicks/join's "
     "filter 'clicks.*.*' selects 2: every filter of a co-partitioned set must select the "
     "same number of key tokens"),
    ([IMPRESSIONS, group("clicks", 10, PF("clicks.a.*", (1,)), PF("clicks.b.*.*", (1, 2)))],
     "partitioning_filters",
     "clicks/join's filter 'clicks.a.*' selects 1 token(s) but its filter 'clicks.b.*.*' "
     "selects 2"),
], ids=["one", "none", "twice", "counts", "no-wildcard", "no-filter", "token-counts",
        "own-filters-differ"])
def test_a_mismatched_set_is_refused_naming_both_groups(
        groups: list[SetGroup], field: str, message: str) -> None:
    with pytest.raises(CoPartitionError) as raised:
        check_copartitioned(groups)
    assert isinstance(raised.value, ConfigError) and isinstance(raised.value, ValueError)
    assert raised.value.field == field
    assert str(raised.value).startswith(f"{field}: {message}"), str(raised.value)


def test_an_invalid_config_is_refused_naming_its_group() -> None:
    bad = group("clicks", 10, PF("clicks.*", (2,)))
    with pytest.raises(ConfigError, match="^partitioning_filters: clicks/join: partitioning "
                                          "wildcard index 2 of 'clicks.*' must be between 1"):
        check_copartitioned([IMPRESSIONS, bad])


# --------------------------------------------------------------------------------- key tokens


@pytest.mark.parametrize(("subject", "config", "tokens"), [
    ("impressions.a17.shown", IMPRESSIONS.config, ("a17",)),
    ("clicks.web.a17", CLICKS.config, ("a17",)),
    ("impressions.a17.hidden", IMPRESSIONS.config, None),  # no filter matches: not sourced
    ("w.JFK.2013.5", ElasticConfig(4, (PF("w.*.*.*", (3, 1)),)), ("5", "JFK")),  # hash order
    ("f.x.k", ElasticConfig(4, (PF("f.y.*", (1,)), PF("f.*.*", (2,)))), ("k",)),  # 2nd filter
    ("any.thing", ElasticConfig(4), ("any.thing",)),  # no filter: the whole subject
    ("g.k.rest", ElasticConfig(4, (PF("g.>"),)), ("g.k.rest",)),
])
def test_key_tokens_are_the_hashed_values_in_order(
        subject: str, config: ElasticConfig, tokens: tuple[str, ...] | None) -> None:
    assert set_key_tokens(subject, config) == tokens


def test_subjects_with_the_same_key_tokens_share_a_partition() -> None:
    imp, clk = IMPRESSIONS.config, CLICKS.config
    parts = set()
    for key in (f"auction{i}" for i in range(40)):
        a, b = f"impressions.{key}.shown", f"clicks.mobile.{key}"
        assert set_key_tokens(a, imp) == set_key_tokens(b, clk) == (key,)
        assert same_partition(a, imp, b, clk)
        parts.add(SubjectPartitioner(imp)(a))
    assert len(parts) > 5  # the keys spread over the partitions
    assert not same_partition("impressions.x.hidden", imp, "clicks.mobile.x", clk)
    # Different keys: partitions 0 and 9 (FNV-1a 32 of "k0" and "k1", mod 10).
    assert [SubjectPartitioner(imp)(f"impressions.k{i}.shown") for i in (0, 1)] == [0, 9]
    assert not same_partition("impressions.k0.shown", imp, "clicks.m.k1", clk)


# --------------------------------------------------------------------------------- assignment

SEED_RANGE = {"A": [0, 1, 2], "B": [3, 4, 5], "C": [6, 7], "D": [8, 9]}


def test_kip_315_worked_example_d_leaves_only_8_and_9_move() -> None:
    """KIP-315 (``seeds/002``): impressions and clicks, 10 partitions, consumers A-D hold
    0-2, 3-5, 6-7, 8-9 of both topics; when D leaves, "Partitions 8 and 9 are assigned to new
    consumers because they are unowned after D left the group. No other partitions have their
    assignment changed" (A and C end with 4 and 3). The seed's table hands 9 to A and 8 to C;
    here released partitions go ascending to members in name order (8 to A, 9 to C): as
    few moves, the same shares."""
    first = set_assignment(PAIR, ["A", "B", "C", "D"])
    assert first == SEED_RANGE  # the seed's starting point (its range assignment)
    after = set_assignment(applied(PAIR, first), ["A", "B", "C"])
    assert after == {"A": [0, 1, 2, 8], "B": [3, 4, 5], "C": [6, 7, 9]}
    assert moved_partitions(first, after) == {8: ("D", "A"), 9: ("D", "C")}
    # The seed's range assignor also moves 3 (B to A) and 6 (C to B), "unnecessary".
    range_after = {"A": [0, 1, 2, 3], "B": [4, 5, 6], "C": [7, 8, 9]}
    assert set(moved_partitions(first, range_after)) == {3, 6, 8, 9}


@pytest.mark.parametrize(("previous", "members", "expected", "moved"), [
    # E joins: each member gives up its highest partition above the new share of 2.
    (SEED_RANGE, "ABCDE", {"A": [0, 1], "B": [3, 4], "C": [6, 7], "D": [8, 9], "E": [2, 5]},
     {2: ("A", "E"), 5: ("B", "E")}),
    # D leaves and E joins at once: E takes D's partitions.
    (SEED_RANGE, "ABCE", {"A": [0, 1, 2], "B": [3, 4, 5], "C": [6, 7], "E": [8, 9]},
     {8: ("D", "E"), 9: ("D", "E")}),
    # Two leave.
    (SEED_RANGE, "AC", {"A": [0, 1, 2, 3, 4], "C": [5, 6, 7, 8, 9]},
     {3: ("B", "A"), 4: ("B", "A"), 5: ("B", "C"), 8: ("D", "C"), 9: ("D", "C")}),
    # Nobody changes: nothing moves.
    (SEED_RANGE, "DCBA", SEED_RANGE, {}),
    # Everyone new: the balanced range from scratch.
    (SEED_RANGE, "XY", {"X": [0, 1, 2, 3, 4], "Y": [5, 6, 7, 8, 9]},
     {p: (o, "X" if p < 5 else "Y") for o, ps in SEED_RANGE.items() for p in ps}),
    # More members than partitions: capped to max_members (sorted names), as the reference.
    ({"A": list(range(10))}, [f"m{i:02}" for i in range(12)],
     {f"m{i:02}": [i] for i in range(10)}, {p: ("A", f"m{p:02}") for p in range(10)}),
], ids=["join", "leave-and-join", "two-leave", "no-change", "all-new", "capped"])
def test_membership_changes_move_as_few_partitions_as_balance_needs(
        previous: Assignment, members: list[str], expected: Assignment,
        moved: dict[int, tuple[str | None, str | None]]) -> None:
    after = set_assignment(applied(PAIR, previous), members)
    assert after == expected
    assert moved_partitions(previous, after) == moved


def test_plain_members_start_from_the_reference_default_assignment() -> None:
    # Reference: per = 10 // 4 = 2, so A 0,1 B 2,3 C 4,5 D 6,7, the remainder 8 to A, 9 to B.
    plain = [replace(g, config=replace(g.config, members=("A", "B", "C", "D"))) for g in PAIR]
    assert previous_set_assignment(plain) == {"A": [0, 1, 8], "B": [2, 3, 9], "C": [4, 5],
                                              "D": [6, 7]}
    after = set_assignment(plain, "ABC")
    assert after == {"A": [0, 1, 6, 8], "B": [2, 3, 9], "C": [4, 5, 7]}
    assert moved_partitions(previous_set_assignment(plain), after) == {6: ("D", "A"),
                                                                       7: ("D", "C")}


def test_groups_that_disagree_follow_the_first_group() -> None:
    imp, clk = PAIR
    imp = replace(imp, config=with_mappings(imp.config, (MM("A", (0, 1, 2, 3, 4)),
                                                         MM("B", (5, 6, 7, 8, 9)))))
    clk = replace(clk, config=with_mappings(clk.config, (MM("B", (0, 1, 2, 3, 4)),
                                                         MM("A", (5, 6, 7, 8, 9)))))
    assert previous_set_assignment([imp, clk]) == {"A": [0, 1, 2, 3, 4], "B": [5, 6, 7, 8, 9]}
    assert previous_set_assignment([clk, imp]) == {"A": [5, 6, 7, 8, 9], "B": [0, 1, 2, 3, 4]}
    assert set_assignment([imp, clk], "AB") == {"A": [0, 1, 2, 3, 4], "B": [5, 6, 7, 8, 9]}
    # A group with no members yet takes the others' owners.
    empty = replace(CLICKS, stream="views")
    assert previous_set_assignment([empty, imp]) == previous_set_assignment([imp])


def test_an_interrupted_write_converges() -> None:
    """A set written group by group and stopped half way (the first group has the new
    mappings, the second the old) gets, from the same members, the first group's mappings,
    which a second write completes."""
    old = set_assignment(PAIR, "ABCD")
    new = set_assignment(applied(PAIR, old), "ABC")
    half = [applied(PAIR, new)[0], applied(PAIR, old)[1]]
    assert set_assignment(half, "ABC") == new


def test_the_assignment_is_deterministic() -> None:
    prev = applied(PAIR, SEED_RANGE)
    runs = {repr(set_assignment(prev, order)) for order in ("ABC", "CBA", "BAC", "AABBCC")}
    assert len(runs) == 1
    assert set_assignment(prev, "ABC") == set_assignment(prev, iter("CAB"))


def test_set_mappings_give_every_group_the_same_mappings() -> None:
    three = [*PAIR, group("views")]
    got = set_mappings(three, "ABCD")
    want = (MM("A", (0, 1, 2)), MM("B", (3, 4, 5)), MM("C", (6, 7)), MM("D", (8, 9)))
    assert got == {("impressions", "join"): want, ("clicks", "join"): want,
                   ("views", "join"): want}
    for g in three:  # valid as each group's config: the reference's rules hold
        with_mappings(g.config, got[(g.stream, g.group)]).validate()


def test_set_assignment_refuses_a_mismatched_set_and_no_members() -> None:
    with pytest.raises(CoPartitionError, match="impressions/join has 10 partitions but "
                                               "clicks/join has 4"):
        set_mappings([IMPRESSIONS, group("clicks", 4)], "AB")
    with pytest.raises(UsageError, match="needs at least one member"):
        set_assignment(PAIR, [])
