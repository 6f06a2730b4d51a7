"""Which partition ranges to run when one run drains up to ``d`` partitions (the run
parallelism D of issue 51; ``notes/RANGE_RUNS.md`` §7). Pure.

The partitions ``0 .. n-1`` split into **aligned blocks** ``[i*d, min((i+1)*d, n) - 1]``, the
way Flink assigns key-group ranges and RisingWave vnode ranges to a variable number of
workers: the same blocks recur tick after tick, so a block's runs and history stay
comparable. A block is run when

- one of its partitions has backlog, and
- **none of its partitions is busy** (in a queued or running run of any layout, e.g. of a run
  launched before D changed): a partition is taken by a run of the new layout only when no run
  of the old one holds it, so no key is processed by two runs at once. The block waits for the
  older run (one run's time) rather than running in pieces.

A **given-up** partition (failing under the current code, core's retry rule) is carved out of
its block for good, so it does not keep the other partitions from running; the rest of the
block runs as the contiguous ranges left (orchestrators' partition ranges are contiguous).
Each range is trimmed at both ends to partitions with backlog (a run over a range reports
every partition in it).
"""

from __future__ import annotations

from collections.abc import Iterable

from cg_pipelines.core.errors import ConfigError

__all__ = ["PartitionRange", "blocks", "plan_ranges"]

PartitionRange = tuple[int, int]
"""``(first, last)`` partitions of one run, both included, ``first <= last``."""


def blocks(partitions: int, d: int) -> list[PartitionRange]:
    """The aligned blocks of ``partitions`` partitions for run parallelism ``d``, in order.

    Raises:
        ConfigError: ``partitions`` or ``d`` below 1.
    """
    if partitions < 1:
        raise ConfigError("partitions", f"must be >= 1, got {partitions}")
    if d < 1:
        raise ConfigError("run_parallelism", f"must be >= 1 partition per run, got {d}")
    return [(start, min(start + d, partitions) - 1) for start in range(0, partitions, d)]


def plan_ranges(partitions: int, d: int, backlog: Iterable[int], busy: Iterable[int] = (),
                given_up: Iterable[int] = ()) -> list[PartitionRange]:
    """The ranges to launch now, in partition order (see the module docstring).

    Args:
        partitions: the group's partition count (``>= 1``).
        d: partitions per run (``>= 1``; ``1`` is one run per partition).
        backlog: partitions with backlog (others and out-of-range ones count as none).
        busy: partitions in a queued or running run (any layout).
        given_up: partitions not to run (core's retry rule gave up on them).

    Raises:
        ConfigError: ``partitions`` or ``d`` below 1.
    """
    spans = blocks(partitions, d)
    pending, held, skip = set(backlog), set(busy), set(given_up)
    out: list[PartitionRange] = []
    for first, last in spans:
        members = range(first, last + 1)
        if held.intersection(members) or not pending.intersection(members):
            continue
        run: list[int] = []
        for p in [*members, None]:  # None closes the last run
            if p is not None and p not in skip:
                run.append(p)
                continue
            with_backlog = [q for q in run if q in pending]
            if with_backlog:
                out.append((with_backlog[0], with_backlog[-1]))
            run = []
    return out
