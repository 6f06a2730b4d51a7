"""Origin <-> work-queue reconciliation: which origin messages of an elastic group never reached
its work queue (pure: no I/O; :mod:`cg_pipelines.jetstream.reconcile` reads the streams).

An origin message the group's partitioning filters match must have reached the work-queue
stream ``<stream>-<group>``. Afterwards it is in exactly one of these places, each of which
names its origin sequence:

- still in the work queue (sourced messages carry ``Nats-Stream-Source``: ``<origin> <seq> ...``);
- committed to the table (each row's ``_seq`` is its message's origin sequence);
- in the dead-letter stream (``Cg-Origin-Sequence``);
- replayed from the dead-letter stream into the origin (the copy's ``Cg-Replay-Of`` header).

A matching origin message in none of them is a **gap**: it never reached the work queue (the
nats-server 2.15.1 sourcing fail-over defect of docs/upstream-sourcing-gap.md), or was removed
from the work queue without being processed. Gaps are reported as runs of consecutive missing
messages (among the matching ones) with the partitions they belong to; the repair is a rebuild
of those partitions from the origin stream (:func:`cg_pipelines.engine.rebuild.rebuild_partition`).

While the work queue's source still lags (messages not sourced yet), the missing messages after
the last covered one are "not yet sourced", not gaps: sourcing is in origin order.

Caveats: a transform that drops messages (no row with their ``_seq``) makes them look missing;
dead letters purged from the dead-letter stream lose their coverage too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["ORIGIN_SEQ_HEADER", "REPLAY_OF_HEADER", "OriginGap", "ReconcileReport", "find_gaps"]

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
        ValueError: ``origin_seqs`` and ``partitions`` differ in length.
    """
    seqs = np.asarray(origin_seqs, dtype=np.int64)
    parts = np.asarray(partitions, dtype=np.int64)
    if seqs.shape != parts.shape:
        raise ValueError(f"{len(seqs)} origin sequences but {len(parts)} partitions")
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
class ReconcileReport:
    """The result of one reconciliation of an elastic group over an origin sequence window.

    Attributes:
        stream, group: the group.
        from_seq, to_seq: the origin window checked (inclusive; ``to_seq < from_seq`` when the
            origin stream is empty).
        origin_messages: messages read in the window; ``expected``: those the group's filters
            match.
        in_queue, in_table, in_dlq, replayed: matching messages covered by each place (a message
            may count in two while a run commits).
        gaps: matching messages found nowhere (see the module docstring).
        not_yet_sourced: missing messages at the window's end left out because the source
            lagged (``source_lag`` messages behind when read).
        partial: True when the window stopped short of the origin's last sequence (``max``
            messages per check): continue from ``to_seq + 1``.
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

    @property
    def ok(self) -> bool:
        """No gap."""
        return not self.gaps

    @property
    def missing(self) -> int:
        """Matching messages found nowhere, in all gaps."""
        return sum(g.messages for g in self.gaps)

    @property
    def partitions(self) -> list[int]:
        """Partitions with a gap (the ones to rebuild), ascending."""
        return sorted({p for g in self.gaps for p in g.partitions})

    def text(self) -> str:
        """One line: ``ok`` with the counts, or the gaps with origin ranges and partitions and
        the repair."""
        wq = f"{self.stream}-{self.group}"
        window = f"origin sequences {self.from_seq}..{self.to_seq}"
        if self.ok:
            more = (f"; {self.not_yet_sourced} not yet sourced (source lag {self.source_lag})"
                    if self.not_yet_sourced else "")
            return (f"{self.stream}.{self.group}: ok: {window}: {self.expected} of "
                    f"{self.origin_messages} messages match the group, all reached {wq} "
                    f"({self.in_queue} queued, {self.in_table} in the table, {self.in_dlq} "
                    f"dead-lettered, {self.replayed} replayed){more}")
        shown = "; ".join(g.text() for g in self.gaps[:10])
        if len(self.gaps) > 10:
            shown += f"; +{len(self.gaps) - 10} more gaps"
        return (f"{self.stream}.{self.group}: {self.missing} origin message(s) never reached "
                f"{wq} (checked {window}): {shown}; repair: rebuild partition(s) "
                f"{', '.join(map(str, self.partitions))} from the origin stream")

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
            "gaps": [{"first_seq": g.first_seq, "last_seq": g.last_seq,
                      "messages": g.messages, "partitions": list(g.partitions)}
                     for g in self.gaps],
        }
