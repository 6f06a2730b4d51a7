"""core/blocks.py: the ranges a run-parallelism D launches (aligned blocks, busy blocks wait,
given-up partitions carved out, ends trimmed to backlog)."""

from __future__ import annotations

import random

import pytest

from cg_pipelines.core.blocks import blocks, plan_ranges
from cg_pipelines.core.errors import ConfigError


@pytest.mark.parametrize(("n", "d", "want"), [
    (8, 1, [(p, p) for p in range(8)]),
    (8, 4, [(0, 3), (4, 7)]),
    (8, 3, [(0, 2), (3, 5), (6, 7)]),
    (8, 8, [(0, 7)]),
    (8, 20, [(0, 7)]),
    (1, 4, [(0, 0)]),
])
def test_blocks(n: int, d: int, want: list[tuple[int, int]]) -> None:
    assert blocks(n, d) == want


@pytest.mark.parametrize(("n", "d", "backlog", "busy", "given_up", "want"), [
    # one run per partition (today's layout): exactly the partitions with backlog
    (8, 1, {1, 3}, set(), set(), [(1, 1), (3, 3)]),
    # D = 4: a block per run, trimmed to its backlog
    (8, 4, {1, 3, 6}, set(), set(), [(1, 3), (6, 6)]),
    (8, 4, {0, 1, 2, 3, 4, 5, 6, 7}, set(), set(), [(0, 3), (4, 7)]),
    # nothing pending, nothing run
    (8, 4, set(), set(), set(), []),
    # out-of-range backlog is ignored
    (8, 4, {9, -1}, set(), set(), []),
    # a busy partition (an old layout's run) holds its whole block back
    (8, 4, {0, 1, 2, 5}, {3}, set(), [(5, 5)]),
    # D changed 4 -> 8 while block (4..7) runs: the 8-block waits
    (8, 8, {0, 1}, {4, 5, 6, 7}, set(), []),
    # D changed 8 -> 2 while nothing runs: 2-blocks
    (8, 2, {0, 1, 2, 7}, set(), set(), [(0, 1), (2, 2), (7, 7)]),
    # a given-up partition is carved out; the rest runs as contiguous ranges
    (8, 8, {0, 1, 3, 4, 7}, set(), {2}, [(0, 1), (3, 7)]),
    (8, 4, {2}, set(), {2}, []),
    (8, 4, {1, 2, 3}, set(), {0, 3}, [(1, 2)]),
])
def test_plan_ranges(n: int, d: int, backlog: set[int], busy: set[int], given_up: set[int],
                     want: list[tuple[int, int]]) -> None:
    assert plan_ranges(n, d, backlog, busy, given_up) == want


def test_plan_ranges_never_overlaps_busy_and_runs_only_backlog_ends() -> None:
    rnd = random.Random(51)
    for _ in range(500):
        n, d = rnd.randint(1, 40), rnd.randint(1, 12)
        backlog = {p for p in range(n) if rnd.random() < 0.4}
        busy = {p for p in range(n) if rnd.random() < 0.1}
        given_up = {p for p in range(n) if rnd.random() < 0.1}
        ranges = plan_ranges(n, d, backlog, busy, given_up)
        covered = [p for a, b in ranges for p in range(a, b + 1)]
        assert len(covered) == len(set(covered)), ranges  # disjoint
        assert not set(covered) & busy and not set(covered) & given_up
        for a, b in ranges:
            assert a in backlog and b in backlog and a // d == b // d  # in one block
        # every partition with backlog that is runnable is covered
        runnable = {p for p in backlog if p not in given_up
                    and not any(q in busy for q in range(p // d * d, min(p // d * d + d, n)))}
        assert runnable <= set(covered)


@pytest.mark.parametrize(("n", "d", "field"), [(0, 1, "partitions"), (8, 0, "run_parallelism")])
def test_bad_sizes_are_refused(n: int, d: int, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        plan_ranges(n, d, {0})
    assert e.value.field == field
