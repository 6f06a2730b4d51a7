"""Signals an operator can trust (issues 29, 40): partitioned checks recorded outside runs on
SQLite and Postgres instances, lag observations on changes of state through the sensor, run
history in a constant number of queries, a failed run's check results, dead letters in the
catalog.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace

import pyarrow as pa
import pytest
from dagster import (
    AssetCheckEvaluation,
    AssetCheckKey,
    AssetKey,
    AssetMaterialization,
    DagsterEventType,
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    Failure,
    RunRequest,
    instance_for_test,
)
from nats.aio.client import Client
from nats.js import JetStreamContext
from sqlalchemy.exc import IntegrityError

from cg_pipelines.core.config import dlq_stream_name, work_queue_stream_name
from cg_pipelines.core.triggers import RetryPolicy
from cg_pipelines.dagster import build_definitions
from cg_pipelines.dagster.checks import (
    CHECK_RETRY_S,
    CHECK_RUNS_PER_TICK,
    CHECKS_PER_TICK,
    PartitionChecks,
    failed_run_checks,
    plan_partition_checks,
)
from cg_pipelines.dagster.history import (
    CODE_TAG,
    CheckState,
    check_states,
    partition_runs,
    record_first_checks,
)
from cg_pipelines.dagster.reading import read_inputs
from cg_pipelines.engine.deadletter import dead_letter_headers, ensure_dlq_stream
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.local.nats_server import NatsServer
from cg_pipelines.sinks.base import FenceConflictError
from tests.dagster import helpers as th
from tests.dagster.defs_keyed import ASSET as KEYED_ASSET
from tests.dagster.defs_keyed import BACKLOG_SENSOR, GROUP, make_resources
from tests.dagster.defs_keyed import spec as make_spec

ASSET = AssetKey("devices")
ASSET_KEYED = AssetKey(KEYED_ASSET)
CHECK = "lag_within_objective"


@pytest.fixture(params=["sqlite", "postgres"])
def any_instance(request: pytest.FixtureRequest) -> Iterator[DagsterInstance]:
    """A persistent Dagster instance on SQLite, or on a throwaway PostgreSQL database
    (dagster-postgres)."""
    if request.param == "sqlite":
        with instance_for_test() as inst:
            yield inst
        return
    url = request.getfixturevalue("postgres_database").replace(
        "postgresql://", "postgresql+psycopg2://", 1)  # the driver dagster-postgres brings
    with instance_for_test(overrides={"storage": {"postgres": {"postgres_url": url}}}) as inst:
        yield inst


def _ev(partition: str, passed: bool, name: str = CHECK) -> AssetCheckEvaluation:
    return AssetCheckEvaluation(asset_key=ASSET, check_name=name, passed=passed,
                                partition=partition, description=f"{partition} {passed}")


def _passed(instance: DagsterInstance) -> dict[str, bool | None]:
    return {p: s.passed for (n, p), s in check_states(instance, ASSET, [CHECK]).items()}


def test_first_results_recorded_run_less(any_instance: DagsterInstance) -> None:
    """The Dagster fact the design rests on (1.13.27; unchanged in the 1.13.29 source): a
    second run-less evaluation of one check and partition is refused, on SQLite and Postgres.
    So only first results are recorded run-less (one per check and partition, under run id
    ""), and a refusal is logged without failing the caller."""
    inst = any_instance
    inst.report_runless_asset_event(_ev("g-9", True))
    with pytest.raises(IntegrityError):
        inst.report_runless_asset_event(_ev("g-9", False))

    log = logging.getLogger("test")
    evs = [_ev(f"g-{p}", p != 2) for p in range(4)]
    assert record_first_checks(inst, evs, log) == evs
    assert _passed(inst) == {"g-0": True, "g-1": True, "g-2": False, "g-3": True, "g-9": True}
    states = check_states(inst, ASSET, [CHECK])
    assert {s.run_id for s in states.values()} == {""}  # run-less: no run id at all
    assert states[(CHECK, "g-2")].current  # never materialized: nothing newer to target
    assert record_first_checks(inst, [_ev("g-2", True)], log) == []  # refused, not raised
    assert _passed(inst)["g-2"] is False

    # A materialization makes the run-less result stale (it targets none).
    inst.report_runless_asset_event(AssetMaterialization(asset_key=ASSET, partition="g-1"))
    assert not check_states(inst, ASSET, [CHECK])[(CHECK, "g-1")].current


def _st(passed: bool | None, current: bool = True, run_id: str = "", sid: int = 1
        ) -> CheckState:
    return CheckState(passed, current, run_id, sid)


def test_plan_partition_checks_writes_only_changes() -> None:
    """What a tick writes, from wanted outcomes and recorded states: nothing for a steady
    state; first results run-less; a changed outcome (or a failure made stale by a newer
    materialization) by one check run per partition, keyed by its recorded state; nothing
    while a check run is planned; a retry per CHECK_RETRY_S after one ended without result."""
    lag, runs = "lag_within_objective", "partition_runs_succeeding"
    want = {(lag, "g-0"): True, (runs, "g-0"): True, (lag, "g-1"): False,
            (runs, "g-1"): True}
    steady = {(lag, "g-0"): _st(True, sid=3), (runs, "g-0"): _st(True, False, sid=4),
              (lag, "g-1"): _st(False, sid=5), (runs, "g-1"): _st(True, False, sid=6)}
    assert plan_partition_checks("g", want, steady, set(), 0.0) == PartitionChecks()

    first = plan_partition_checks("g", want, {}, set(), 0.0)
    assert first.first == [(lag, "g-1"), (lag, "g-0"), (runs, "g-0"), (runs, "g-1")]
    assert not first.rerun

    changed = {**steady, (lag, "g-0"): _st(False, sid=7), (lag, "g-1"): _st(False, False, "r1",
                                                                           sid=8)}
    plan = plan_partition_checks("g", want, changed, set(), 0.0)
    assert list(plan.rerun) == ["g-1", "g-0"]  # failing first
    assert "lag_within_objective failed -> passed" in plan.rerun["g-0"]
    assert "still failing" in plan.rerun["g-1"]
    assert plan.run_keys == {"g-0": "g:checks:g-0:7", "g-1": "g:checks:g-1:8"}
    assert plan.first == []

    planned = {**steady, (lag, "g-1"): _st(None, run_id="r2", sid=9)}
    assert plan_partition_checks("g", want, planned, set(), 0.0) == PartitionChecks()
    retry = plan_partition_checks("g", want, planned, {"r2"}, 1000.0)
    assert retry.run_keys == {"g-1": f"g:checks:g-1:9:{int(1000 // CHECK_RETRY_S)}"}
    # planned by a partition run that failed before evaluating it: a check run only while
    # the partition is late (g-1 here); a fresh one waits for its next drain run
    assert plan_partition_checks("g", want, planned, {"r2"}, 1000.0, {"r2"}).run_keys == \
        retry.run_keys
    fresh = {**steady, (lag, "g-0"): _st(None, run_id="r3", sid=10)}
    assert plan_partition_checks("g", want, fresh, {"r3"}, 1000.0, {"r3"}) == PartitionChecks()
    assert list(plan_partition_checks("g", want, fresh, {"r3"}, 1000.0).rerun) == ["g-0"]

    many = {(runs, f"g-{p}"): False for p in range(CHECK_RUNS_PER_TICK + 5)}
    plan = plan_partition_checks("g", many, {k: _st(True) for k in many}, set(), 0.0)
    assert len(plan.rerun) == CHECK_RUNS_PER_TICK
    big = {(runs, f"g-{p}"): p % 2 == 0 for p in range(CHECKS_PER_TICK + 50)}
    plan = plan_partition_checks("g", big, {}, set(), 0.0)
    assert len(plan.first) == CHECKS_PER_TICK and not big[plan.first[0]]


# ------------------------------------------------------------------------------ lag volume


async def test_lag_observed_on_changes_through_the_sensor(
        js: JetStreamContext, nats_server: NatsServer, unique_name: str, warehouse: str,
        instance: DagsterInstance) -> None:
    """The lag rule (tests/unit/test_triggers.py holds it on a simulated day at 256
    partitions) through the real backlog sensor's ticks on a real group, the slow cadence set
    out of reach (1 h) so that only changes are observed: partition 3 moves for 8 ticks
    (before each, its older messages leave the work queue, as a run would drain them, and a
    new one arrives), then stops on its last message; partition 1 is stuck on its first
    message throughout. 12 ticks: partition 3 is observed at its first tick and at the tick
    after it stopped, never while moving; partition 1 once. Each observation gives the oldest
    pending message's timestamp, so ``now - oldest_pending_timestamp`` is each partition's
    true age at the end (checked against a fresh backlog read)."""
    stream = unique_name
    await th.create_group(js, stream)
    spec = replace(make_spec(stream), lag_objective_s=None, lag_refresh_s=3600.0)
    defs = build_definitions([spec], resources=make_resources(
        nats_server.url, warehouse, min_pending=10**9))  # never a run: lag only
    wq = work_queue_stream_name(stream, GROUP)
    stuck = th.events_on({1})[:5]
    moving = th.events_on({3})
    await th.publish(js, stream, stuck, len(stuck))
    published = len(stuck)
    seen: dict[str, list[tuple[int, dict]]] = {"g-1": [], "g-3": []}
    cursor = None
    for t in range(12):
        if t < 8:
            await js.purge_stream(wq, subject="3.>")  # what a run of partition 3 drains
            await th.publish(js, stream, [moving[t]], published + 1)
            published += 1
        d = await asyncio.to_thread(th.tick, defs, BACKLOG_SENSOR, instance, cursor=cursor)
        cursor = d.cursor
        for e in d.asset_events:
            if type(e).__name__ == "AssetObservation" and "lag_state" in e.metadata:
                seen[e.partition].append((t, {k: v.value for k, v in e.metadata.items()}))
        await asyncio.sleep(0.1)
    assert [t for t, _ in seen["g-3"]] == [0, 8]  # first seen; stopped (seen so at tick 8)
    assert [t for t, _ in seen["g-1"]] == [0]
    assert {o["lag_state"] for _, obs in seen.items() for _, o in obs} == {"behind"}
    assert seen["g-3"][1][1]["pending"] == 1
    reading = await asyncio.to_thread(read_inputs, spec, defs.resources["nats"],
                                      defs.resources["partition_runs"])
    at = time.time()
    for p in (1, 3):
        (b,) = [b for b in reading.backlog if b.partition == p]
        stamp = seen[f"g-{p}"][-1][1]["oldest_pending_timestamp"]
        assert at - stamp == pytest.approx(b.age_s, abs=0.5)  # the true age, now


# ------------------------------------------------------------------------------ tick cost


def _add_run(instance: DagsterInstance, key: str, status: DagsterRunStatus,
             code: str = "v1") -> None:
    instance.add_run(DagsterRun(job_name="devices_job", run_id=str(uuid.uuid4()), status=status,
                                tags={"dagster/partition": key, CODE_TAG: code}))


class _Counting:
    """Counts an instance's run-records queries and per-run event reads."""

    def __init__(self, instance: DagsterInstance) -> None:
        self.runs = self.events = 0
        self._inst = instance
        self._grr, self._gfr = instance.get_run_records, instance.get_records_for_run

    def __enter__(self) -> _Counting:
        def grr(*a: object, **k: object) -> object:
            self.runs += 1
            return self._grr(*a, **k)

        def gfr(*a: object, **k: object) -> object:
            self.events += 1
            return self._gfr(*a, **k)

        self._inst.get_run_records = grr  # type: ignore[method-assign]
        self._inst.get_records_for_run = gfr  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self._inst.get_run_records, self._inst.get_records_for_run


@pytest.mark.parametrize("n", [4, 128])
def test_partition_runs_constant_queries(n: int) -> None:
    """Run history of n partitions in 4 run-records queries whatever n (runs of one
    partition and range runs, unsuccessful then the failing keys' successes; 2 without
    failures), the error of each newest failure read once (cached across ticks), counts as
    before."""
    policy = RetryPolicy(max_failures=3)
    with DagsterInstance.ephemeral() as inst:
        keys = {p: f"g-{p}" for p in range(n)}
        for p in range(n):
            _add_run(inst, keys[p], DagsterRunStatus.SUCCESS)
        for _ in range(3):
            _add_run(inst, "g-1", DagsterRunStatus.FAILURE)
        _add_run(inst, "g-2", DagsterRunStatus.FAILURE, code="v0")  # older code: no count
        _add_run(inst, "g-3", DagsterRunStatus.FAILURE)
        _add_run(inst, "g-3", DagsterRunStatus.STARTED)
        errors: dict[str, str] = {}
        with _Counting(inst) as c:
            hist = partition_runs(inst, keys, "v1", policy, errors=errors)
        assert (c.runs, c.events) == (4, 2)
        assert hist[1].failures == 3 and hist[0].failures == 0 and not hist[0].failed_before
        assert hist[2].failures == 0 and hist[2].failed_before
        assert hist[3].failures == 1 and hist[3].in_progress
        assert len(errors) == 2
        with _Counting(inst) as c:
            assert partition_runs(inst, keys, "v1", policy, errors=errors) == hist
        assert (c.runs, c.events) == (4, 0)  # errors cached
        _add_run(inst, "g-1", DagsterRunStatus.SUCCESS)  # a success ends the count
        assert partition_runs(inst, keys, "v1", policy, errors=errors)[1].failures == 0


# ------------------------------------------------------------------------ failed run checks


def test_a_failed_run_is_not_a_fence_conflict() -> None:
    spec = make_spec("s")
    got = {r.check_name: r for r in failed_run_checks(spec, Failure(
        "ValueError: amount feed under in cents"))}
    assert not got["backlog_drained"].passed
    assert got["backlog_drained"].description.startswith("ValueError: amount feed")
    assert got["no_unexplained_fence_conflicts"].passed
    assert "no_new_dead_letters" not in got  # unknown: left to Dagster (execution failed)
    try:
        try:
            raise FenceConflictError("s/g/1", 10, 12)
        except FenceConflictError as e:
            raise RuntimeError("commit refused") from e
    except RuntimeError as e:
        fenced = {r.check_name: r for r in failed_run_checks(spec, e)}
    assert not fenced["no_unexplained_fence_conflicts"].passed
    held = {r.check_name: r for r in failed_run_checks(spec, Failure(
        "partition 1 halted: bad payload", metadata={"fence_conflicts": 0,
                                                     "dead_lettered": 2}))}
    assert held["no_unexplained_fence_conflicts"].passed
    assert not held["no_new_dead_letters"].passed


# ------------------------------------------------------------------------------ dead letters


async def test_dead_letters_observed_per_partition(
        nc: Client, js: JetStreamContext, nats_server: NatsServer, unique_name: str,
        warehouse: str, instance: DagsterInstance) -> None:
    """Per partition: how many dead letters, the latest one's sequence and reason, observed
    when a partition's count changes (only then)."""
    stream = unique_name
    await th.create_group(js, stream)
    defs = build_definitions([replace(make_spec(stream), lag_objective_s=None)],
                             resources=make_resources(nats_server.url, warehouse))
    d0 = await asyncio.to_thread(th.tick, defs, BACKLOG_SENSOR, instance)
    assert d0.asset_events == []  # no dead-letter stream yet: none, nothing to say

    async def dead(p: int, seq: int, reason: str) -> None:
        headers = dead_letter_headers(None, origin_stream=stream, read_stream="wq", seq=seq,
                                      subject=f"{stream}.k", partition=p, reason=reason)
        await js.publish(f"{dlq_stream_name(stream, GROUP)}.{p}", b"{bad", headers=headers)

    async with JetStreamAPI(nc) as api:
        await ensure_dlq_stream(api, stream, GROUP)
    await dead(1, 11, "KeyError: 'amount'")
    await dead(1, 12, "ValueError: amount feed under in cents")
    await dead(3, 30, "bad json")
    d1 = await asyncio.to_thread(th.tick, defs, BACKLOG_SENSOR, instance, cursor=d0.cursor)
    obs = {e.partition: {k: v.value for k, v in e.metadata.items()} for e in d1.asset_events}
    assert sorted(obs) == ["g-1", "g-3"]
    assert obs["g-1"]["dead_letters"] == 2
    assert obs["g-1"]["latest_dead_letter_source_seq"] == 12
    assert obs["g-1"]["latest_dead_letter_reason"] == "ValueError: amount feed under in cents"
    assert obs["g-3"]["dead_letters"] == 1 and obs["g-3"]["latest_dead_letter_seq"] > 0
    d2 = await asyncio.to_thread(th.tick, defs, BACKLOG_SENSOR, instance, cursor=d1.cursor)
    assert d2.asset_events == []  # unchanged: not observed again
    await dead(3, 31, "bad json again")
    d3 = await asyncio.to_thread(th.tick, defs, BACKLOG_SENSOR, instance, cursor=d2.cursor)
    assert [(e.partition, e.metadata["dead_letters"].value) for e in d3.asset_events] == [
        ("g-3", 2)]


def test_docs_automation_condition_example_loads() -> None:
    """docs/signals.md's downstream assets (AutomationCondition) load with a group asset."""
    import dagster as dg

    group = make_spec("orders_stream")

    @dg.asset(automation_condition=dg.AutomationCondition.on_cron("*/10 * * * *"))
    def order_totals(keyed_events: pa.Table) -> pa.Table:
        return keyed_events

    @dg.asset(automation_condition=dg.AutomationCondition.eager())
    def big_orders(keyed_events: pa.Table) -> pa.Table:
        return keyed_events

    defs = build_definitions([group], resources=make_resources("nats://127.0.0.1:1", "/tmp/x"),
                             assets=[order_totals, big_orders])
    dg.Definitions.validate_loadable(defs)
    graph = defs.resolve_asset_graph()
    assert graph.get(dg.AssetKey("order_totals")).automation_condition is not None
    assert dg.AssetKey("keyed_events") in graph.get(dg.AssetKey("big_orders")).parent_keys


def _execute(defs: object, instance: DagsterInstance, req: RunRequest) -> str:
    """Run a check-only run request as the daemon would launch it (the job subset it
    selects); returns the run id."""
    job = defs.resolve_job_def(req.job_name)  # type: ignore[attr-defined]
    sub = job.get_subset(asset_selection=set(req.asset_selection or []),
                         asset_check_selection=set(req.asset_check_keys or []))
    result = sub.execute_in_process(partition_key=req.partition_key, instance=instance,
                                    tags=dict(req.tags))
    assert result.success
    assert not result.get_asset_materialization_events()  # checks only
    return result.run_id


def _writes(instance: DagsterInstance) -> tuple[int, int, int, int]:
    """What the signals could have written, through Dagster's public read APIs: run-less
    events (check evaluations and observations), check executions of both checks (every
    partition), runs."""
    of = {DagsterEventType.ASSET_CHECK_EVALUATION, DagsterEventType.ASSET_OBSERVATION}
    runless = len(instance.get_records_for_run("", of_type=of, limit=10_000).records)
    executions = sum(len(instance.event_log_storage.get_asset_check_execution_history(
        AssetCheckKey(ASSET_KEYED, n), limit=10_000)) for n in (
        "lag_within_objective", "partition_runs_succeeding"))
    observations = len(instance.fetch_observations(ASSET_KEYED, limit=10_000).records)
    return runless, executions, observations, len(instance.get_run_records())


async def test_backlog_sensor_re_evaluates_a_partition(
        nc: Client, js: JetStreamContext, nats_server: NatsServer, unique_name: str,
        warehouse: str, any_instance: DagsterInstance) -> None:
    """Through the sensor, on SQLite and Postgres: a partition's lag check fails (its first
    result: run-less), then, its backlog gone, passes — the second result a run-less event
    could not record: the tick requests one check-only run of that partition, which records
    both of its checks. A steady tick then writes nothing at all."""
    stream = unique_name
    await th.create_group(js, stream)
    defs = build_definitions([replace(make_spec(stream), lag_objective_s=0.1)],
                             resources=make_resources(nats_server.url, warehouse,
                                                      min_pending=10**9))
    evs = th.events_on({1})
    await th.publish(js, stream, evs, len(evs))
    await asyncio.sleep(0.3)  # older than the 0.1 s lag objective

    def lag() -> dict[str, bool | None]:
        return {p: s.passed for (n, p), s in check_states(
            any_instance, ASSET_KEYED, ["lag_within_objective"]).items()}

    d1 = await asyncio.to_thread(th.tick, defs, BACKLOG_SENSOR, any_instance)
    assert lag() == {"g-0": True, "g-1": False, "g-2": True, "g-3": True}
    assert not d1.run_requests  # first results: run-less, no run
    async with JetStreamAPI(nc) as api:
        await api.purge(work_queue_stream_name(stream, GROUP), filter="1.>")
    d2 = await asyncio.to_thread(th.tick, defs, BACKLOG_SENSOR, any_instance,
                                 cursor=d1.cursor)
    assert lag()["g-1"] is False  # a run-less result cannot be replaced ...
    (req,) = d2.run_requests or []  # ... so a check-only run of g-1 is requested
    assert (req.job_name, req.partition_key, req.asset_selection) == (
        f"{KEYED_ASSET}_checks", "g-1", [])
    assert {k.name for k in req.asset_check_keys or []} == {
        "lag_within_objective", "partition_runs_succeeding"}
    run_id = await asyncio.to_thread(_execute, defs, any_instance, req)
    assert lag() == {"g-0": True, "g-1": True, "g-2": True, "g-3": True}
    states = check_states(any_instance, ASSET_KEYED,
                          ["lag_within_objective", "partition_runs_succeeding"])
    assert {k: s.run_id for k, s in states.items() if k[1] == "g-1"} == {
        ("lag_within_objective", "g-1"): run_id, ("partition_runs_succeeding", "g-1"): run_id}
    assert any_instance.get_run_by_id(run_id) is not None  # a real run, no phantom run id

    # Steady: nothing changed, so two more ticks write nothing (no event, no run, no row).
    before = _writes(any_instance)
    d3 = await asyncio.to_thread(th.tick, defs, BACKLOG_SENSOR, any_instance,
                                 cursor=d2.cursor)
    d4 = await asyncio.to_thread(th.tick, defs, BACKLOG_SENSOR, any_instance,
                                 cursor=d3.cursor)
    for d in (d3, d4):
        assert not d.run_requests and d.asset_events == []
    assert _writes(any_instance) == before
    assert before[1] == 4 * 2 + 2  # 8 first results, then g-1's two from its check run
