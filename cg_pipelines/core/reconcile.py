"""Origin <-> work-queue reconciliation: which origin messages of an elastic group were never
accounted for (pure: no I/O; :mod:`cg_pipelines.jetstream.reconcile` reads the streams and the
coverage, :mod:`cg_pipelines.core.coverage` holds the codec and the cursor).

An origin message the group's partitioning filters match must reach the work-queue stream
``<stream>-<group>``. Afterwards it is in exactly one of these places, each of which names its
origin sequence:

- still in the work queue (sourced messages carry ``Nats-Stream-Source``: ``<origin> <seq> ...``);
- settled by a commit: every drain commit records the origin sequences of all the messages it
  settled (rows written, dead-lettered, filtered out by the transform: ``cg.coverage``), a
  rebuild records that it covers its partition through an origin sequence
  (``cg.coverage_through``); so merge tables and filtering transforms are covered exactly;
- in the dead-letter stream (``Cg-Origin-Sequence``);
- replayed from the dead-letter stream into the origin (the copy's ``Cg-Replay-Of`` header).

A matching origin message in none of them is a **gap** only when the work queue's source has
already passed it (:func:`judge`): it never reached the work queue (the nats-server 2.15.1
sourcing fail-over defect of docs/upstream-sourcing-gap.md), or was removed from the work queue
without being processed. Gaps are reported as runs of consecutive missing messages (among the
matching ones) with the partitions they belong to; the repair is a rebuild of those partitions
from the origin stream (:func:`cg_pipelines.engine.rebuild.rebuild_partition`, which replays
through the origin's last sourced message, so tail gaps are repaired too).

A message the source has not passed yet is **not yet sourced**: while the source is removed,
inactive or lagging that is a :class:`SourcingStall` with its own state and advice, never a
gap. See docs/reconcile.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cg_pipelines.core.errors import UsageError

__all__ = ["ORIGIN_SEQ_HEADER", "REPLAY_OF_HEADER", "Judgement", "OriginGap", "ReconcileReport",
           "SourcingStall", "find_gaps", "judge"]

ORIGIN_SEQ_HEADER = "Cg-Origin-Sequence"
"""Header of a dead letter: the origin stream sequence of the message (when known)."""

REPLAY_OF_HEADER = "Cg-Replay-Of"
"""Header of a dead letter replayed into the origin stream: the origin sequence of the message
it replays."""


@dataclass(frozen=True)
class OriginGap:
    """Consecutive matching origin messages (none covered in between) that are nowhere.

    Attributes:
        first_seq, last_seq: origin stream sequences of the first and last missing message.
        messages: how many matching messages are missing in that range.
        partitions: the group partitions they belong to, ascending.
    """

    first_seq: int
    last_seq: int
    messages: int
    partitions: tuple[int, ...]

    def text(self) -> str:
        rng = (f"origin sequence {self.first_seq}" if self.first_seq == self.last_seq
               else f"origin sequences {self.first_seq}..{self.last_seq}")
        parts = ", ".join(map(str, self.partitions))
        return (f"{rng} ({self.messages} message{'s' if self.messages != 1 else ''}, "
                f"partition{'s' if len(self.partitions) != 1 else ''} {parts})")


def find_gaps(
    origin_seqs: Sequence[int] | np.ndarray,
    partitions: Sequence[int] | np.ndarray,
    covered: Sequence[int] | np.ndarray,
    *,
    sourcing_done: bool = True,
) -> tuple[list[OriginGap], int]:
    """The gaps among matching origin messages.

    Args:
        origin_seqs: origin sequences of the window's messages, ascending.
        partitions: each one's group partition, ``-1`` for a message no filter matches (never
            expected in the work queue).
        covered: origin sequences known to have reached the work queue (any order, repeats
            allowed).
        sourcing_done: the work queue's source had no lag when the window was read; when False,
            missing messages after the last covered matching one are "not yet sourced".

    Returns:
        ``(gaps, not_yet_sourced)``: the gaps in origin order, and how many missing messages
        were left out as not yet sourced.

    Raises:
        UsageError: ``origin_seqs`` and ``partitions`` differ in length.
    """
    seqs = np.asarray(origin_seqs, dtype=np.int64)
    parts = np.asarray(partitions, dtype=np.int64)
    if seqs.shape != parts.shape:
        raise UsageError(f"{len(seqs)} origin sequences but {len(parts)} partitions")
    want = parts >= 0
    seqs, parts = seqs[want], parts[want]
    if not len(seqs):
        return [], 0
    have = np.isin(seqs, np.asarray(covered, dtype=np.int64))
    missing = ~have
    tail = 0
    if not sourcing_done:
        last_covered = np.flatnonzero(have)
        cut = int(last_covered[-1]) + 1 if len(last_covered) else 0
        tail = int(missing[cut:].sum())
        missing[cut:] = False
    gaps: list[OriginGap] = []
    idx = np.flatnonzero(missing)
    if not len(idx):
        return gaps, tail
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    for run in np.split(idx, breaks):
        gaps.append(OriginGap(int(seqs[run[0]]), int(seqs[run[-1]]), len(run),
                              tuple(int(p) for p in np.unique(parts[run]))))
    return gaps, tail


@dataclass(frozen=True)
class Judgement:
    """What :func:`judge` decided about a window of origin messages.

    Attributes:
        stop: index of the first message that cannot be decided yet (``len`` when all were):
            the window is settled before it.
        gap_seqs, gap_parts: origin sequences and partitions of the gaps before ``stop``.
        runs: the gaps as runs ``(first, last)`` of consecutive missing matching messages.
        not_yet_sourced: matching messages the work queue's source has not passed yet.
        first_unsourced: the first of them (origin sequence), or None.
        waiting: uncovered matching messages of partitions whose commits are not all read yet.
    """

    stop: int
    gap_seqs: np.ndarray
    gap_parts: np.ndarray
    runs: list[tuple[int, int]]
    not_yet_sourced: int
    first_unsourced: int | None
    waiting: int


def judge(
    origin_seqs: Sequence[int] | np.ndarray,
    partitions: Sequence[int] | np.ndarray,
    covered: Sequence[bool] | np.ndarray,
    *,
    sourced: Sequence[bool] | np.ndarray,
    undecided: Sequence[bool] | np.ndarray | None = None,
) -> Judgement:
    """Decide, in origin order, which matching messages of a window are gaps.

    Args:
        origin_seqs: the window's origin sequences, ascending.
        partitions: each one's group partition (-1: no filter matches: never expected).
        covered: each one is accounted for (queued, committed, dead-lettered, replayed).
        sourced: the work queue's source has passed each one.
        undecided: a commit not read yet may still cover each one (default: none).

    A matching message that is not ``covered`` is a **gap** only when it is ``sourced`` and not
    ``undecided``; otherwise it is not decided yet, and neither is anything after it (the
    window is settled up to the message before, so a later check resumes there). Messages the
    source has not passed are counted as not yet sourced, never as gaps.

    Raises:
        UsageError: the arrays differ in length.
    """
    seqs = np.asarray(origin_seqs, dtype=np.int64)
    parts = np.asarray(partitions, dtype=np.int64)
    cov = np.asarray(covered, dtype=bool)
    src = np.asarray(sourced, dtype=bool)
    und = np.zeros(len(seqs), bool) if undecided is None else np.asarray(undecided, bool)
    if not (len(seqs) == len(parts) == len(cov) == len(src) == len(und)):
        raise UsageError(f"{len(seqs)} origin sequences, {len(parts)} partitions, "
                         f"{len(cov)} covered, {len(src)} sourced and {len(und)} undecided "
                         "flags")
    miss = (parts >= 0) & ~cov
    unsourced = miss & ~src
    blocked = unsourced | (miss & und)
    hit = np.flatnonzero(blocked)
    stop = int(hit[0]) if len(hit) else len(seqs)
    idx = np.flatnonzero(miss[:stop])
    runs: list[tuple[int, int]] = []
    if len(idx):
        # consecutive among the matching messages: a covered matching message breaks a run
        rank = np.cumsum(parts >= 0)[idx]
        breaks = np.flatnonzero(np.diff(rank) != 1) + 1
        runs = [(int(seqs[r[0]]), int(seqs[r[-1]])) for r in np.split(idx, breaks)]
    first = np.flatnonzero(unsourced)
    return Judgement(stop, seqs[idx], parts[idx], runs, int(unsourced.sum()),
                     int(seqs[first[0]]) if len(first) else None,
                     int((miss & und & ~unsourced).sum()))


@dataclass(frozen=True)
class SourcingStall:
    """The work queue's source is behind the origin: messages it has not passed yet are not
    gaps (they arrive when sourcing resumes).

    Attributes:
        state: ``"stalled"`` (the source is inactive: no contact, or none for
            ``stall_after_s``), ``"lagging"`` (active, still catching up) or ``"no source"``
            (the work queue has no source for the origin).
        since: UTC time (ISO 8601) the first message not sourced yet was published, or ""
            when unknown.
        not_yet_sourced: matching messages not sourced yet in the checked window.
        first_seq: origin sequence of the first of them.
        lag, active_s: the source's ``lag`` (messages) and seconds since its last contact
            (-1: none) as the server reported them.
    """

    state: str
    since: str
    not_yet_sourced: int
    first_seq: int | None
    lag: int
    active_s: float

    def text(self) -> str:
        since = f" since {self.since}" if self.since else ""
        where = f" from origin sequence {self.first_seq}" if self.first_seq is not None else ""
        advice = ("restore the work queue's source (cg group repair, or the stream config)"
                  if self.state == "no source" else
                  "not a gap, nothing to rebuild: it resumes by itself (nats-server 2.15.1 "
                  "resumes a stalled source within about a minute, see "
                  "docs/upstream-sourcing-gap.md); if it stays stalled, check the work "
                  "queue's sources in its stream info")
        what = ("stopped" + since + " (the work queue has no source for the origin)"
                if self.state == "no source" else self.state + since)
        return (f"sourcing {what}: {self.not_yet_sourced} matching message(s)"
                f"{where} not in the work queue yet (source lag {self.lag}, active "
                f"{self.active_s:g} s); {advice}")


@dataclass(frozen=True)
class ReconcileReport:
    """The result of one reconciliation of an elastic group over an origin sequence window.

    Attributes:
        stream, group: the group.
        from_seq, to_seq: the origin window checked (inclusive; ``to_seq < from_seq`` when the
            origin stream is empty).
        origin_messages: messages read in the window; ``expected``: those the group's filters
            match.
        in_queue, in_table, in_dlq, replayed: matching messages covered by each place
            (``in_table``: settled by a commit's recorded coverage, or the table's rows when
            asked; a message may count in two while a run commits).
        gaps: the open gaps (see the module docstring): with a cursor, all it knows, not only
            this window's.
        not_yet_sourced: matching messages the source has not passed yet (``source_lag``: the
            source's lag when read).
        partial: True when the check should go on: the window stopped short of the end, or
            Delta versions are left to read.
        stall: the source is behind (:class:`SourcingStall`), or None.
        versions_read: Delta versions whose coverage this check read.
        caught_up: every Delta version was read (else the next check goes on reading).
        gaps_untracked: gap messages beyond the cursor's bound (counted, not listed).
    """

    stream: str
    group: str
    from_seq: int
    to_seq: int
    origin_messages: int
    expected: int
    in_queue: int
    in_table: int
    in_dlq: int
    replayed: int
    gaps: list[OriginGap] = field(default_factory=list)
    not_yet_sourced: int = 0
    source_lag: int = 0
    partial: bool = False
    stall: SourcingStall | None = None
    versions_read: int = 0
    caught_up: bool = True
    gaps_untracked: int = 0

    @property
    def ok(self) -> bool:
        """No gap."""
        return not self.gaps

    @property
    def missing(self) -> int:
        """Matching messages found nowhere, in all gaps."""
        return sum(g.messages for g in self.gaps) + self.gaps_untracked

    @property
    def partitions(self) -> list[int]:
        """Partitions with a gap (the ones to rebuild), ascending."""
        return sorted({p for g in self.gaps for p in g.partitions})

    def text(self) -> str:
        """One line: ``ok`` with the counts, or the gaps with origin ranges and partitions and
        the repair."""
        wq = f"{self.stream}-{self.group}"
        window = f"origin sequences {self.from_seq}..{self.to_seq}"
        stall = f"; {self.stall.text()}" if self.stall is not None else ""
        if self.ok:
            more = (f"; {self.not_yet_sourced} not yet sourced (source lag {self.source_lag})"
                    if self.not_yet_sourced and self.stall is None else "") + stall
            return (f"{self.stream}.{self.group}: ok: {window}: {self.expected} of "
                    f"{self.origin_messages} messages match the group, all reached {wq} "
                    f"({self.in_queue} queued, {self.in_table} committed, {self.in_dlq} "
                    f"dead-lettered, {self.replayed} replayed){more}")
        shown = "; ".join(g.text() for g in self.gaps[:10])
        if len(self.gaps) > 10:
            shown += f"; +{len(self.gaps) - 10} more gaps"
        return (f"{self.stream}.{self.group}: {self.missing} origin message(s) never reached "
                f"{wq} (checked {window}): {shown}; repair: rebuild partition(s) "
                f"{', '.join(map(str, self.partitions))} from the origin stream "
                f"(rebuild_partition; in Dagster the asset's _rebuild job){stall}")

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields (``ok``, ``missing``, ``partitions`` included)."""
        return {
            "stream": self.stream, "group": self.group, "ok": self.ok,
            "from_seq": self.from_seq, "to_seq": self.to_seq,
            "origin_messages": self.origin_messages, "expected": self.expected,
            "in_queue": self.in_queue, "in_table": self.in_table, "in_dlq": self.in_dlq,
            "replayed": self.replayed, "missing": self.missing,
            "partitions": self.partitions, "not_yet_sourced": self.not_yet_sourced,
            "source_lag": self.source_lag, "partial": self.partial,
            "stall": None if self.stall is None else {
                "state": self.stall.state, "since": self.stall.since,
                "not_yet_sourced": self.stall.not_yet_sourced, "first_seq": self.stall.first_seq,
                "lag": self.stall.lag, "active_s": self.stall.active_s,
                "text": self.stall.text()},
            "versions_read": self.versions_read, "caught_up": self.caught_up,
            "gaps": [{"first_seq": g.first_seq, "last_seq": g.last_seq,
                      "messages": g.messages, "partitions": list(g.partitions)}
                     for g in self.gaps],
        }
