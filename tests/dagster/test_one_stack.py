"""One Dagster stack for one input or many (issue 50): a group asset and a two-input
co-partitioned set asset get the same sensors, schedule, jobs and checks, a check about an
input once per input; the same partition-key style; and one definitions load holds both."""

from __future__ import annotations

from pathlib import Path

from dagster import Definitions

from cg_pipelines.dagster import (
    ConsumerGroupAsset,
    CoPartitionedAsset,
    StreamAsset,
    build_asset_definitions,
    build_definitions,
)
from cg_pipelines.dagster.asset import AssetDefinitions
from tests.dagster.defs_keyed import make_resources
from tests.support import joined, keyed

PER_INPUT = ("no_new_dead_letters", "lag_within_objective", "origin_reconciled")


def _group() -> ConsumerGroupAsset:
    return ConsumerGroupAsset(name="totals", stream="orders", group="g", partitions=4,
                              processor=keyed.processor())


def _set() -> CoPartitionedAsset:
    return CoPartitionedAsset(name="totals", inputs=joined.inputs("orders"), partitions=4,
                              processor=joined.processor(), write=joined.WRITE)


def _shape(parts: AssetDefinitions, inputs: list[str]) -> dict[str, list[str]]:
    """The parts' names, each per-input check name ``<check>__<input>`` folded to
    ``<check>[]`` once per input it names."""
    checks = sorted({k.name for k in parts.asset.check_keys}
                    | {k.name for c in parts.checks for k in c.check_keys})
    per_input = [c for c in checks if "__" in c]
    for base in PER_INPUT:
        assert sorted(c for c in per_input if c.startswith(f"{base}__")) == \
            sorted(f"{base}__{n}" for n in inputs) or len(inputs) == 1, (base, per_input)
    folded = sorted({c.split("__")[0] for c in checks})
    return {"sensors": sorted(s.name for s in parts.sensors),
            "schedules": sorted(s.name for s in parts.schedules),
            "jobs": sorted(j.name for j in parts.jobs),
            "checks": folded,
            "per input": sorted({c.split("__")[0] for c in per_input})}


def test_a_set_asset_has_what_a_group_asset_has(tmp_path: Path) -> None:
    group, pair = build_asset_definitions(_group()), build_asset_definitions(_set())
    g, s = _shape(group, ["g"]), _shape(pair, [joined.IMP, joined.CLK])
    assert g["sensors"] == s["sensors"] == ["totals_backlog", "totals_membership",
                                            "totals_run_retention"]
    assert g["schedules"] == s["schedules"] == ["totals_drain"]
    assert g["jobs"] == s["jobs"] == ["totals_checks", "totals_job", "totals_rebuild"]
    assert g["checks"] == s["checks"] == sorted(
        ["backlog_drained", "no_unexplained_fence_conflicts", "partition_runs_succeeding",
         *PER_INPUT])
    assert g["per input"] == [] and s["per input"] == sorted(PER_INPUT)  # once per input
    # the drain and rebuild jobs evaluate the lag checks (a partition's freshness) too
    for spec, lag in ((_group(), ["lag_within_objective"]),
                      (_set(), [f"lag_within_objective__{n}" for n in (joined.IMP, joined.CLK)])):
        defs = build_definitions([spec], resources=make_resources("nats://127.0.0.1:1",
                                                                  str(tmp_path)))
        for job in ("totals_job", "totals_rebuild"):
            nodes = sorted(n.name for n in defs.resolve_job_def(job).nodes)
            assert nodes == sorted(["totals", *(f"totals_{c}" for c in lag)]), nodes


def test_one_partition_key_style() -> None:
    assert _group().partition_key(3) == "g-3"
    assert _set().partition_key(3) == "g-3"  # both inputs' groups are named g
    other = StreamAsset("x", [*joined.inputs("a")[:1], *joined.inputs("b")[1:]], 2,
                        joined.processor())
    assert other.partition_keys() == ["g-0", "g-1"]


def test_a_group_and_a_set_in_one_definitions(tmp_path: Path) -> None:
    group = ConsumerGroupAsset(name="orders_now", stream="orders", group="now", partitions=4,
                               processor=keyed.processor())
    defs = build_definitions([group, _set()],
                             resources=make_resources("nats://127.0.0.1:1", str(tmp_path)))
    Definitions.validate_loadable(defs)
    assert {s.name for s in defs.sensors or []} >= {"orders_now_backlog", "totals_backlog",
                                                    "orders_now_membership",
                                                    "totals_membership"}
