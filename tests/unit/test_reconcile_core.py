"""Pure reconciliation logic (cg_pipelines.core.reconcile): gaps as runs of missing matching
messages with their partitions, the not-yet-sourced tail, the report's lines."""

from __future__ import annotations

import pytest

from cg_pipelines.core.reconcile import OriginGap, ReconcileReport, find_gaps

CASES = [
    # (origin seqs, partitions (-1: not matching), covered, sourcing done, gaps, tail)
    ([1, 2, 3, 4], [0, 1, 0, 1], [1, 2, 3, 4], True, [], 0),
    ([1, 2, 3, 4, 5], [0, 1, 0, 1, 2], [1, 5], True, [OriginGap(2, 4, 3, (0, 1))], 0),
    # a non-matching message inside a run does not split it; a covered one does
    ([1, 2, 3, 4, 5, 6], [0, -1, 1, 2, 0, 0], [4], True,
     [OriginGap(1, 3, 2, (0, 1)), OriginGap(5, 6, 2, (0,))], 0),
    # non-matching messages are never missing
    ([7, 8, 9], [-1, -1, -1], [], True, [], 0),
    # source lagging: missing messages after the last covered one are not yet sourced
    ([1, 2, 3, 4, 5], [0, 0, 1, 1, 0], [1, 3], False, [OriginGap(2, 2, 1, (0,))], 2),
    ([1, 2, 3], [0, 0, 0], [], False, [], 3),
    # ... but with no lag the tail is a gap
    ([1, 2, 3], [0, 0, 0], [], True, [OriginGap(1, 3, 3, (0,))], 0),
    ([], [], [5], True, [], 0),
]


@pytest.mark.parametrize(("seqs", "parts", "covered", "done", "gaps", "tail"), CASES)
def test_find_gaps(seqs: list[int], parts: list[int], covered: list[int], done: bool,
                   gaps: list[OriginGap], tail: int) -> None:
    assert find_gaps(seqs, parts, covered, sourcing_done=done) == (gaps, tail)


def test_lengths_must_agree() -> None:
    with pytest.raises(ValueError, match="3 origin sequences but 2 partitions"):
        find_gaps([1, 2, 3], [0, 0], [])


def test_report_lines() -> None:
    ok = ReconcileReport("S", "g", 1, 10, 10, 8, 2, 5, 1, 0)
    assert ok.ok and ok.text() == (
        "S.g: ok: origin sequences 1..10: 8 of 10 messages match the group, all reached S-g "
        "(2 queued, 5 committed, 1 dead-lettered, 0 replayed)")
    bad = ReconcileReport("S", "g", 1, 300, 300, 300, 0, 279, 0, 0,
                          [OriginGap(101, 120, 20, (0, 2)), OriginGap(200, 200, 1, (1,))])
    assert not bad.ok and bad.missing == 21 and bad.partitions == [0, 1, 2]
    assert bad.text() == (
        "S.g: 21 origin message(s) never reached S-g (checked origin sequences 1..300): "
        "origin sequences 101..120 (20 messages, partitions 0, 2); origin sequence 200 "
        "(1 message, partition 1); repair: rebuild partition(s) 0, 1, 2 from the origin stream "
        "(rebuild_partition; in Dagster the asset's _rebuild job)")
    d = bad.as_dict()
    assert d["ok"] is False and d["gaps"][0] == {"first_seq": 101, "last_seq": 120,
                                                 "messages": 20, "partitions": [0, 2]}
