"""The pure judgement of one reconcile window (cg_pipelines.core.reconcile_window): table tests
over ReconcileWindow data objects, no streams."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from cg_pipelines.core.coverage import CommitCoverage, ReconcileCursor
from cg_pipelines.core.errors import UsageError
from cg_pipelines.core.reconcile import OriginGap
from cg_pipelines.core.reconcile_window import (
    ReconcileWindow,
    SourceState,
    fold_coverage,
    judge_window,
)

NOW = 1_000_000.0
OLD = int((NOW - 60) * 1e9)     # published a minute before the check
FRESH = int((NOW - 1) * 1e9)    # published a second before the check (within grace_s=10)
HEALTHY = SourceState(True, lag=0, active_s=0.5)
LAGGING = SourceState(True, lag=40, active_s=0.5)
STALLED = SourceState(True, lag=40, active_s=95.0)
NO_SOURCE = SourceState(False)


def arr(*xs: int) -> np.ndarray:
    return np.array(xs, np.int64)


@dataclass
class Case:
    name: str
    parts: list[int]                     # origin sequences are 1..len(parts)
    source: SourceState
    times: list[int] | None = None       # default: all OLD
    queued: tuple[int, ...] = ()
    dead: tuple[int, ...] = ()
    replayed: tuple[int, ...] = ()
    in_table: tuple[int, ...] = ()
    covered: dict[int, tuple[int, ...]] = field(default_factory=dict)  # partition -> commits
    rebuilt: dict[int, int] = field(default_factory=dict)
    evidence: int = 0
    caught_up: bool = True
    # expected
    gaps: list[OriginGap] = field(default_factory=list)
    through: int = 0                     # the cursor's origin_through after
    not_yet_sourced: int = 0
    stall: str | None = None
    partial: bool = False
    counts: tuple[int, int, int, int] = (0, 0, 0, 0)  # queued, table, dlq, replayed


CASES = [
    Case("all accounted for in four places", [0, 1, 0, 1, 0], HEALTHY, queued=(5,), dead=(2,),
         replayed=(4,), covered={0: (1, 3)}, evidence=3, through=5, counts=(1, 2, 1, 1)),
    Case("a message the source passed is a gap", [0, 1, 0, 1], LAGGING, covered={0: (1,)},
         queued=(4,), through=4, gaps=[OriginGap(2, 3, 2, (0, 1))], counts=(1, 1, 0, 0)),
    Case("a lagging source's uncovered tail is not sourced yet, not a gap", [0, 1, 0, 1],
         LAGGING, times=[OLD, OLD, FRESH, FRESH], covered={0: (1,), 1: (2,)}, evidence=2,
         through=2, not_yet_sourced=2, stall="lagging", partial=True, counts=(0, 2, 0, 0)),
    Case("a stalled source", [0, 0], STALLED, not_yet_sourced=2, stall="stalled", partial=True),
    Case("no source", [1, 1, 1], NO_SOURCE, not_yet_sourced=3, stall="no source",
         partial=True),
    Case("a healthy source's old uncovered tail is a gap", [0, 1, 0], HEALTHY,
         covered={0: (1,)}, evidence=1, through=3, gaps=[OriginGap(2, 3, 2, (0, 1))],
         counts=(0, 1, 0, 0)),
    Case("... but within grace_s it is not sourced yet", [0, 1, 0], HEALTHY,
         times=[OLD, FRESH, FRESH], covered={0: (1,)}, evidence=1, through=1,
         not_yet_sourced=2, stall="lagging", partial=True, counts=(0, 1, 0, 0)),
    Case("commits left to read: above a partition's last commit is undecided", [0, 1, 0, 1],
         LAGGING, covered={0: (1,), 1: (2,)}, queued=(4,), caught_up=False, through=2,
         partial=True, counts=(1, 2, 0, 0)),
    Case("a rebuild covers its partition through its sequence", [2, 2, 3, 2], LAGGING,
         rebuilt={2: 4}, queued=(3,), through=4, counts=(1, 3, 0, 0)),
    Case("messages no filter matches are never gaps", [-1, 0, -1, -1], LAGGING, queued=(2,),
         through=4, counts=(1, 0, 0, 0)),
    Case("an old table's rows are covered and trusted as sourced", [0, 0, 1, 1], LAGGING,
         in_table=(1, 2, 4), through=4, gaps=[OriginGap(3, 3, 1, (1,))],
         counts=(0, 3, 0, 0)),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_judge_window(case: Case) -> None:
    n = len(case.parts)
    cursor = ReconcileCursor()
    for p, seqs in case.covered.items():
        cursor.add_covered(arr(*seqs), p)
    for p, through in case.rebuilt.items():
        cursor.add_rebuilt(p, through)
    w = ReconcileWindow(
        "ORDERS", "g", 1, n, n, np.arange(1, n + 1, dtype=np.int64), arr(*case.parts),
        np.array(case.times or [OLD] * n, np.int64), case.source, queued=arr(*case.queued),
        dead=arr(*case.dead), replayed=arr(*case.replayed), in_table=arr(*case.in_table),
        evidence=case.evidence, caught_up=case.caught_up, now_s=NOW)
    rep = judge_window(w, cursor)
    assert rep.gaps == case.gaps
    assert cursor.origin_through == case.through == rep.to_seq
    assert rep.not_yet_sourced == case.not_yet_sourced
    assert (rep.stall.state if rep.stall else None) == case.stall
    assert rep.partial == case.partial
    assert (rep.in_queue, rep.in_table, rep.in_dlq, rep.replayed) == case.counts
    assert rep.expected == sum(p >= 0 for p in case.parts) and rep.origin_messages == n


def test_stall_names_the_first_unsourced_message_and_its_time() -> None:
    w = ReconcileWindow("ORDERS", "g", 10, 12, 12, arr(10, 11, 12), arr(0, 0, 0),
                        arr(OLD, FRESH, FRESH), LAGGING, queued=arr(10), now_s=NOW)
    rep = judge_window(w, ReconcileCursor(origin_through=9))
    assert rep.stall is not None
    assert (rep.stall.first_seq, rep.stall.not_yet_sourced, rep.stall.lag) == (11, 2, 40)
    assert rep.stall.since == "1970-01-12T13:46:39+00:00"


def test_gaps_stay_open_across_checks_until_covered() -> None:
    cursor = ReconcileCursor()
    first = ReconcileWindow("S", "g", 1, 3, 3, arr(1, 2, 3), arr(0, 0, 0), arr(OLD, OLD, OLD),
                            LAGGING, queued=arr(3), now_s=NOW)
    assert judge_window(first, cursor).gaps == [OriginGap(1, 2, 2, (0,))]
    empty = ReconcileWindow("S", "g", 4, 3, 3, arr(), arr(), arr(), LAGGING, now_s=NOW)
    assert judge_window(empty, cursor).gaps == [OriginGap(1, 2, 2, (0,))]
    cursor.add_covered(arr(1), 0)   # a repair's commit covers origin sequence 1
    assert judge_window(empty, cursor).gaps == [OriginGap(2, 2, 1, (0,))]


def test_fold_coverage_takes_evidence_only_from_commits_stored_before_the_scan() -> None:
    cursor = ReconcileCursor()
    commits = [CommitCoverage(1, 0, arr(3, 7), None, wq_last=5),
               CommitCoverage(2, 1, arr(9), None, wq_last=12),     # after the scan began
               CommitCoverage(3, 2, None, 20)]                     # a rebuild
    assert fold_coverage(cursor, commits, wq_top=10, evidence=4) == 7
    assert cursor.covered().tolist() == [3, 7, 9]
    assert cursor.committed == {0: 7, 1: 9} and cursor.rebuilt == {2: 20}


def test_lengths_must_agree() -> None:
    w = ReconcileWindow("S", "g", 1, 2, 2, arr(1, 2), arr(0, 0), arr(OLD), HEALTHY)
    with pytest.raises(UsageError, match="2 origin sequences but 1 store times"):
        judge_window(w, ReconcileCursor())
