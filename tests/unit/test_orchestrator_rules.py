"""The rules both orchestrators (Dagster, Airflow) share, moved into ``core``: partition-key
naming, failure counting from run facts, the merged backlog of a set, a failed run's text."""

from __future__ import annotations

import pytest

from cg_pipelines.core.errors import ConfigError, PartitionRunError, failure_report
from cg_pipelines.core.partitioning import partition_key, partition_keys, partition_of
from cg_pipelines.core.triggers import (
    PartitionBacklog,
    PartitionRuns,
    RunFact,
    dead_slot,
    merge_backlog,
    runs_from_facts,
)


@pytest.mark.parametrize(("prefix", "p", "key"), [("legs-", 3, "legs-3"), ("", 0, "0"),
                                                  ("a+b-", 12, "a+b-12")])
def test_partition_key_round_trip(prefix: str, p: int, key: str) -> None:
    assert partition_key(prefix, p) == key
    assert partition_of(prefix, key, 16, "x") == p


@pytest.mark.parametrize("key", ["legs-4", "legs-03", "legs-", "legs--1", "leg-1", "legs-1x"])
def test_partition_of_refuses_foreign_keys(key: str) -> None:
    with pytest.raises(ConfigError, match=r"not a partition key of aircraft \(legs-0 .. legs-3\)"):
        partition_of("legs-", key, 4, "aircraft")


def test_partition_keys_in_order() -> None:
    assert partition_keys("g-", 3) == ["g-0", "g-1", "g-2"]


def F(state: str, created: float, code: str | None = "v1", *, ended: float | None = None,
      error: str = "") -> RunFact:
    return RunFact(f"r{created:g}", state, created, ended, code, error)  # type: ignore[arg-type]


@pytest.mark.parametrize(("facts", "since", "want"), [
    ([], 0.0, PartitionRuns()),
    ([F("in_progress", 9)], 0.0, PartitionRuns(in_progress=True)),
    # two failures under v1, newest first: the newest one's end and error
    ([F("failed", 9, ended=9.5, error="boom"), F("failed", 5, ended=5.5)], 0.0,
     PartitionRuns(2, 9.5, "boom", False, True)),
    # a success at t=6 ends the count
    ([F("failed", 9, ended=9.5, error="e"), F("failed", 5)], 6.0,
     PartitionRuns(1, 9.5, "e", False, True)),
    # another code's failure ends the count, but failed_before stays
    ([F("failed", 9, ended=10, error="e"), F("failed", 7, "v0"), F("failed", 5)], 0.0,
     PartitionRuns(1, 10, "e", False, True)),
    ([F("failed", 9, "v0")], 0.0, PartitionRuns(failed_before=True)),
    # a queued retry counts as in progress, whatever its place
    ([F("in_progress", 11), F("failed", 9, ended=9.2, error="e")], 0.0,
     PartitionRuns(1, 9.2, "e", True, True)),
])
def test_runs_from_facts(facts: list[RunFact], since: float, want: PartitionRuns) -> None:
    assert runs_from_facts(facts, "v1", succeeded_at=since) == want


def test_runs_from_facts_reads_only_the_newest_counted_error() -> None:
    asked: list[str] = []

    def error_of(f: RunFact) -> str:
        asked.append(f.run_id)
        return "read"

    got = runs_from_facts([F("failed", 9), F("failed", 5)], "v1", error_of=error_of)
    assert (got.last_error, asked) == ("read", ["r9"])
    assert runs_from_facts([F("failed", 9, "v0")], "v1", error_of=error_of) == \
        PartitionRuns(failed_before=True)
    assert asked == ["r9"]


def B(p: int, pending: int, first: int | None, age: float, t: float | None = None
      ) -> PartitionBacklog:
    return PartitionBacklog(p, pending, first, age, t)


def test_merge_backlog_one_input_is_itself() -> None:
    rows = [B(0, 3, 7, 1.0), B(1, 0, None, 0.0)]
    assert merge_backlog({"a": rows}, {}) == rows


def test_merge_backlog_over_inputs() -> None:
    got = merge_backlog({"a": [B(0, 2, 10, 5.0, 100.0), B(1, 0, None, 0.0)],
                         "b": [B(0, 0, None, 0.0), B(1, 0, None, 0.0)]}, {"a": 20, "b": 40})
    # partition 0: pending summed, first_seq = a's first + b's last + 1, the oldest age/time
    assert got == [B(0, 2, 10 + 41, 5.0, 100.0), B(1, 0, None, 0.0)]


def test_dead_slot() -> None:
    assert [dead_slot(4, i, p) for i, p in [(0, 0), (0, 3), (1, 0), (2, 1)]] == [0, 3, 4, 9]


def test_failure_report_before_any_lease() -> None:
    text, facts = failure_report(ValueError("bad row"), "s.g", 2)
    assert text.splitlines() == ["ValueError: bad row", "partition 2 of s.g: the run failed "
                                 "before it leased anything; nothing was committed or "
                                 "acknowledged"]
    assert facts == {"partition": 2, "cause_type": "ValueError", "cause": "ValueError: bad row"}


def test_failure_report_with_partition_facts() -> None:
    cause = RuntimeError("sink down")
    PartitionRunError(cause, stream="s", group="g", read_stream="s-g", partition=1,
                      inflight=(5, 9), committed_through=4, acknowledged_through=4,
                      commits=1).attach()
    text, facts = failure_report(cause, "s.g", 1)
    assert text.splitlines()[0] == "RuntimeError: sink down"
    assert "sequences 5..9 in flight" in text
    assert facts == {"partition": 1, "cause_type": "RuntimeError",
                     "cause": "RuntimeError: sink down", "inflight_first_seq": 5,
                     "inflight_last_seq": 9, "committed_through": 4, "acknowledged_through": 4}
