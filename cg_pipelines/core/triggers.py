"""Pure decisions behind the Dagster sensors and schedule (no I/O; table-tested).

- :func:`backlog_requests`: which partitions to run for their backlog, with a run key
  ``<group>:<p>:<first pending seq>`` so a retried tick for the same backlog is one run and a
  new backlog (a new first sequence) is a new run.
- :func:`gained_partitions`: after a membership change, the partitions the served members gained.
- Sensor cursors, one codec for both sensors: :class:`MembershipCursor` and
  :class:`BacklogCursor`, written by :func:`encode_cursor` and read back by
  :func:`decode_cursor`, which raises :class:`CursorError` for anything it did not write.
- How a tick reads the backlog: :func:`use_subject_counts` (list the work-queue stream's subject
  counts first, or not) and :func:`pending_by_partition` (those counts summed per partition).
- :func:`summary_lines`: a tick's log lines, capped.
- :func:`plan_backlog_runs`: the backlog rule plus retries — a partition whose last run failed
  is requested again after a bounded exponential backoff (:class:`RetryPolicy`) under a new
  run key (Dagster de-duplicates a sensor's run keys forever), and is reported instead of
  retried once it failed :attr:`RetryPolicy.max_failures` times in a row under the same code.
- Lag (objective breaches, which lag observations to record, the bound that keeps):
  :mod:`cg_pipelines.core.lag`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from cg_pipelines.core.assignment import moved_partitions, owners
from cg_pipelines.core.errors import ConfigError, DecodeError, UsageError


@dataclass(frozen=True, slots=True)
class PartitionBacklog:
    """A partition's backlog: ``pending`` messages, the first one's sequence and age (seconds).

    ``first_seq`` is ``None`` (and ``age_s`` 0) when nothing is pending. ``first_time_s``: the
    first pending message's store time (Unix seconds), when the reader knows it: the exact
    timestamp behind ``age_s`` (which is relative to the moment of the read).
    """

    partition: int
    pending: int
    first_seq: int | None
    age_s: float
    first_time_s: float | None = None

    def oldest_pending_time(self, now: float) -> float:
        """Unix seconds of the oldest pending message: ``first_time_s``, else ``now - age_s``
        (``now``: the time ``age_s`` was measured at, about)."""
        return self.first_time_s if self.first_time_s is not None else now - self.age_s


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
    partition, in partition order. Raises ``UsageError`` if ``min_pending < 1``.
    """
    if min_pending < 1:
        raise UsageError(f"min_pending must be >= 1, got {min_pending}")
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
        raise UsageError(f"limit must be >= 0, got {limit}")
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


# --------------------------------------------------------------------------------------------
# Sensor cursors: one codec
# --------------------------------------------------------------------------------------------


class CursorError(DecodeError):
    """A sensor cursor that :func:`decode_cursor` cannot read back: not JSON, not a JSON object,
    or a field of the wrong shape. ``str(err)`` names the cursor kind, its first 80 characters
    and the problem. A sensor recovers by starting over from an empty cursor (and says so)."""


@dataclass(frozen=True, slots=True)
class MembershipCursor:
    """The membership sensor's cursor: the group's KV ``revision`` last acted on (0: none)
    and the ``assignment`` (``{member: [partitions]}``) it had then.

    JSON: ``{"rev": <revision>, "assignment": {<member>: [<p>, ...]}}``."""

    revision: int = 0
    assignment: dict[str, list[int]] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {"rev": self.revision,
                "assignment": {m: list(ps) for m, ps in sorted(self.assignment.items())}}

    @classmethod
    def from_json(cls, obj: Mapping[str, object]) -> MembershipCursor:
        """Raises ``KeyError``, :class:`CursorError` or ``ValueError`` for a wrong shape
        (:func:`decode_cursor` turns them into :class:`CursorError`)."""
        return cls(_int(obj["rev"]), {str(m): [_int(p) for p in _list(ps)]
                                      for m, ps in _object(obj["assignment"]).items()})


@dataclass(frozen=True, slots=True)
class BacklogCursor:
    """The backlog sensor's cursor.

    Attributes:
        observed: :func:`lag_observations_due`'s state, ``{str(partition): [pending,
            first_seq, observed_at, state, budget, tick_first_seq]}`` (``observed_at`` in
            Unix seconds).
        reconciled_at: when ``origin_reconciled`` was last evaluated (Unix seconds, 0: never).
        dead_letters: ``{partition: dead letters}`` as last observed.
        errors: ``{run_id: error}`` of the partitions' newest failed runs (a cache, bounded by
            the partitions).
        requested: ``{partition: (run key, Unix seconds)}``: the run key last requested for
            each partition with a backlog, and when (:func:`drop_repeated_requests`).

    JSON: ``{"observed": ..., "reconciled_at": ..., "dead_letters": {"<p>": n}, "errors":
    ..., "requested": {"<p>": [key, at]}}``; missing fields read as empty."""

    observed: dict[str, list[float | int | None]] = field(default_factory=dict)
    reconciled_at: float = 0.0
    dead_letters: dict[int, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    requested: dict[int, tuple[str, float]] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {"observed": self.observed, "reconciled_at": self.reconciled_at,
                "dead_letters": {str(p): n for p, n in self.dead_letters.items()},
                "errors": self.errors,
                "requested": {str(p): [k, at] for p, (k, at) in self.requested.items()}}

    @classmethod
    def from_json(cls, obj: Mapping[str, object]) -> BacklogCursor:
        """Raises :class:`CursorError` or ``ValueError`` for a wrong shape (:func:`decode_cursor`
        turns them into :class:`CursorError`)."""
        return cls(
            {str(p): [None if x is None else _number(x) for x in _list(v)]
             for p, v in _object(obj.get("observed") or {}).items()},
            _number(obj.get("reconciled_at") or 0.0),
            {_int(p): _int(n) for p, n in _object(obj.get("dead_letters") or {}).items()},
            {str(r): str(e) for r, e in _object(obj.get("errors") or {}).items()},
            {_int(p): _key_at(v) for p, v in _object(obj.get("requested") or {}).items()})


def _key_at(x: object) -> tuple[str, float]:
    key, at = _list(x)
    if not isinstance(key, str):
        raise CursorError(f"expected a run key string, got {type(key).__name__}")
    return key, float(_number(at))


def _object(x: object) -> dict[str, object]:
    if not isinstance(x, dict):
        raise CursorError(f"expected a JSON object, got {type(x).__name__}")
    return x


def _list(x: object) -> list[object]:
    if not isinstance(x, list):
        raise CursorError(f"expected a JSON array, got {type(x).__name__}")
    return x


def _int(x: object) -> int:
    if isinstance(x, bool) or not isinstance(x, int | str):
        raise CursorError(f"expected an integer, got {type(x).__name__}")
    return int(x)


def _number(x: object) -> float | int:
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise CursorError(f"expected a number, got {type(x).__name__}")
    return x


Cursor = MembershipCursor | BacklogCursor
_CursorT = TypeVar("_CursorT", MembershipCursor, BacklogCursor)


def encode_cursor(cursor: Cursor) -> str:
    """A sensor cursor as compact JSON (what Dagster stores as the sensor's cursor)."""
    return json.dumps(cursor.to_json(), separators=(",", ":"))


def decode_cursor(text: str | None, kind: type[_CursorT]) -> _CursorT:
    """The cursor of type ``kind`` that :func:`encode_cursor` wrote as ``text``; an empty
    ``kind()`` for no cursor (``None`` or ``""``).

    Raises:
        CursorError: ``text`` is not JSON, not a JSON object, or a field has the wrong shape.
    """
    if not text:
        return kind()
    what = "membership" if kind is MembershipCursor else "backlog"
    try:
        return kind.from_json(_object(json.loads(text)))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CursorError(f"corrupt {what} cursor {text[:80]!r}: "
                          f"{type(e).__name__}: {e}") from None


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How the backlog sensor and the drain schedule retry a partition whose runs fail.

    After the ``k``-th consecutive failed run (``k >= 1``) the partition is requested again
    once ``min(backoff_s * 2 ** (k - 1), max_backoff_s)`` seconds have passed since that run
    ended. After ``max_failures`` consecutive failures under the same code it is not retried:
    it is reported (a failing asset check and the tick's reason) until a run of it succeeds
    (launched by hand) or a new code version is loaded (failures under older code do not
    count), then it resumes by itself. Durations are seconds.

    Raises:
        ConfigError: ``max_failures < 1`` or ``0 < backoff_s <= max_backoff_s`` does not hold.
    """

    max_failures: int = 5
    backoff_s: float = 15.0
    max_backoff_s: float = 300.0

    def __post_init__(self) -> None:
        if self.max_failures < 1:
            raise ConfigError("max_failures", f"must be >= 1, got {self.max_failures}")
        if not 0 < self.backoff_s <= self.max_backoff_s:
            raise ConfigError("backoff_s", "need 0 < backoff_s <= max_backoff_s seconds, got "
                                           f"{self.backoff_s:g} and {self.max_backoff_s:g}")

    def backoff(self, failures: int) -> float:
        """Seconds to wait after the ``failures``-th consecutive failure (0 for none)."""
        if failures <= 0:
            return 0.0
        return min(self.backoff_s * 2.0 ** min(failures - 1, 60), self.max_backoff_s)


@dataclass(frozen=True, slots=True)
class PartitionRuns:
    """What the orchestrator knows of a partition's recent runs under the current code.

    Attributes:
        failures: consecutive failed runs, newest first, since the last successful one (runs
            of older code versions end the count).
        last_failed_at: when the newest failed run ended (Unix seconds), ``None`` without one.
        last_error: the newest failed run's error, one line (``""`` if unknown).
        in_progress: a run of the partition is queued or in progress.
        failed_before: some run failed since the last successful one, under any code
            (``failures > 0`` implies it).
    """

    failures: int = 0
    last_failed_at: float | None = None
    last_error: str = ""
    in_progress: bool = False
    failed_before: bool = False


@dataclass(frozen=True, slots=True)
class RetryWait:
    """A failed partition waiting out its backoff: retried in ``in_s`` seconds."""

    partition: int
    failures: int
    in_s: float
    last_error: str


@dataclass(frozen=True, slots=True)
class TickPlan:
    """A tick's decisions: runs to request, partitions waiting out a backoff, partitions
    given up on (``exhausted``: failed ``max_failures`` times in a row), partitions with
    backlog whose run is already ``in_progress``."""

    requests: list[BacklogRequest] = field(default_factory=list)
    waiting: list[RetryWait] = field(default_factory=list)
    exhausted: list[RetryWait] = field(default_factory=list)
    in_progress: list[int] = field(default_factory=list)

    def reason_lines(self, policy: RetryPolicy) -> list[str]:
        """One line per partition not requested for a reason an operator should see."""
        lines = [f"partition {w.partition}: failed {w.failures} time(s) in a row, the limit "
                 f"({policy.max_failures}); not retried until a run succeeds or new code is "
                 f"loaded; last error: {w.last_error or 'unknown'}" for w in self.exhausted]
        lines += [f"partition {w.partition}: failed {w.failures} time(s) in a row; retry in "
                  f"{w.in_s:.0f} s; last error: {w.last_error or 'unknown'}"
                  for w in self.waiting]
        lines += [f"partition {p}: a run is already queued or in progress"
                  for p in self.in_progress]
        return lines


def retry_run_key(group: str, partition: int, first_seq: int, runs: PartitionRuns,
                  code: str) -> str:
    """``<group>:<p>:<first pending seq>`` while no run failed since the last success (a
    retried tick for the same backlog is one run), else ``...:<code>:<failures>``: a new key
    for each retry and for each code version, so Dagster never de-duplicates a retry away."""
    base = f"{group}:{partition}:{first_seq}"
    if not (runs.failed_before or runs.failures):
        return base
    return f"{base}:{code}:{runs.failures}"


def plan_backlog_runs(
    group: str,
    backlog: Sequence[PartitionBacklog],
    runs: Mapping[int, PartitionRuns],
    policy: RetryPolicy,
    now: float,
    *,
    code: str = "",
    min_pending: int = 1,
    max_age_s: float | None = None,
    partitions: Iterable[int] | None = None,
) -> TickPlan:
    """The backlog rule (:func:`backlog_requests`) with retries.

    Args:
        group: the group's name (run keys start with it).
        backlog: the partitions' backlog.
        runs: the partitions' run history (missing: no runs).
        policy: the retry backoff and limit.
        now: the current time (Unix seconds).
        code: the current code version (part of a retry's run key).
        min_pending, max_age_s, partitions: as :func:`backlog_requests`.

    Returns:
        A :class:`TickPlan`: a partition with backlog and no failed run is requested as
        before; after ``k`` failures it is requested once the backoff has passed (reason
        ``"retry k/max ..."``), else listed as waiting; at ``max_failures`` it is listed as
        exhausted; with a run queued or in progress it is not requested.
    """
    plan = TickPlan()
    for req in backlog_requests(group, backlog, min_pending=min_pending, max_age_s=max_age_s,
                                partitions=partitions):
        h = runs.get(req.partition, PartitionRuns())
        first_seq = int(req.run_key.rsplit(":", 1)[1])
        if h.in_progress:
            plan.in_progress.append(req.partition)
            continue
        if h.failures >= policy.max_failures:
            plan.exhausted.append(RetryWait(req.partition, h.failures, 0.0, h.last_error))
            continue
        wait = 0.0
        if h.failures and h.last_failed_at is not None:
            wait = h.last_failed_at + policy.backoff(h.failures) - now
        if wait > 0:
            plan.waiting.append(RetryWait(req.partition, h.failures, wait, h.last_error))
            continue
        reason = req.reason if not h.failures else (
            f"retry {h.failures}/{policy.max_failures - 1} after {h.failures} failed run(s) "
            f"(backoff {policy.backoff(h.failures):g} s; last error: "
            f"{h.last_error or 'unknown'}); {req.reason}")
        plan.requests.append(BacklogRequest(
            req.partition, retry_run_key(group, req.partition, first_seq, h, code),
            reason))
    return plan


REPEAT_REQUEST_S = 300.0
"""Seconds: a run key requested for a partition is not requested again for this long
(:func:`drop_repeated_requests`)."""


def drop_repeated_requests(
    requests: Sequence[BacklogRequest],
    requested: Mapping[int, tuple[str, float]],
    pending: Iterable[int],
    now: float,
    repeat_s: float = REPEAT_REQUEST_S,
) -> tuple[list[BacklogRequest], int, dict[int, tuple[str, float]]]:
    """The requests worth sending, and the state to keep for the next tick.

    Dagster runs a run key once, ever (a sensor's repeated request for it is skipped after
    a run-records query), so a request whose run key was requested for the partition less
    than ``repeat_s`` seconds ago is dropped: while a partition's backlog waits for its run
    (queued behind the per-partition limit, or a run that ended ``held``) a tick neither
    builds nor sends its request again. After ``repeat_s`` it is sent again, in case the
    earlier request was lost (the tick that made it failed after its cursor was saved).

    Args:
        requests: the tick's planned requests (:attr:`TickPlan.requests`).
        requested: ``{partition: (run key, Unix seconds)}`` from the previous tick.
        pending: the partitions with a backlog now (the state keeps only them).
        now: Unix seconds.
        repeat_s: seconds.

    Returns:
        ``(to send, how many were dropped, new state)``.
    """
    now_pending = set(pending)
    keep = {p: v for p, v in requested.items() if p in now_pending}
    out: list[BacklogRequest] = []
    dropped = 0
    for r in requests:
        prev = keep.get(r.partition)
        if prev is not None and prev[0] == r.run_key and 0 <= now - prev[1] < repeat_s:
            dropped += 1
            continue
        out.append(r)
        keep[r.partition] = (r.run_key, now)
    return out, dropped, keep


def dead_slot(partitions: int, index: int, partition: int) -> int:
    """The key of input ``index``'s partition in a cursor's ``dead_letters``
    (``index * partitions + partition``: the partition itself for one input)."""
    return index * partitions + partition


def merge_backlog(by_input: Mapping[str, Sequence[PartitionBacklog]],
                  last_seqs: Mapping[str, int]) -> list[PartitionBacklog]:
    """The backlog per partition over the inputs (one input's as it is): ``pending`` summed,
    ``age_s`` the oldest, ``first_seq`` the sum of each input's next unprocessed sequence (its
    first pending one, or its work queue's last + 1, ``last_seqs``): it changes exactly when
    some input's first pending message does, so the run key does."""
    names = list(by_input)
    if len(names) == 1:
        return list(by_input[names[0]])
    out = []
    for i, first in enumerate(by_input[names[0]]):
        rows = [by_input[n][i] for n in names]
        pending = sum(r.pending for r in rows)
        if pending == 0:
            out.append(PartitionBacklog(first.partition, 0, None, 0.0))
            continue
        token = sum(r.first_seq if r.first_seq is not None else last_seqs.get(n, 0) + 1
                    for n, r in zip(names, rows, strict=True))
        times = [r.first_time_s for r in rows if r.pending and r.first_time_s is not None]
        out.append(PartitionBacklog(first.partition, pending, token,
                                    max(r.age_s for r in rows), min(times, default=None)))
    return out


@dataclass(frozen=True, slots=True)
class RunFact:
    """One unsuccessful run of a partition as an orchestrator recorded it.

    Attributes:
        run_id: the orchestrator's run id.
        state: ``"in_progress"`` (queued or running) or ``"failed"`` (failed or canceled).
        created_at: when the run was created (Unix seconds).
        ended_at: when a failed run ended (Unix seconds; ``None`` if unknown).
        code: the code version the run was made with (``None`` if not recorded).
        error: the failed run's error, one line (``""`` if not read).
    """

    run_id: str
    state: Literal["in_progress", "failed"]
    created_at: float
    ended_at: float | None = None
    code: str | None = None
    error: str = ""


def runs_from_facts(facts: Iterable[RunFact], code: str, *, succeeded_at: float = 0.0,
                    error_of: Callable[[RunFact], str] | None = None) -> PartitionRuns:
    """A partition's :class:`PartitionRuns` from its unsuccessful runs, **newest first**: the
    consecutive failures under ``code`` (counting stops at a run created at or before the
    newest success ``succeeded_at``, Unix seconds, and at a failure under another code), and
    whether a run is in progress. ``error_of`` reads the newest counted failure's error (only
    called when there is one; default: its ``error``). Pure (``error_of`` aside)."""
    failures, newest = 0, None
    in_progress = failed_before = False
    counting = True
    for fact in facts:
        if fact.state == "in_progress":
            in_progress = True
            continue
        if fact.created_at <= succeeded_at:
            break
        failed_before = True
        if counting and fact.code == code:
            failures += 1
            newest = newest or fact
        else:
            counting = False
    if newest is None:
        return PartitionRuns(in_progress=in_progress, failed_before=failed_before)
    return PartitionRuns(
        failures=failures, last_failed_at=newest.ended_at,
        last_error=error_of(newest) if error_of is not None else newest.error,
        in_progress=in_progress, failed_before=True)
