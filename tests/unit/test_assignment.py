"""Partition assignment: the reference algorithm, moves, and the sticky strategy."""

from __future__ import annotations

import pytest

from cg_pipelines.core.assignment import (
    as_mappings,
    assignment,
    generate_partition_filters,
    moved_partitions,
    sticky_assignment,
)
from cg_pipelines.core.config import (
    ElasticConfig,
    MemberMapping,
    PartitioningFilter,
    StaticConfig,
)
from cg_pipelines.core.errors import ConfigError

MM = MemberMapping
PF = PartitioningFilter


@pytest.mark.parametrize(
    ("members", "n", "member", "filters"),
    [
        (["m1", "m2", "m3"], 7, "m1", ["0.>", "1.>", "6.>"]),  # DESIGN §4 worked example
        (["m1", "m2", "m3"], 8, "m2", ["2.>", "3.>", "7.>"]),  # DESIGN §4 worked example
        (["m3", "m1", "m2", "m1"], 7, "m1", ["0.>", "1.>", "6.>"]),  # dedupe + sort first
        (["a", "b", "c"], 2, "c", []),  # capped to max_members: c gets nothing
        (["a", "b", "c"], 2, "b", ["1.>"]),
        (["a", "b"], 5, "b", ["2.>", "3.>"]),  # per=2, remainder 4 -> a
        (["a", "b"], 5, "a", ["0.>", "1.>", "4.>"]),
        (["solo"], 3, "solo", ["0.>", "1.>", "2.>"]),
        ([], 3, "solo", []),
    ],
)
def test_reference_algorithm(members: list[str], n: int, member: str, filters: list[str]) -> None:
    assert generate_partition_filters(members, n, (), member) == filters


def test_filters_outer_partitions_inner() -> None:
    assert generate_partition_filters(["a", "b"], 4, (), "b", ["x.*", "y.>"]) == [
        "2.x.*", "3.x.*", "2.y.>", "3.y.>",
    ]


def test_mappings_with_several_filters_give_no_duplicates() -> None:
    mappings = (MM("a", (2, 0)), MM("b", (1,)))
    # Reference (pcgroups/stream_consumer_group.go, GeneratePartitionFilters, mappings branch):
    # "<p>.>" per partition in mapping order, whatever the filter; called once per filter it
    # repeats them (["2.>", "0.>", "2.>", "0.>"]): each is written once here.
    assert generate_partition_filters([], 3, mappings, "a", ["x.*", "y.*"]) == ["2.>", "0.>"]
    # A mapping listing a partition twice still yields each filter once.
    assert generate_partition_filters([], 1, (MM("a", (0, 0)),), "a") == ["0.>"]


# (members, mappings, member, filters, expected). The reference: GeneratePartitionFilters in
# pcgroups/stream_consumer_group.go (v0.2.1), called once per filter (outer) by
# ElasticGetPartitionFilters (elastic_stream_consumer_group.go) and joinMemberConsumerStatic
# (static_stream_consumer_group.go), with ">" when there are no filters. Members branch:
# "<p>.<filter>"; mappings branch (no members): "<p>.>" whatever the filter.
REFERENCE_FILTERS = [
    (["a", "b"], (), "b", ["x.*", "y.>"], ["2.x.*", "3.x.*", "2.y.>", "3.y.>"]),
    (["a", "b"], (), "a", [], ["0.>", "1.>"]),
    ([], (MM("a", (3, 1)), MM("b", (0, 2))), "a", ["flights.*.*"], ["3.>", "1.>"]),
    ([], (MM("a", (3, 1)), MM("b", (0, 2))), "b", ["x.*", "y.*", "z.>"], ["0.>", "2.>"]),
    ([], (MM("a", (3, 1)), MM("b", (0, 2))), "a", [], ["3.>", "1.>"]),
    ([], (MM("a", (0, 1)),), "zz", ["x.*"], []),
    # members win over mappings (the reference tests len(members) first)
    (["b"], (MM("a", (0, 1)),), "b", ["x.*"], ["0.x.*", "1.x.*", "2.x.*", "3.x.*"]),
]


@pytest.mark.parametrize(("members", "mappings", "member", "filters", "expected"),
                         REFERENCE_FILTERS)
def test_filters_follow_the_reference(members: list[str], mappings: tuple[MemberMapping, ...],
                                      member: str, filters: list[str],
                                      expected: list[str]) -> None:
    assert generate_partition_filters(members, 4, mappings, member, filters) == expected


def test_mapped_static_and_elastic_members_get_partition_wildcard_filters() -> None:
    """What members.py passes (``cfg.filters`` / ``cfg.consumer_filters()``) gives "<p>.>" for
    mapped members of both kinds."""
    mm = (MM("x", (1,)), MM("y", (0,)))
    static = StaticConfig(2, ("S.a.>", "S.b.>"), member_mappings=mm)
    elastic = ElasticConfig(2, (PF("S.*.a", (1,)), PF("S.*.b", (1,))), member_mappings=mm)
    for cfg, flt in ((static, static.filters), (elastic, elastic.consumer_filters())):
        assert generate_partition_filters(cfg.members, cfg.max_members, cfg.member_mappings,
                                          "x", flt) == ["1.>"]


def test_assignment_and_moves() -> None:
    old = assignment(ElasticConfig(8, members=("m1", "m2")))
    new = assignment(ElasticConfig(8, members=("m1", "m2", "m3")))
    assert old == {"m1": [0, 1, 2, 3], "m2": [4, 5, 6, 7]}
    assert new == {"m1": [0, 1, 6], "m2": [2, 3, 7], "m3": [4, 5]}
    assert moved_partitions(old, new) == {
        2: ("m1", "m2"), 3: ("m1", "m2"), 4: ("m2", "m3"), 5: ("m2", "m3"), 6: ("m2", "m1"),
    }
    assert moved_partitions(new, new) == {}
    assert moved_partitions({}, {"a": [0]}) == {0: (None, "a")}
    mapped = assignment(StaticConfig(3, member_mappings=(MM("b", (2, 0)), MM("a", (1,)))))
    assert mapped == {"a": [1], "b": [0, 2]}


@pytest.mark.parametrize(
    ("prev", "members", "n", "expected"),
    [
        ({}, ["a"], 4, {"a": [0, 1, 2, 3]}),
        ({"a": [0, 1, 2, 3]}, ["a", "b"], 4, {"a": [0, 1], "b": [2, 3]}),
        ({"a": [0, 1], "b": [2, 3]}, ["b"], 4, {"b": [0, 1, 2, 3]}),
        ({"a": [0, 1, 2], "b": [3, 4, 5]}, ["a", "b", "c"], 6,
         {"a": [0, 1], "b": [3, 4], "c": [2, 5]}),
        ({"a": [0, 5, 6], "b": [1, 2]}, ["a", "b", "c"], 7,
         {"a": [0, 5, 6], "b": [1, 2], "c": [3, 4]}),
    ],
)
def test_sticky_table(prev: dict, members: list[str], n: int, expected: dict) -> None:
    assert sticky_assignment(prev, members, n) == expected


def _balanced(assign: dict[str, list[int]], n: int) -> bool:
    sizes = [len(v) for v in assign.values()]
    parts = sorted(p for v in assign.values() for p in v)
    return parts == list(range(n)) and max(sizes) - min(sizes) <= 1


# A scripted sequence of joins and leaves over 12 partitions.
SCRIPT = [["m1"], ["m1", "m2"], ["m1", "m2", "m3"], ["m1", "m2", "m3", "m4"],
          ["m2", "m3", "m4"], ["m2", "m3", "m4", "m5"], ["m2", "m4", "m5"],
          ["m0", "m2", "m4", "m5"], ["m0", "m2", "m4", "m5", "m6", "m7"], ["m0", "m7"]]


def test_sticky_moves_fewer_than_reference(report: list[str]) -> None:
    n = 12
    ref_prev: dict[str, list[int]] = {}
    sticky_prev: dict[str, list[int]] = {}
    ref_total = sticky_total = 0
    for members in SCRIPT:
        ref = assignment(ElasticConfig(n, members=tuple(members)))
        sticky = sticky_assignment(sticky_prev, members, n)
        assert _balanced(ref, n) and _balanced(sticky, n)
        # Sticky keeps every partition whose owner stayed, up to its balanced share.
        for m, ps in sticky_prev.items():
            if m in members:
                assert len(set(ps) & set(sticky[m])) == min(len(ps), len(sticky[m]))
        ref_total += sum(1 for o, _ in moved_partitions(ref_prev, ref).values() if o)
        sticky_total += sum(1 for o, _ in moved_partitions(sticky_prev, sticky).values() if o)
        ref_prev, sticky_prev = ref, sticky
    # Every step of this script loses nothing to the sticky strategy, and it wins overall.
    assert sticky_total < ref_total
    report.append(
        f"sticky assignment: {sticky_total} partition moves vs reference {ref_total} over "
        f"{len(SCRIPT)} membership changes of 12 partitions"
    )


def test_sticky_as_mappings_is_valid_config() -> None:
    cfg = ElasticConfig(5, member_mappings=as_mappings(sticky_assignment({}, ["x", "y"], 5)))
    assert cfg.validate() is cfg
    with pytest.raises(ValueError):
        sticky_assignment({}, [], 3)


def test_assignment_never_loops_over_an_unbounded_number_of_partitions() -> None:
    """Even called directly with an unvalidated config, the assignment refuses a max_members
    above MAX_MEMBERS at once (10**30 used to loop for ever)."""
    for call in (lambda: assignment(ElasticConfig(10**30, members=("a",))),
                 lambda: generate_partition_filters(["a"], 10**8, (), "a"),
                 lambda: sticky_assignment({}, ["a"], 10**30)):
        with pytest.raises(ConfigError, match="max_members: must be <= 4096"):
            call()
