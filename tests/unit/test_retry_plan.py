"""Table tests: the backlog tick's retry plan, the lag rule and code versions (no I/O)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cg_pipelines.core.fingerprint import code_version
from cg_pipelines.core.lag import lag_breaches
from cg_pipelines.core.triggers import (
    PartitionBacklog,
    PartitionRuns,
    RetryPolicy,
    plan_backlog_runs,
    retry_run_key,
)

NOW = 1_000_000.0
POLICY = RetryPolicy(max_failures=3, backoff_s=10.0, max_backoff_s=25.0)
BACKLOG = [PartitionBacklog(0, 5, 100, 2.0), PartitionBacklog(1, 0, None, 0.0),
           PartitionBacklog(2, 7, 300, 50.0)]


@pytest.mark.parametrize(("failures", "want"), [
    (0, 0.0), (1, 10.0), (2, 20.0), (3, 25.0), (10, 25.0), (200, 25.0)])
def test_backoff_doubles_up_to_the_cap(failures: int, want: float) -> None:
    assert POLICY.backoff(failures) == want


@pytest.mark.parametrize("bad", [dict(max_failures=0), dict(backoff_s=0.0),
                                 dict(backoff_s=30.0, max_backoff_s=20.0)])
def test_invalid_policy_is_rejected_with_the_reason(bad: dict) -> None:
    with pytest.raises(ValueError, match="max_failures|backoff_s"):
        RetryPolicy(**bad)


# (history of partition 0, expected: "request <key>" | "wait <s>" | "exhausted" | "busy")
CASES = [
    ("no runs", PartitionRuns(), "request g:0:100"),
    ("succeeded before", PartitionRuns(failures=0), "request g:0:100"),
    ("failed, backoff not over", PartitionRuns(1, NOW - 4.0, "boom"), "wait 6"),
    ("failed, backoff over", PartitionRuns(1, NOW - 10.0, "boom"), "request g:0:100:C:1"),
    ("failed twice, 15 s ago", PartitionRuns(2, NOW - 15.0, "boom"), "wait 5"),
    ("failed twice, 20 s ago", PartitionRuns(2, NOW - 20.0, "boom"), "request g:0:100:C:2"),
    ("at the limit", PartitionRuns(3, NOW - 9999.0, "boom"), "exhausted"),
    ("over the limit", PartitionRuns(7, NOW - 9999.0, "boom"), "exhausted"),
    ("older code failed, new code first try",
     PartitionRuns(0, None, "", failed_before=True), "request g:0:100:C:0"),
    ("a run is queued", PartitionRuns(in_progress=True), "busy"),
    ("queued after failures", PartitionRuns(2, NOW - 999.0, "x", in_progress=True), "busy"),
]


@pytest.mark.parametrize(("name", "runs", "want"), CASES, ids=[c[0] for c in CASES])
def test_plan(name: str, runs: PartitionRuns, want: str) -> None:
    plan = plan_backlog_runs("g", BACKLOG, {0: runs}, POLICY, NOW, code="C")
    # partition 2 never failed: always requested with the plain key; 1 has no backlog
    assert [r.run_key for r in plan.requests if r.partition == 2] == ["g:2:300"]
    assert all(r.partition != 1 for r in plan.requests)
    kind, _, arg = want.partition(" ")
    mine = [r for r in plan.requests if r.partition == 0]
    if kind == "request":
        assert [r.run_key for r in mine] == [arg]
        if runs.failures:
            assert mine[0].reason.startswith(f"retry {runs.failures}/2 after")
            assert "last error: boom" in mine[0].reason
    else:
        assert mine == []
    if kind == "wait":
        assert [(w.partition, round(w.in_s)) for w in plan.waiting] == [(0, int(arg))]
        assert f"retry in {arg} s; last error: boom" in plan.reason_lines(POLICY)[0]
    if kind == "exhausted":
        assert [w.partition for w in plan.exhausted] == [0]
        line = plan.reason_lines(POLICY)[0]
        assert "not retried until a run succeeds or new code is loaded" in line
        assert "last error: boom" in line
    if kind == "busy":
        assert plan.in_progress == [0] and not plan.waiting and not plan.exhausted


def test_retry_keys_never_repeat_across_attempts_and_code_versions() -> None:
    keys = {retry_run_key("g", 0, 100, PartitionRuns(0), "A")}
    for code in ("A", "B"):
        for failures in range(5):
            keys.add(retry_run_key("g", 0, 100, PartitionRuns(failures, 1.0, "",
                                                              failed_before=True), code))
    assert len(keys) == 11


@pytest.mark.parametrize(("objective", "late"), [(1.0, [0, 2]), (10.0, [2]), (60.0, [])])
def test_lag_breaches(objective: float, late: list[int]) -> None:
    assert [b.partition for b in lag_breaches(BACKLOG, objective)] == late


def test_lag_objective_must_be_positive() -> None:
    with pytest.raises(ValueError, match="lag objective"):
        lag_breaches(BACKLOG, 0.0)


# ------------------------------------------------------------------------------ code versions


def _transform_a(x: int) -> int:
    return x + 1


def _transform_b(x: int) -> int:
    return x + 2


class _Step:
    def __init__(self, fn: object, fields: object) -> None:
        self.fn, self.fields = fn, fields


def test_code_version_follows_code_and_settings() -> None:
    a = code_version(_Step(_transform_a, ("k", "v")))
    assert a == code_version(_Step(_transform_a, ("k", "v")))  # a new but equal object
    assert a != code_version(_Step(_transform_b, ("k", "v")))  # other code
    assert a != code_version(_Step(_transform_a, ("k", "w")))  # other settings
    assert code_version({"b", "a", "c"}) == code_version({"c", "a", "b"})
    assert len(a) == 12 and int(a, 16) >= 0


def test_code_version_is_the_same_in_another_process() -> None:
    """Hash randomization, memory addresses and set order must not enter: the sensor and the
    run worker are different processes."""
    script = ("import sys; sys.path.insert(0, %r)\n"
              "from tests.unit.test_retry_plan import _Step, _transform_a\n"
              "from cg_pipelines.core.fingerprint import code_version\n"
              "print(code_version(_Step(_transform_a, {'x', 'y', 'z'}), object()))")
    root = str(Path(__file__).resolve().parents[2])
    outs = {subprocess.run([sys.executable, "-c", script % root], capture_output=True,
                           text=True, check=True, env={"PYTHONHASHSEED": seed}).stdout.strip()
            for seed in ("1", "2", "3")}
    assert len(outs) == 1 and len(outs.pop()) == 12
