"""The judgement of one reconcile check's origin window (pure: no I/O).

:func:`cg_pipelines.jetstream.reconcile.reconcile_group` reads the streams, the dead letters and
the recorded coverage into a :class:`ReconcileWindow` (what one check saw) and a
:class:`~cg_pipelines.core.coverage.ReconcileCursor` (what earlier checks settled);
:func:`judge_window` decides which matching origin messages are covered, which are gaps and
which are not sourced yet (:func:`cg_pipelines.core.reconcile.judge`), moves the cursor and
returns the :class:`~cg_pipelines.core.reconcile.ReconcileReport`. The rules are the ones
:mod:`cg_pipelines.jetstream.reconcile`'s module docstring states:

- covered: queued in the work queue, dead-lettered, replayed (``Cg-Replay-Of``), in the table
  (an old table's ``_seq`` rows), in a commit's recorded coverage, or at or below a partition's
  rebuild (``coverage_through``);
- the source has passed origin sequence ``s`` when a covered message at or after ``s`` predates
  the backlog scan (:attr:`ReconcileWindow.evidence`, the backlog, the table's rows), or the
  source is healthy (present, lag 0, contact within ``stall_after_s``) and ``s`` was published
  more than ``grace_s`` before the check;
- while commits are left to read (not ``caught_up``), a message above its partition's highest
  committed origin sequence is undecided (a later commit may cover it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

import numpy as np

from cg_pipelines.core.coverage import CommitCoverage, ReconcileCursor
from cg_pipelines.core.errors import UsageError
from cg_pipelines.core.reconcile import OriginGap, ReconcileReport, SourcingStall, judge

__all__ = ["ReconcileWindow", "SourceState", "fold_coverage", "judge_window"]

_EMPTY = np.array([], np.int64)


@dataclass(frozen=True)
class SourceState:
    """The work queue's source for the origin, as its stream info reported it.

    Attributes:
        present: the work queue has a source for the origin stream.
        lag: the source's ``lag`` (messages).
        active_s: seconds since the source's last contact (the server's ``active``, reported
            in nanoseconds, divided by 1e9); -1 when it never had contact.
    """

    present: bool
    lag: int = 0
    active_s: float = -1.0

    def healthy(self, stall_after_s: float) -> bool:
        """Present, no lag and in contact within ``stall_after_s`` seconds."""
        return self.present and self.lag == 0 and 0 <= self.active_s <= stall_after_s

    def state(self, stall_after_s: float) -> str:
        """``"no source"``, ``"stalled"`` (no contact within ``stall_after_s``) or
        ``"lagging"`` (:attr:`SourcingStall.state`)."""
        if not self.present:
            return "no source"
        return "stalled" if self.active_s < 0 or self.active_s > stall_after_s else "lagging"


@dataclass(frozen=True)
class ReconcileWindow:
    """What one check read (arrays of origin sequences are int64, any order unless said).

    Attributes:
        stream, group: the group.
        lo, hi: the origin window checked, inclusive (``hi < lo``: nothing to check).
        end: the last origin sequence the check aims at (the origin's last, or ``to_seq``).
        seqs: the window's origin sequences, ascending (one per stored message).
        parts: each one's group partition (-1: no filter matches).
        times_ns: each one's store time, nanoseconds since the epoch.
        queued: origin sequences in the work queue's backlog (read before the coverage).
        dead: origin sequences of the dead letters.
        replayed: origin sequences that replayed dead letters (``Cg-Replay-Of``) name.
        in_table: origin sequences the table's ``_seq`` column holds in the window.
        source: the work queue's source (:class:`SourceState`).
        evidence: the highest origin sequence known sourced before the backlog scan (from
            commits read by earlier checks or of work-queue messages stored before it).
        caught_up: every recorded commit was read.
        versions_read: commits (table versions) this check read.
        now_s: the check's clock, seconds since the epoch.
        grace_s: seconds a message may take to be sourced.
        stall_after_s: seconds without contact after which the source counts as stalled.
    """

    stream: str
    group: str
    lo: int
    hi: int
    end: int
    seqs: np.ndarray
    parts: np.ndarray
    times_ns: np.ndarray
    source: SourceState
    queued: np.ndarray = field(default_factory=lambda: _EMPTY)
    dead: np.ndarray = field(default_factory=lambda: _EMPTY)
    replayed: np.ndarray = field(default_factory=lambda: _EMPTY)
    in_table: np.ndarray = field(default_factory=lambda: _EMPTY)
    evidence: int = 0
    caught_up: bool = True
    versions_read: int = 0
    now_s: float = 0.0
    grace_s: float = 10.0
    stall_after_s: float = 30.0


def fold_coverage(cursor: ReconcileCursor, commits: list[CommitCoverage], wq_top: int,
                  evidence: int) -> int:
    """Add ``commits``' recorded coverage to ``cursor`` (in place) and return the evidence that
    the source passed an origin sequence: the larger of ``evidence`` and the last origin
    sequence of each commit whose last work-queue sequence is at or below ``wq_top`` (the work
    queue's last sequence when the check began, so that message was sourced before the
    backlog scan)."""
    for c in commits:
        if c.seqs is not None:
            cursor.add_covered(c.seqs, c.partition)
            if c.wq_last is not None and c.wq_last <= wq_top and len(c.seqs):
                evidence = max(evidence, int(c.seqs[-1]))
        if c.through is not None:
            cursor.add_rebuilt(c.partition, c.through)
    return evidence


def _i64(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.int64)


def judge_window(w: ReconcileWindow, cursor: ReconcileCursor) -> ReconcileReport:
    """Judge window ``w`` against ``cursor`` (see the module docstring): record its gaps in the
    cursor, advance the cursor to the last settled origin sequence (before the first message
    that cannot be decided yet), and return the report (``gaps``: every open gap the cursor
    knows; ``partial``: the window stopped short of :attr:`ReconcileWindow.end` or commits are
    left to read).

    Raises:
        UsageError: ``seqs``, ``parts`` and ``times_ns`` differ in length.
    """
    seqs, parts, times = _i64(w.seqs), _i64(w.parts), _i64(w.times_ns)
    if len(times) != len(seqs):
        raise UsageError(f"{len(seqs)} origin sequences but {len(times)} store times")
    queued, dead, replayed, in_table = (_i64(w.queued), _i64(w.dead), _i64(w.replayed),
                                        _i64(w.in_table))
    extra = np.concatenate([queued, dead, replayed, in_table])
    cov = np.isin(seqs, extra) | np.isin(seqs, cursor.covered())
    for p, through in cursor.rebuilt.items():
        cov |= (parts == p) & (seqs <= through)
    top = max(w.evidence, int(queued.max()) if len(queued) else 0,
              int(in_table.max()) if len(in_table) else 0)  # an old table's rows: trusted
    sourced = seqs <= top
    if w.source.healthy(w.stall_after_s):
        sourced = sourced | (times < int((w.now_s - w.grace_s) * 1e9))
    if w.caught_up or not len(seqs):
        undecided = np.zeros(len(seqs), bool)
    else:  # each message's partition's highest committed origin sequence, looked up
        lut = np.zeros(max([int(parts.max()), *cursor.committed]) + 2, np.int64)
        for p, c in cursor.committed.items():
            lut[p] = c
        undecided = seqs > lut[parts]  # parts -1 reads the last slot: 0
    j = judge(seqs, parts, cov, sourced=sourced, undecided=undecided)
    matching = parts >= 0
    expected = seqs[matching]

    def count(covered: np.ndarray) -> int:
        return int(np.isin(expected, covered).sum())

    elsewhere = np.isin(seqs, extra)
    in_commits = int((cov & matching & ~elsewhere).sum()) + count(in_table)
    if len(j.gap_seqs):
        cursor.add_gaps(j.gap_seqs, j.gap_parts, j.runs)
    settled = int(seqs[j.stop]) - 1 if j.stop < len(seqs) else w.hi
    if w.hi >= w.lo:
        cursor.advance(settled)
    stall = None
    if j.not_yet_sourced and j.first_unsourced is not None:
        first_i = int(np.flatnonzero(seqs == j.first_unsourced)[0])
        since = datetime.fromtimestamp(int(times[first_i]) / 1e9, UTC).isoformat(
            timespec="seconds")
        stall = SourcingStall(w.source.state(w.stall_after_s), since, j.not_yet_sourced,
                              j.first_unsourced, w.source.lag, round(w.source.active_s, 3))
    return ReconcileReport(
        w.stream, w.group, w.lo, settled if w.hi >= w.lo else w.hi, len(seqs),
        int(matching.sum()), count(queued), in_commits, count(dead), count(replayed),
        [OriginGap(*g) for g in cursor.gap_runs()], j.not_yet_sourced, w.source.lag,
        settled < w.end or not w.caught_up, stall, w.versions_read, w.caught_up,
        cursor.gaps_untracked)
