"""Pure decisions behind the Dagster sensors and schedule (no I/O; table-tested).

- :func:`backlog_requests`: which partitions to run for their backlog, with a run key
  ``<group>:<p>:<first pending seq>`` so a retried tick for the same backlog is one run and a
  new backlog (a new first sequence) is a new run.
- :func:`gained_partitions`: after a membership change, the partitions the served members gained.
- Membership cursors: ``{"rev": <KV revision>, "assignment": {...}}`` as compact JSON.
- How a tick reads the backlog: :func:`use_subject_counts` (list the work-queue stream's subject
  counts first, or not) and :func:`pending_by_partition` (those counts summed per partition).
- :func:`summary_lines`: a tick's log lines, capped.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from cg_pipelines.core.assignment import moved_partitions, owners


@dataclass(frozen=True, slots=True)
class PartitionBacklog:
    """A partition's backlog: ``pending`` messages, the first one's sequence and age (seconds).

    ``first_seq`` is ``None`` (and ``age_s`` 0) when nothing is pending.
    """

    partition: int
    pending: int
    first_seq: int | None
    age_s: float


@dataclass(frozen=True, slots=True)
class BacklogRequest:
    partition: int
    run_key: str
    reason: str


def backlog_requests(
    group: str,
    backlog: Sequence[PartitionBacklog],
    *,
    min_pending: int = 1,
    max_age_s: float | None = None,
    partitions: Iterable[int] | None = None,
) -> list[BacklogRequest]:
    """Partitions to run: ``pending >= min_pending``, or any pending message older than
    ``max_age_s`` seconds. Only ``partitions`` (default: all) are considered; one request per
    partition, in partition order. Raises ``ValueError`` if ``min_pending < 1``.
    """
    if min_pending < 1:
        raise ValueError(f"min_pending must be >= 1, got {min_pending}")
    allowed = None if partitions is None else set(partitions)
    out: dict[int, BacklogRequest] = {}
    for b in backlog:
        if b.first_seq is None or b.pending <= 0 or (allowed is not None and
                                                     b.partition not in allowed):
            continue
        if b.pending >= min_pending:
            reason = f"{b.pending} pending >= {min_pending}"
        elif max_age_s is not None and b.age_s >= max_age_s:
            reason = f"oldest pending message {b.age_s:.0f} s old >= {max_age_s:g} s"
        else:
            continue
        out.setdefault(b.partition, BacklogRequest(
            b.partition, f"{group}:{b.partition}:{b.first_seq}", reason))
    return [out[p] for p in sorted(out)]


SUBJECTS_PER_PARTITION = 8
"""Listing the work-queue stream's subject counts pays when it has at most this many distinct
subjects per partition asked for. Measured (bench/sensor_ticks.py and loopback reads, 2 cores,
nats-server 2.15.1): the listing costs about 1-1.5 µs per subject at a few thousand subjects and
4-5 µs per subject at hundreds of thousands (paged, 100,000 per answer); a partition's direct
get about 60 µs (all of a tick's on one reply subscription). At 8 subjects per partition the
listing adds at most ~20% to a read where every partition has a backlog, and saves one direct
get per partition without one (a read of 256 partitions with backlog on 10% of them: 2.7 ms
instead of 16 ms)."""

MAX_LISTED_SUBJECTS = 100_000
"""Never list more subjects than one answer of the server holds."""


def use_subject_counts(num_subjects: int, partitions: int) -> bool:
    """Whether a backlog read should list the stream's subject counts first (to skip the direct
    gets of partitions without messages): when the stream has at most
    :data:`SUBJECTS_PER_PARTITION` subjects per partition asked for, at most
    :data:`MAX_LISTED_SUBJECTS`, and more than one partition is asked for."""
    return (partitions > 1 and 0 < num_subjects <= MAX_LISTED_SUBJECTS
            and num_subjects <= SUBJECTS_PER_PARTITION * partitions)


def pending_by_partition(subject_counts: Mapping[str, int]) -> dict[int, int]:
    """Messages per partition from a work-queue stream's per-subject counts (subjects
    ``<p>.<origin subject>``): ``{partition: messages}``, partitions with messages only.
    Subjects not of that form are ignored."""
    out: dict[int, int] = {}
    for subject, n in subject_counts.items():
        head, dot, rest = subject.partition(".")
        if not (dot and rest and head.isascii() and head.isdigit()) or (
                len(head) > 1 and head[0] == "0"):
            continue
        count = int(n)
        if count > 0:
            p = int(head)
            out[p] = out.get(p, 0) + count
    return out


def summary_lines(lines: Sequence[str], limit: int = 20) -> list[str]:
    """At most ``limit`` of ``lines``, then ``"... and <k> more"`` for the ``k`` left out
    (a tick of a group with hundreds of partitions logs a bounded number of lines)."""
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if len(lines) <= limit:
        return list(lines)
    return [*lines[:limit], f"... and {len(lines) - limit} more"]


def gained_partitions(
    old: Mapping[str, Sequence[int]],
    new: Mapping[str, Sequence[int]],
    served: Iterable[str] | None,
) -> dict[int, tuple[str | None, str]]:
    """Partitions whose new owner is served here and differs from the old one:
    ``{partition: (old_owner, new_owner)}``. ``served=None`` means every member."""
    allowed = None if served is None else set(served)
    return {p: (o, n) for p, (o, n) in moved_partitions(old, new).items()
            if n is not None and (allowed is None or n in allowed)}


def served_partitions(assign: Mapping[str, Sequence[int]], served: Iterable[str] | None
                      ) -> list[int]:
    """Partitions owned by a served member (``None``: all owned partitions), sorted."""
    allowed = None if served is None else set(served)
    return sorted(p for p, m in owners(assign).items() if allowed is None or m in allowed)


def encode_membership_cursor(revision: int, assign: Mapping[str, Sequence[int]]) -> str:
    """Cursor text for the membership sensor."""
    return json.dumps({"rev": revision, "assignment": {m: list(ps) for m, ps in
                                                       sorted(assign.items())}},
                      separators=(",", ":"))


def decode_membership_cursor(cursor: str | None) -> tuple[int, dict[str, list[int]]]:
    """``(revision, assignment)``; ``(0, {})`` for no cursor. Raises ``ValueError`` if corrupt."""
    if not cursor:
        return 0, {}
    try:
        obj = json.loads(cursor)
        return int(obj["rev"]), {str(m): [int(p) for p in ps]
                                 for m, ps in obj["assignment"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"corrupt membership cursor {cursor[:80]!r}: {e}") from None
