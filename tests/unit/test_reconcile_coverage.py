"""The coverage codec, the window judgement (stall vs gap) and the reconcile cursor
(cg_pipelines.core.coverage, cg_pipelines.core.reconcile.judge): table tests."""

from __future__ import annotations

import base64
import zlib

import numpy as np
import pytest

from cg_pipelines.core.coverage import (
    MAX_TRACKED_GAP_MESSAGES,
    ReconcileCursor,
    decode_seqs,
    encode_seqs,
)
from cg_pipelines.core.reconcile import OriginGap, ReconcileReport, SourcingStall, judge

SETS = [
    [],
    [1],
    [5, 3, 3, 9],  # any order, repeats dropped
    list(range(1, 10_001)),  # a contiguous run
    list(range(7, 400_000, 4)),  # one partition of four
    [1, 2**40, 2**40 + 3],  # differences beyond 32 bits
]


@pytest.mark.parametrize("seqs", SETS)
def test_codec_round_trip(seqs: list[int]) -> None:
    text = encode_seqs(seqs)
    assert text.isascii() and "\n" not in text
    assert decode_seqs(text).tolist() == sorted(set(seqs))


def test_codec_is_compact() -> None:
    # one partition of four over 100,000 messages: about a byte per message at most
    one_of_four = encode_seqs(np.arange(3, 400_000, 4))
    assert len(one_of_four) < 1_000, len(one_of_four)
    # an irregular partition (a hash of keys): still a few bytes per message
    rng = np.random.default_rng(7)
    seqs = np.cumsum(rng.integers(1, 12, 10_000))
    assert len(encode_seqs(seqs)) < 3 * 10_000


@pytest.mark.parametrize(("text", "error"), [
    ("", "must start with"),
    ("3:abc", "must start with"),
    ("1:!!!", "not base64 of zlib"),
    ("1:" + base64.b64encode(zlib.compress(b"\x01\x00\x00")).decode(), "not a multiple of 4"),
    ("1:" + base64.b64encode(zlib.compress(np.array([3, 0], "<u4").tobytes())).decode(),
     "strictly increasing"),
])
def test_codec_refuses_bad_text(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        decode_seqs(text)


def test_codec_refuses_non_positive() -> None:
    with pytest.raises(ValueError, match="must be >= 1, got 0"):
        encode_seqs([0, 1])


T, F = True, False
JUDGE = [
    # (seqs, parts, covered, sourced, undecided, stop, gap seqs, runs, not yet sourced)
    # all covered
    ([1, 2, 3], [0, 1, 0], [T, T, T], [T, T, T], None, 3, [], [], 0),
    # a middle gap the source passed; a non-matching message never counts
    ([1, 2, 3, 4, 5], [0, -1, 1, 1, 0], [T, F, F, F, T], [T, T, T, T, T], None, 5, [3, 4],
     [(3, 4)], 0),
    # a covered matching message splits runs; a non-matching one does not
    ([1, 2, 3, 4, 5], [0, -1, 1, 2, 0], [F, F, F, T, F], [T] * 5, None, 5, [1, 3, 5],
     [(1, 3), (5, 5)], 0),
    # a stall: nothing the source has not passed is a gap, and the window stops before it
    ([1, 2, 3, 4], [0, 1, 0, 1], [T, T, F, F], [T, T, F, F], None, 2, [], [], 2),
    # a gap before a stall is still a gap
    ([1, 2, 3, 4], [0, 1, 0, 1], [T, F, F, F], [T, T, F, F], None, 2, [2], [(2, 2)], 2),
    # an uncovered message whose commit may not be read yet is undecided: stop there
    ([1, 2, 3], [0, 1, 0], [T, F, T], [T, T, T], [F, T, F], 1, [], [], 0),
    ([], [], [], [], None, 0, [], [], 0),
]


@pytest.mark.parametrize(("seqs", "parts", "cov", "src", "und", "stop", "gaps", "runs", "nys"),
                         JUDGE)
def test_judge(seqs: list[int], parts: list[int], cov: list[bool], src: list[bool],
               und: list[bool] | None, stop: int, gaps: list[int], runs: list[tuple[int, int]],
               nys: int) -> None:
    j = judge(seqs, parts, cov, sourced=src, undecided=und)
    assert (j.stop, j.gap_seqs.tolist(), j.runs, j.not_yet_sourced) == (stop, gaps, runs, nys)


def test_judge_lengths_must_agree() -> None:
    with pytest.raises(ValueError, match="3 origin sequences, 2 partitions"):
        judge([1, 2, 3], [0, 0], [T, T, T], sourced=[T, T, T])


def test_cursor_tracks_gaps_until_covered() -> None:
    c = ReconcileCursor()
    c.add_covered(np.array([1, 2, 5, 9]), 0)
    assert c.committed == {0: 9} and c.covered().tolist() == [1, 2, 5, 9]
    c.advance(4)
    assert c.carry.tolist() == [5, 9] and c.origin_through == 4
    c.add_gaps(np.array([3, 4, 7]), np.array([1, 2, 1]), [(3, 4), (7, 7)])
    assert c.gap_runs() == [(3, 4, 2, (1, 2)), (7, 7, 1, (1,))]
    c.add_covered(np.array([4]), 2)  # a late commit covers one
    assert c.gap_runs() == [(3, 3, 1, (1,)), (7, 7, 1, (1,))]
    c.add_rebuilt(1, 5)  # a rebuild of partition 1 through 5
    assert c.gap_runs() == [(7, 7, 1, (1,))]
    back = ReconcileCursor.from_json(c.to_json())
    assert back.gap_runs() == c.gap_runs() and back.carry.tolist() == [5, 9]
    assert (back.origin_through, back.version, back.committed, back.rebuilt) == (
        4, -1, {0: 9, 2: 4}, {1: 5})


def test_cursor_gaps_are_bounded() -> None:
    c = ReconcileCursor()
    n = MAX_TRACKED_GAP_MESSAGES + 5
    c.add_gaps(np.arange(1, n + 1), np.zeros(n, np.int64), [(1, n)])
    assert len(c.gap_seqs) == MAX_TRACKED_GAP_MESSAGES and c.gaps_untracked == 5


@pytest.mark.parametrize(("text", "error"), [
    ("{}", "unknown cursor format"),
    ("nope", "not a reconcile cursor"),
    ('{"format": 1}', "not a reconcile cursor"),
])
def test_cursor_refuses_bad_text(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        ReconcileCursor.from_json(text)


def test_stall_is_not_a_gap_in_the_report() -> None:
    stall = SourcingStall("stalled", "2026-11-25T18:00:00+00:00", 40, 101, 0, -1.0)
    rep = ReconcileReport("S", "g", 1, 100, 140, 140, 0, 100, 0, 0, [], 40, 0, True, stall)
    assert rep.ok
    line = rep.text()
    assert "sourcing stalled since 2026-11-25T18:00:00+00:00" in line
    assert "40 matching message(s) from origin sequence 101" in line
    assert "not a gap, nothing to rebuild" in line and "never reached" not in line
    assert rep.as_dict()["stall"]["state"] == "stalled"
    gap = ReconcileReport("S", "g", 1, 100, 100, 100, 0, 99, 0, 0, [OriginGap(7, 7, 1, (2,))])
    assert not gap.ok and "rebuild partition(s) 2" in gap.text()
