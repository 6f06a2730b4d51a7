"""Sensor decisions: backlog run requests and membership gains."""

from __future__ import annotations

import pytest

from cg_pipelines.core.triggers import (
    PartitionBacklog as B,
)
from cg_pipelines.core.triggers import (
    backlog_requests,
    decode_membership_cursor,
    encode_membership_cursor,
    gained_partitions,
    served_partitions,
)


@pytest.mark.parametrize(
    ("backlog", "kw", "expected"),
    [
        ([B(0, 5, 10, 1.0), B(1, 0, None, 0.0), B(2, 1, 7, 0.5)], {},
         [(0, "g:0:10"), (2, "g:2:7")]),
        ([B(0, 5, 10, 1.0), B(2, 100, 7, 0.5)], {"min_pending": 50}, [(2, "g:2:7")]),
        ([B(0, 5, 10, 900.0), B(2, 3, 7, 0.5)], {"min_pending": 50, "max_age_s": 600},
         [(0, "g:0:10")]),
        ([B(0, 5, 10, 1.0), B(1, 5, 3, 1.0)], {"partitions": [1]}, [(1, "g:1:3")]),
        ([B(0, 5, 10, 1.0), B(0, 6, 10, 1.0)], {}, [(0, "g:0:10")]),  # one per partition
        ([], {}, []),
    ],
)
def test_backlog_requests(backlog, kw, expected) -> None:
    got = backlog_requests("g", backlog, **kw)
    assert [(r.partition, r.run_key) for r in got] == expected
    assert all(r.reason for r in got)


def test_backlog_requests_rejects_bad_threshold() -> None:
    with pytest.raises(ValueError):
        backlog_requests("g", [], min_pending=0)


def test_same_backlog_same_key_new_backlog_new_key() -> None:
    a = backlog_requests("g", [B(3, 10, 100, 1.0)])
    b = backlog_requests("g", [B(3, 12, 100, 2.0)])  # more arrived, same first pending
    c = backlog_requests("g", [B(3, 4, 111, 0.1)])  # drained up to 110, new backlog
    assert a[0].run_key == b[0].run_key != c[0].run_key


@pytest.mark.parametrize(
    ("old", "new", "served", "expected"),
    [
        ({"m1": [0, 1, 2, 3]}, {"m1": [0, 1], "m2": [2, 3]}, None,
         {2: ("m1", "m2"), 3: ("m1", "m2")}),
        ({"m1": [0, 1, 2, 3]}, {"m1": [0, 1], "m2": [2, 3]}, ["m1"], {}),
        ({}, {"m1": [0, 1]}, ["m1"], {0: (None, "m1"), 1: (None, "m1")}),
        ({"m1": [0], "m2": [1]}, {"m2": [0, 1]}, ["m2"], {0: ("m1", "m2")}),
        ({"m1": [0]}, {}, None, {}),  # dropped: nothing gained
    ],
)
def test_gained_partitions(old, new, served, expected) -> None:
    assert gained_partitions(old, new, served) == expected


def test_served_partitions_and_cursor_round_trip() -> None:
    assign = {"m1": [0, 3], "m2": [1, 2]}
    assert served_partitions(assign, ["m2"]) == [1, 2]
    assert served_partitions(assign, None) == [0, 1, 2, 3]
    assert decode_membership_cursor(encode_membership_cursor(7, assign)) == (7, assign)
    assert decode_membership_cursor(None) == (0, {})
    with pytest.raises(ValueError, match="corrupt"):
        decode_membership_cursor("{oops")
