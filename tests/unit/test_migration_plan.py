"""core/migration: the lineage's parents (by the hash's arithmetic, checked against the FNV-1a
partitioner), the exact-cut rules, the target checks and the record's round trip."""

from __future__ import annotations

import random

import pytest

from cg_pipelines.core.config import ElasticConfig, MemberMapping, PartitioningFilter
from cg_pipelines.core.errors import ConfigError, StateError
from cg_pipelines.core.migration import (
    Cut,
    Epoch,
    Lineage,
    Migration,
    Observation,
    anchors,
    check_target,
    decide_cut,
    migrated_config,
    plan_lines,
)
from cg_pipelines.core.partitioning import SubjectPartitioner


def lineage(*counts: int) -> Lineage:
    return Lineage(tuple(Epoch(n, 1 + 100 * i, 1 + 10 * i) for i, n in enumerate(counts)))


@pytest.mark.parametrize(("counts", "partition", "parents"), [
    ((8,), 3, ()),                      # never migrated
    ((8, 64), 3, ()),                   # 3 < 8: its keys were all in 3 already
    ((8, 64), 11, (3,)),                # split: one parent, 11 mod 8
    ((8, 64), 63, (7,)),
    ((8, 2), 1, (3, 5, 7)),             # merge: 8/2 parents, 1 itself is its own
    ((8, 2), 0, (2, 4, 6)),
    ((4, 6), 5, (1, 3)),                # neither: gcd 2
    ((8, 64, 256), 75, (3, 11)),        # two epochs back: 75 mod 8, 75 mod 64
    ((8, 64, 256), 11, (3,)),
])
def test_parents(counts: tuple[int, ...], partition: int, parents: tuple[int, ...]) -> None:
    assert lineage(*counts).parents(partition) == parents


@pytest.mark.parametrize(("old", "new"), [(8, 64), (8, 2), (4, 6), (7, 3), (64, 256)])
def test_every_key_s_old_partition_is_a_parent_or_itself(old: int, new: int) -> None:
    """The parents rule against the real partitioner: for random keys, the key's partition
    under the old count is the new partition itself or one of its parents."""
    rng = random.Random(old * 1000 + new)
    pf = (PartitioningFilter("flights.*.*", (2,)),)
    before = SubjectPartitioner(ElasticConfig(old, pf))
    after = SubjectPartitioner(ElasticConfig(new, pf))
    lin = lineage(old, new)
    for _ in range(2000):
        subject = f"flights.AA.N{rng.randrange(10**6)}"
        p_old, p_new = before(subject), after(subject)
        assert p_old == p_new or p_old in lin.parents(p_new), (subject, p_old, p_new)


def test_lineage_refuses_what_cannot_be() -> None:
    with pytest.raises(ConfigError, match="one epoch"):
        Lineage(())
    with pytest.raises(ConfigError, match="increase"):
        Lineage((Epoch(8, 1, 1), Epoch(64, 1, 5)))
    with pytest.raises(ConfigError, match="not a lineage"):
        Lineage.decode(b'{"epochs": [{"partitions": "x"}]}', "cg-runs/k")
    lin = lineage(8, 64)
    assert Lineage.decode(lin.encode(), "k") == lin
    assert lin.then(lin.epochs[-1]) is lin and lin.then(Epoch(128, 500, 50)).partitions == 128
    # an epoch that held no message is replaced, not kept
    assert lineage(4).then(Epoch(8, 1, 1)) == Lineage((Epoch(8, 1, 1),))
    assert lin.then(Epoch(2, 101, 11)).epochs == (Epoch(8, 1, 1), Epoch(2, 101, 11))


BEFORE = Observation(origin_last_seq=1000, wq_last_seq=400, anchor=(390, 980))


@pytest.mark.parametrize(("kwargs", "cut"), [
    ({"last_origin": 990}, Cut(991, 401, "header")),
    ({"counted_origin": 995}, Cut(996, 401, "counted")),
    ({"last_origin": 990, "counted_origin": 1}, Cut(991, 401, "header")),
    ({"given": 7, "last_origin": 990}, Cut(7, 401, "given")),
    ({}, None),   # nothing read: never guessed (a source's lag of 0 proves nothing)
])
def test_decide_cut(kwargs: dict[str, object], cut: Cut | None) -> None:
    args: dict[str, object] = {"wq_last_seq": 400, "last_origin": None, "counted_origin": None}
    assert decide_cut(**(args | kwargs)) == cut  # type: ignore[arg-type]


def test_a_given_cut_below_1_is_refused() -> None:
    with pytest.raises(ConfigError, match="cut_origin_seq"):
        decide_cut(wq_last_seq=1, last_origin=None, counted_origin=None, given=0)


@pytest.mark.parametrize(("kwargs", "want"), [
    # the nearest to L first; (0, 0) for a group never migrated whose origin starts at 1
    ({}, [(399, 995), (390, 980), (0, 0)]),
    ({"origin_first_seq": 500}, [(399, 995), (390, 980)]),      # trimmed past (0, 0)
    ({"origin_first_seq": 990}, [(399, 995)]),                   # and past the recorded one
    ({"stored": None, "recorded": None}, [(0, 0)]),
    ({"stored": None, "recorded": None, "lineage": lineage(8, 64)}, [(10, 100)]),
    ({"wq_last_seq": 395}, [(390, 980), (0, 0)]),                # an anchor above L: no
])
def test_anchors(kwargs: dict[str, object], want: list[tuple[int, int]]) -> None:
    args: dict[str, object] = {"stored": (399, 995), "recorded": BEFORE, "lineage": None,
                               "origin_first_seq": 1, "wq_last_seq": 400}
    assert anchors(**(args | kwargs)) == want  # type: ignore[arg-type]


def test_targets() -> None:
    cfg = ElasticConfig(8, members=("a", "b"))
    for bad, why in ((8, "already has 8"), (0, ">= 1"), (True, "integer")):
        with pytest.raises(ConfigError, match=why):
            check_target(cfg, bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        check_target(cfg, 10**9)  # above the library's MAX_MEMBERS
    assert migrated_config(cfg, 64).max_members == 64
    assert migrated_config(cfg, 64).members == ("a", "b")
    mapped = ElasticConfig(4, member_mappings=(MemberMapping("a", (0, 1)),
                                               MemberMapping("b", (2, 3))))
    with pytest.raises(ConfigError, match="not a multiple"):
        check_target(mapped, 6)
    new = migrated_config(mapped, 8)
    assert {m.member: m.partitions for m in new.member_mappings} == \
        {"a": (0, 1, 4, 5), "b": (2, 3, 6, 7)}


def test_the_record_round_trips_and_never_goes_back() -> None:
    m = Migration(8, 64, source={"name": "flights", "subject_transforms": []})
    m2 = m.at("source_removed", before=BEFORE, cut=Cut(991, 401, "header"))
    assert Migration.decode(m2.encode(), "k") == m2
    with pytest.raises(StateError):
        m2.at("planned")
    for bad in (b"[]", b'{"step": "nope", "from_partitions": 1, "to_partitions": 2}', b"x"):
        with pytest.raises(ConfigError, match="not a migration record"):
            Migration.decode(bad, "cg-runs/k")


def test_the_plan_names_every_step_and_what_moves() -> None:
    lines = plan_lines("flights", "legs", 8, 64, 1234, done=("planned",))
    assert len(lines) == 7 and lines[0].startswith("done 1. planned")
    assert "1,234 messages" in lines[2] and "max_members=64" in lines[3]
    assert "Partition(64" in lines[4] and "88%" in lines[6]
