"""Pure lag decisions of the backlog sensors (no I/O; table-tested): which partitions breach the
lag objective (:func:`lag_breaches`), a partition's lag state (:func:`lag_state`), which
partitions' lag to record as an observation — on a change of state, else at a slow cadence,
under a per-partition daily budget (:func:`lag_observations_due`) — and the bound that keeps
(:func:`lag_events_per_day`). Units: seconds; times are Unix seconds."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from cg_pipelines.core.errors import UsageError
from cg_pipelines.core.triggers import PartitionBacklog


def lag_breaches(backlog: Sequence[PartitionBacklog], objective_s: float
                 ) -> list[PartitionBacklog]:
    """Partitions whose oldest pending message is older than ``objective_s`` seconds, in the
    order given. Raises ``UsageError`` if ``objective_s <= 0``."""
    if objective_s <= 0:
        raise UsageError(f"lag objective must be > 0 seconds, got {objective_s:g}")
    return [b for b in backlog if b.pending > 0 and b.age_s > objective_s]


# --------------------------------------------------------------------------------------------
# Lag observations: on a change of state, else at a slow cadence, under a daily budget
# --------------------------------------------------------------------------------------------

DEFAULT_LAG_REFRESH_S = 900.0
"""Seconds: while a partition has a backlog and its lag state does not change, its lag is
observed this often (the slow cadence)."""

DEFAULT_LAG_PER_DAY = 180
"""Lag observations a partition may write per day at most, whatever its traffic (the refill
rate of its budget, :func:`lag_observations_due`)."""

LAG_BURST = 4
"""Observations a partition may write at once (the size of its budget): a few changes of state
in a row are recorded at the tick they happen; beyond that, one per
``86400 / lag_observations_per_day`` seconds."""

LAG_STATES = ("caught_up", "behind", "late")
"""A partition's lag state by its code (:func:`lag_state`)."""


def lag_state(b: PartitionBacklog, objective_s: float | None = None) -> int:
    """The partition's lag state, an index into :data:`LAG_STATES`: 0 ``caught_up`` (nothing
    pending), 2 ``late`` (its oldest pending message is older than ``objective_s`` seconds: the
    objective crossed), else 1 ``behind``. Without an objective a partition is never late."""
    if b.pending <= 0:
        return 0
    return 2 if objective_s is not None and b.age_s > objective_s else 1


def lag_observations_due(
    backlog: Sequence[PartitionBacklog],
    seen: Mapping[str, Sequence[float | int | None]],
    now: float,
    refresh_s: float = DEFAULT_LAG_REFRESH_S,
    *,
    objective_s: float | None = None,
    per_day: int = DEFAULT_LAG_PER_DAY,
) -> tuple[list[PartitionBacklog], dict[str, list[float | int | None]]]:
    """Which partitions' lag to observe this tick, and the state to keep for the next one.

    A partition is observed when what was recorded of it stopped being true:

    - its lag state (:func:`lag_state`: caught up / behind / late, ``objective_s`` seconds)
      differs from the recorded one: drained, a new backlog, the objective crossed either way;
    - it **stopped** on a message that was not recorded: pending, the same first pending
      sequence as at the previous tick, another one than recorded. From then on the recorded
      oldest pending message is the one it is stuck on, so a reader gets its true age from
      the observation's timestamp of that message (``now - oldest_pending_timestamp``), at
      any time, without another event: true from the tick after it stopped;
    - otherwise, while it has a backlog, every ``refresh_s`` seconds (the slow cadence).

    A partition that is moving (its first pending message changes from tick to tick, under
    steady traffic) in the same state is observed at the slow cadence only, and an idle
    partition that was recorded idle (or never had a backlog) never.

    Every observation spends one unit of the partition's budget: at most :data:`LAG_BURST` at
    once, refilled at ``per_day`` a day; a change that finds the budget empty is observed at
    the first tick that has one (it stays a change until recorded). So a partition writes at
    most ``per_day + LAG_BURST`` observations in any 24 hours, whatever its traffic
    (:func:`lag_events_per_day`).

    ``seen`` maps ``str(partition)`` to ``[pending, first_seq, observed_at, state, budget,
    tick_first_seq]``: the last observation's pending count, first pending sequence, Unix
    seconds (0: never observed) and state code, the budget left at that time, and the first
    pending sequence at the previous tick. An entry of another shape (e.g. written by an
    older version) counts as never observed.

    Returns:
        ``(due, seen)``: the partitions to observe (in the order given) and the new ``seen``.

    Raises:
        UsageError: ``refresh_s <= 0`` or ``per_day < 1``.
    """
    if not refresh_s > 0:
        raise UsageError(f"lag refresh interval must be > 0 seconds, got {refresh_s!r}")
    if per_day < 1:
        raise UsageError(f"lag observations per day must be >= 1, got {per_day!r}")
    rate = per_day / 86400.0
    due: list[PartitionBacklog] = []
    out: dict[str, list[float | int | None]] = {}
    for b in backlog:
        key = str(b.partition)
        state = lag_state(b, objective_s)
        prev = seen.get(key)
        if prev is None or len(prev) != 6:
            if b.pending > 0:
                due.append(b)
                out[key] = [b.pending, b.first_seq, now, state, float(LAG_BURST - 1),
                            b.first_seq]
            else:
                out[key] = [0, None, 0.0, state, float(LAG_BURST), None]
            continue
        _, first_seq, observed_at, recorded, budget, tick_first = prev
        since = now - float(observed_at or 0.0)
        left = min(float(LAG_BURST), float(budget or 0.0) + max(since, 0.0) * rate)
        stopped = (b.pending > 0 and b.first_seq == tick_first and b.first_seq != first_seq)
        change = state != recorded or stopped or (b.pending > 0 and since >= refresh_s)
        if change and left >= 1.0:
            due.append(b)
            out[key] = [b.pending, b.first_seq, now, state, left - 1.0, b.first_seq]
        else:
            out[key] = [*prev[:5], b.first_seq]
    return due, out


def lag_events_per_day(partitions: int, tick_s: float,
                       refresh_s: float = DEFAULT_LAG_REFRESH_S,
                       per_day: int = DEFAULT_LAG_PER_DAY, *, steady: bool = False) -> int:
    """The most lag observations ``partitions`` partitions write in a day of backlog ticks
    every ``tick_s`` seconds (:func:`lag_observations_due`).

    - ``steady=False`` (the bound, whatever the traffic): each partition at most
      ``per_day + LAG_BURST`` (its budget) and at most once a tick.
    - ``steady=True``: partitions with a backlog all day whose lag state does not change
      (steady traffic, each tick finding a new first pending message): the slow cadence only,
      once per ``refresh_s`` rounded up to whole ticks; idle partitions add none, and each
      change of state (caught up, behind, late, stopped) adds one, within the bound above.

    Raises:
        UsageError: ``partitions < 0``, a non-positive interval or ``per_day < 1``.
    """
    if partitions < 0 or not tick_s > 0 or not refresh_s > 0 or per_day < 1:
        raise UsageError(f"need partitions >= 0, intervals > 0 s and per_day >= 1, got "
                         f"{partitions}, {tick_s!r}, {refresh_s!r}, {per_day!r}")
    ticks = int(86400 // tick_s)
    most = min(ticks, per_day + LAG_BURST)
    if steady:
        cadence = math.ceil(refresh_s / tick_s) * tick_s
        most = min(most, int(86400 // cadence))
    return partitions * most
