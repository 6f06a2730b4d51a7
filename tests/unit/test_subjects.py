"""Subject helpers: FNV-1a, transform destination, token stripping, validation."""

from __future__ import annotations

import pytest

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.core.partitioning import SubjectPartitioner, subject_matches
from cg_pipelines.core.subjects import (
    fnv1a_32,
    name_error,
    partition_for,
    partition_of_subject,
    strip_partition,
    subject_error,
    transform_destination,
)


@pytest.mark.parametrize(
    ("data", "h"),
    [(b"", 0x811C9DC5), (b"a", 0xE40C292C), (b"foobar", 0xBF9CF968)],  # published FNV vectors
)
def test_fnv1a_32_vectors(data: bytes, h: int) -> None:
    assert fnv1a_32(data) == h


def test_partition_for_joins_without_separator() -> None:
    assert partition_for(["ab", "c"], 7) == partition_for(["a", "bc"], 7) == fnv1a_32(b"abc") % 7
    with pytest.raises(ValueError):
        partition_for(["a"], 0)


def test_partition_of_subject_selects_wildcard_tokens() -> None:
    # filter flights.*.* partitioned on the 2nd wildcard: hash the tail number only
    assert partition_of_subject("flights.UA.N14228", "flights.*.*", [2], 8) == partition_for(
        ["N14228"], 8
    )
    assert partition_of_subject("flights.UA.N1", "flights.*.*", [2, 1], 8) == partition_for(
        ["N1", "UA"], 8
    )
    assert partition_of_subject("x.y", ">", [], 5) == fnv1a_32(b"x.y") % 5


@pytest.mark.parametrize(
    ("flt", "wcs", "n", "dest"),
    [
        ("foo.*", [1], 4, "{{Partition(4,1)}}.foo.{{Wildcard(1)}}"),
        ("foo.*.*.>", [2, 1], 10, "{{Partition(10,2,1)}}.foo.{{Wildcard(1)}}.{{Wildcard(2)}}.>"),
        ("foo.>", [], 3, "{{Partition(3)}}.foo.>"),
        (">", [], 2, "{{Partition(2)}}.>"),
    ],
)
def test_transform_destination(flt: str, wcs: list[int], n: int, dest: str) -> None:
    assert transform_destination(flt, wcs, n) == dest


def test_strip_partition() -> None:
    assert strip_partition("3.flights.UA.N1") == (3, "flights.UA.N1")
    for bad in ("flights.UA", "3", "3.", "x3.a"):
        with pytest.raises(ValueError):
            strip_partition(bad)


@pytest.mark.parametrize(
    ("s", "err"),
    [("a.b", None), ("a.*.>", None), ("", "must not be empty"), ("a. b", "whitespace"),
     ("a..b", "empty tokens"), ("a.>.b", "last token"), ("a.b*", "whole tokens")],
)
def test_subject_error(s: str, err: str | None) -> None:
    got = subject_error(s)
    assert (got is None) if err is None else (got is not None and err in got)


@pytest.mark.parametrize(("s", "ok"), [("m1", True), ("", False), ("a.b", False),
                                        ("a b", False), ("a*", False)])
def test_name_error(s: str, ok: bool) -> None:
    assert (name_error(s) is None) == ok


# -- partition of an origin subject (rebuild) ------------------------------------------------



@pytest.mark.parametrize(("subject", "flt", "want"), [
    ("a.b.c", "a.*.c", True), ("a.b.c", "a.>", True), ("a", "a.>", False),
    ("a.b", "a.*.*", False), ("a.b.c.d", "a.*.c", False), ("a.b.c", ">", True),
    ("x.b.c", "a.*.c", False), ("a.b.c", "a.b.c", True), ("a.b", "*.*", True),
])
def test_subject_matches(subject: str, flt: str, want: bool) -> None:
    assert subject_matches(subject, flt) is want


def test_subject_partitioner_follows_the_transform() -> None:
    cfg = ElasticConfig(8, (PartitioningFilter("flights.*.*", (2,)),
                            PartitioningFilter("other.>", ())))
    part = SubjectPartitioner(cfg)
    assert part("flights.AA.N123") == partition_for(["N123"], 8)
    assert part("flights.UA.N123") == part("flights.AA.N123")  # the carrier is not hashed
    assert part("other.x.y") == partition_for(["other.x.y"], 8)
    assert part("flights.AA") is None and part("nope.a.b") is None
    whole = SubjectPartitioner(ElasticConfig(4))
    assert whole("any.thing") == partition_for(["any.thing"], 4)
