"""The membership and backlog sensors and the drain schedule, evaluated as the daemon evaluates
them (``build_sensor_context(..., definitions=defs)`` + ``evaluate_tick``), against a real
group on the session's nats-server.

Sensors call ``asyncio.run`` inside (``NatsResource.run``): they run in a worker thread here.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

import pytest
from dagster import (
    AssetCheckEvaluation,
    AssetCheckKey,
    AssetKey,
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    RunRequest,
    SkipReason,
)
from nats.js import JetStreamContext

from cg_pipelines.core.assignment import assignment
from cg_pipelines.core.config import (
    ELASTIC_BUCKET,
    MemberMapping,
    config_key,
    work_queue_stream_name,
)
from cg_pipelines.core.triggers import (
    BacklogCursor,
    MembershipCursor,
    decode_cursor,
)
from cg_pipelines.dagster import build_definitions
from cg_pipelines.dagster.history import WORKER_TAG, check_states
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.errors import StreamNotFoundError
from cg_pipelines.local.nats_server import NatsServer
from tests.dagster import helpers as h
from tests.dagster.defs_keyed import (
    ASSET,
    BACKLOG_SENSOR,
    DRAIN_SCHEDULE,
    GROUP,
    JOB,
    MEMBERSHIP_SENSOR,
    PARTITIONS,
    make_defs,
    make_resources,
    pkey,
)
from tests.dagster.defs_keyed import spec as make_spec


def _check_requests(reqs: list[RunRequest], stream: str, partitions: list[int],
                    run_keys: list[str]) -> None:
    """Exactly these partitions in order, with these run keys and the partition tags."""
    assert h.partitions_of(reqs) == [pkey(p) for p in partitions]
    assert [r.run_key for r in reqs] == run_keys
    for r, p in zip(reqs, partitions, strict=True):
        assert r.tags["dagster/partition"] == pkey(p)


# ------------------------------------------------------------------------------- membership


@pytest.mark.parametrize("served", [None, ["m2"]], ids=["all-members", "m2-only"])
async def test_membership_sensor_runs_gained_partitions(
        js: JetStreamContext, nats_server: NatsServer, unique_name: str, warehouse: str,
        instance: DagsterInstance, served: list[str] | None) -> None:
    stream = unique_name
    v1 = await h.create_group(js, stream, members=("m1",))
    defs = make_defs(stream, nats_server.url, warehouse, members=served)

    def tick(cursor: str | None) -> h.SensorExecutionData:
        return h.tick(defs, MEMBERSHIP_SENSOR, instance, cursor=cursor)

    def check_tick(data: h.SensorExecutionData, rev: int, cfg_assign: dict[str, list[int]],
                   gained: list[int]) -> None:
        # no gain: nothing to run, yet the cursor moves (Dagster reports the tick as skipped)
        assert (data.skip_message is None) == bool(gained)
        assert data.cursor is not None
        assert decode_cursor(data.cursor, MembershipCursor) == MembershipCursor(rev, cfg_assign)
        _check_requests(list(data.run_requests or []), stream, gained,
                        [f"{GROUP}:member:{rev}:{p}" for p in gained])

    # first tick: m1 owns every partition
    d1 = await asyncio.to_thread(tick, None)
    assert assignment(v1.config) == {"m1": [0, 1, 2, 3]}
    check_tick(d1, v1.revision, {"m1": [0, 1, 2, 3]}, [0, 1, 2, 3] if served is None else [])
    # movement is recorded as observations of the partitions gained
    assert [e.partition for e in d1.asset_events] == (["g-0", "g-1", "g-2", "g-3"] if served is None
                                                      else [])

    # no change: skip, cursor kept
    d2 = await asyncio.to_thread(tick, d1.cursor)
    assert not d2.run_requests
    assert d2.skip_message == f"no membership change (revision {v1.revision})"
    assert d2.cursor in (None, d1.cursor)

    # m2 joins: partitions 2 and 3 move m1 -> m2
    v2 = await admin.add_members(js, stream, GROUP, ["m2"])
    assert v2.revision > v1.revision
    assert assignment(v2.config) == {"m1": [0, 1], "m2": [2, 3]}
    d3 = await asyncio.to_thread(tick, d1.cursor)
    check_tick(d3, v2.revision, {"m1": [0, 1], "m2": [2, 3]}, [2, 3])
    assert [(e.partition, e.metadata["moved_to"].value) for e in d3.asset_events] == [
        ("g-2", "m2"), ("g-3", "m2")]

    # m0 joins: 0 -> m0 (from m1), 3 -> m0 (from m2); m2 keeps 2 and gains nothing
    v3 = await admin.add_members(js, stream, GROUP, ["m0"])
    assert assignment(v3.config) == {"m0": [0, 3], "m1": [1], "m2": [2]}
    d4 = await asyncio.to_thread(tick, d3.cursor)
    check_tick(d4, v3.revision, {"m0": [0, 3], "m1": [1], "m2": [2]},
               [0, 3] if served is None else [])

    # the daemon keeps run keys forever: every request so far has a distinct key
    keys = [r.run_key for d in (d1, d3, d4) for r in d.run_requests or []]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize("corrupt", ["{bad", "[1, 2]", '{"rev": "x", "assignment": {}}'])
async def test_membership_sensor_recovers_from_a_corrupt_cursor(
        js: JetStreamContext, nats_server: NatsServer, unique_name: str, warehouse: str,
        instance: DagsterInstance, corrupt: str) -> None:
    """A corrupt cursor is reset with a warning (in the tick's reason), never a skip forever:
    the tick then acts as a first tick (every partition gained is run) and writes a good
    cursor, so the next tick sees no change."""
    stream = unique_name
    v = await h.create_group(js, stream, members=("m1",))
    # Served m2 only: m1 owns everything, nothing gained; the tick's reason carries the warning.
    other = make_defs(stream, nats_server.url, warehouse, members=["m2"])
    d0 = await asyncio.to_thread(h.tick, other, MEMBERSHIP_SENSOR, instance, cursor=corrupt)
    assert not d0.run_requests
    assert d0.skip_message is not None and "corrupt membership cursor" in d0.skip_message
    assert "starting over from an empty cursor" in d0.skip_message
    assert decode_cursor(d0.cursor, MembershipCursor) == MembershipCursor(
        v.revision, {"m1": [0, 1, 2, 3]})
    # Every member served: every partition is run, as at a first tick.
    defs = make_defs(stream, nats_server.url, warehouse)
    d1 = await asyncio.to_thread(h.tick, defs, MEMBERSHIP_SENSOR, instance, cursor=corrupt)
    _check_requests(list(d1.run_requests or []), stream, [0, 1, 2, 3],
                    [f"{GROUP}:member:{v.revision}:{p}" for p in range(4)])
    assert decode_cursor(d1.cursor, MembershipCursor).revision == v.revision
    d2 = await asyncio.to_thread(h.tick, defs, MEMBERSHIP_SENSOR, instance, cursor=d1.cursor)
    assert not d2.run_requests
    assert d2.skip_message == f"no membership change (revision {v.revision})"


async def test_backlog_sensor_recovers_from_a_corrupt_cursor(
        js: JetStreamContext, nats_server: NatsServer, unique_name: str, warehouse: str,
        instance: DagsterInstance) -> None:
    """The backlog sensor's corrupt cursor is reset with a warning in the tick's reason (it
    was reset silently before) and replaced by a good one."""
    stream = unique_name
    await h.create_group(js, stream)
    defs = make_defs(stream, nats_server.url, warehouse)
    d = await asyncio.to_thread(h.tick, defs, BACKLOG_SENSOR, instance,
                                cursor='{"dead_letters": {"x": 1}}')
    assert not d.run_requests
    assert d.skip_message is not None and d.skip_message.startswith(
        "corrupt backlog cursor '{\"dead_letters\": {\"x\": 1}}': ValueError: ")
    assert "starting over from an empty cursor" in d.skip_message
    assert d.skip_message.endswith("no partition with backlog"), d.skip_message
    assert isinstance(decode_cursor(d.cursor, BacklogCursor), BacklogCursor)
    d2 = await asyncio.to_thread(h.tick, defs, BACKLOG_SENSOR, instance, cursor=d.cursor)
    assert d2.skip_message == "no partition with backlog"


# ---------------------------------------------------------------------------------- backlog


async def test_backlog_sensor_one_request_per_partition_with_backlog(
        js: JetStreamContext, nats_server: NatsServer, unique_name: str, warehouse: str,
        instance: DagsterInstance) -> None:
    stream = unique_name
    await h.create_group(js, stream)
    defs = make_defs(stream, nats_server.url, warehouse)

    # no backlog at all
    empty = await asyncio.to_thread(h.tick, defs, BACKLOG_SENSOR, instance)
    assert not empty.run_requests and empty.skip_message == "no partition with backlog"

    evs = h.events_on({1, 3})
    await h.publish(js, stream, evs, len(evs))
    # work-queue sequences follow the publish order (one origin stream, sourced in order)
    first = {p: h.first_index(evs, p) + 1 for p in (1, 3)}

    d1 = await asyncio.to_thread(h.tick, defs, BACKLOG_SENSOR, instance)
    _check_requests(list(d1.run_requests or []), stream, [1, 3],
                    [f"{GROUP}:{p}:{first[p]}" for p in (1, 3)])
    # the same backlog gives the same run keys (the daemon launches it once)
    d2 = await asyncio.to_thread(h.tick, defs, BACKLOG_SENSOR, instance)
    assert [r.run_key for r in d2.run_requests or []] == [r.run_key for r in
                                                          d1.run_requests or []]

    # drain partition 1 through Dagster, then publish more to it: a new backlog, a new key
    job = defs.resolve_job_def(JOB)
    res = await asyncio.to_thread(job.execute_in_process, partition_key="g-1", instance=instance)
    assert res.success
    more = h.events_on({1}, prefix="x")
    await h.publish(js, stream, more, len(evs) + len(more))
    d3 = await asyncio.to_thread(h.tick, defs, BACKLOG_SENSOR, instance)
    new_first_1 = len(evs) + h.first_index(more, 1) + 1
    _check_requests(list(d3.run_requests or []), stream, [1, 3],
                    [f"{GROUP}:1:{new_first_1}", f"{GROUP}:3:{first[3]}"])
    assert d3.run_requests and d1.run_requests
    assert d3.run_requests[0].run_key != d1.run_requests[0].run_key


async def test_backlog_sensor_thresholds_and_served_members(
        js: JetStreamContext, nats_server: NatsServer, unique_name: str, warehouse: str,
        instance: DagsterInstance) -> None:
    stream = unique_name
    await h.create_group(js, stream, members=("m1", "m2"))  # m1: 0, 1; m2: 2, 3
    defs = make_defs(stream, nats_server.url, warehouse)
    evs = h.events_on({1, 3})
    await h.publish(js, stream, evs, len(evs))
    pending = {p: sum(1 for k, _ in evs if h.partition_of(k) == p) for p in (1, 3)}

    def tick(members: list[str] | None = None, min_pending: int = 1,
             max_age_s: float | None = None) -> h.SensorExecutionData:
        resources = make_resources(nats_server.url, warehouse, members,
                                   min_pending=min_pending, max_age_s=max_age_s)
        return h.tick(defs, BACKLOG_SENSOR, instance, resources=resources)

    big = await asyncio.to_thread(tick, min_pending=10_000)
    assert not big.run_requests and big.skip_message == "no partition with backlog"
    # a threshold between the two partitions' backlogs: only the larger one qualifies
    assert pending[1] < pending[3], pending  # 100 and 101 with these events
    mid = await asyncio.to_thread(tick, min_pending=pending[3])
    assert h.partitions_of(list(mid.run_requests or [])) == ["g-3"]
    assert [r.run_key for r in mid.run_requests or []] == [
        f"{GROUP}:3:{h.first_index(evs, 3) + 1}"]
    # ... or when the oldest pending message is old enough
    await asyncio.sleep(0.2)  # the oldest pending message gets older than max_age_s 0.1
    aged = await asyncio.to_thread(tick, min_pending=10_000, max_age_s=0.1)
    assert h.partitions_of(list(aged.run_requests or [])) == ["g-1", "g-3"]
    young = await asyncio.to_thread(tick, min_pending=10_000, max_age_s=3600.0)
    assert not young.run_requests
    # a deployment serving only m2 runs only m2's partition 3
    only_m2 = await asyncio.to_thread(tick, members=["m2"])
    assert h.partitions_of(list(only_m2.run_requests or [])) == ["g-3"]


# ------------------------------------------------------------------------------ drain schedule


async def test_drain_schedule_requests_partitions_with_backlog(
        js: JetStreamContext, nats_server: NatsServer, unique_name: str, warehouse: str,
        instance: DagsterInstance) -> None:
    stream = unique_name
    await h.create_group(js, stream)
    defs = make_defs(stream, nats_server.url, warehouse)

    def evaluate() -> list[RunRequest] | SkipReason:
        data = h.schedule_tick(defs, DRAIN_SCHEDULE, instance)
        if data.skip_message:
            return SkipReason(data.skip_message)
        return list(data.run_requests or [])

    nothing = await asyncio.to_thread(evaluate)
    assert isinstance(nothing, SkipReason)
    assert nothing.skip_message == "no partition with backlog"

    evs = h.events_on({0, 2})
    await h.publish(js, stream, evs, len(evs))
    reqs = await asyncio.to_thread(evaluate)
    assert isinstance(reqs, list)
    _check_requests(reqs, stream, [0, 2],
                    [f"{GROUP}:{p}:{h.first_index(evs, p) + 1}" for p in (0, 2)])
    assert all(r.job_name in (None, JOB) for r in reqs)


# ----------------------------------------------------------------------------- broken config


BROKEN = ["missing-group", "invalid-json", "mapping-misses-a-partition", "max-members-differs",
          "max-members-changed-in-kv"]
Fix = Callable[[], Awaitable[object]]


async def _break(js: JetStreamContext, stream: str, how: str) -> tuple[str, Fix]:
    """Set up the broken case (a backlog on partitions 1 and 3 published first); returns text
    the skip reason must contain and how to repair the config (as an operator would)."""
    partitions = 3 if how == "max-members-differs" else PARTITIONS
    v = await h.create_group(js, stream, max_members=partitions)
    evs = h.events_on({1, 3})
    await h.publish(js, stream, evs, len(evs))
    kv = await js.key_value(ELASTIC_BUCKET)
    key = config_key(stream, GROUP)

    async def put_back() -> object:
        return await kv.put(key, v.config.to_json())

    async def recreate() -> object:
        await admin.delete_elastic(js, stream, GROUP)
        return await h.create_group(js, stream)

    if how == "missing-group":
        await admin.delete_elastic(js, stream, GROUP)
        return "not found", recreate
    if how == "invalid-json":  # written by another tool
        await kv.put(key, b"{oops")
        return "not valid JSON: Expecting property name", put_back
    if how == "mapping-misses-a-partition":
        await kv.put(key, replace(v.config, members=(), member_mappings=(
            MemberMapping("m1", (0, 1, 2)),)).to_json())
        return "every partition in [0, 4) must be mapped; missing [3]", put_back
    if how == "max-members-changed-in-kv":  # valid JSON, but not the group the code declares
        await kv.put(key, replace(v.config, max_members=3).to_json())
        return "3 partitions in KV but the code declares 4", put_back
    return "3 partitions in KV but the code declares 4", recreate


@pytest.mark.parametrize("how", BROKEN)
async def test_broken_config_skips_with_reason(
        js: JetStreamContext, nats_server: NatsServer, unique_name: str, warehouse: str,
        instance: DagsterInstance, how: str) -> None:
    stream = unique_name
    expected, fix = await _break(js, stream, how)
    defs = make_defs(stream, nats_server.url, warehouse)

    def evaluate_all() -> list[tuple[str, str | None, list[str]]]:
        out = []
        for name in (MEMBERSHIP_SENSOR, BACKLOG_SENSOR):
            d = h.tick(defs, name, instance)
            runs = [r for r in d.run_requests or [] if r.job_name != f"{ASSET}_checks"]
            out.append((name, d.skip_message, h.partitions_of(runs)))
        s = h.schedule_tick(defs, DRAIN_SCHEDULE, instance)
        out.append((DRAIN_SCHEDULE, s.skip_message, h.partitions_of(list(s.run_requests or []))))
        return out

    t0 = time.perf_counter()
    for name, skip, requested in await asyncio.to_thread(evaluate_all):
        assert requested == [], name
        assert skip is not None, name
        assert skip.startswith(f"consumer group {stream}.{GROUP}: "), (name, skip)
        assert expected in skip, (name, skip)
    assert time.perf_counter() - t0 < 10  # bounded: no retry loop on a broken config

    # A run of a partition fails with the same explanation before consuming anything.
    api = JetStreamAPI.from_js(js)
    wq = work_queue_stream_name(stream, GROUP)
    queued = None if how == "missing-group" else await h.work_queue_messages(js, stream)
    res = await asyncio.to_thread(defs.resolve_job_def(JOB).execute_in_process,
                                  partition_key="g-1", instance=instance, raise_on_error=False)
    assert not res.success
    failure = res.failure_data_for_node("keyed_events")
    assert failure is not None and failure.user_failure_data is not None
    assert expected in (failure.user_failure_data.description or "")
    if queued is None:
        with pytest.raises(StreamNotFoundError):
            await api.stream_info(wq)
    else:
        assert await h.work_queue_messages(js, stream) == queued
        assert await api.list_consumer_names(wq) == []  # no lease consumer was created

    # Repaired: the next ticks work again (no crash loop). The failed run of g-1 is
    # remembered: once its backoff (1 s in these tests) has passed it is requested again,
    # under a run key of its own (the first attempt's key is used up forever).
    await fix()
    await h.wait_sourced(js, stream, len(h.events_on({1, 3})))
    await asyncio.sleep(1.2)  # past g-1's retry backoff (1 s)
    retry = await asyncio.to_thread(h.tick, defs, BACKLOG_SENSOR, instance)
    keys = {r.partition_key: r.run_key for r in retry.run_requests or [] if r.job_name == JOB}
    # the failed run planned g-1's lag check and never evaluated it (Dagster: "execution
    # failed"); g-1 is not late, so no check-only run: its next drain run evaluates it
    assert [r for r in retry.run_requests or [] if r.job_name == f"{ASSET}_checks"] == []
    assert keys["g-1"].endswith(":1") and keys["g-1"].startswith(f"{GROUP}:1:"), keys
    assert keys["g-3"].count(":") == 2, keys  # never failed: the plain backlog key
    for name, skip, requested in await asyncio.to_thread(evaluate_all):
        if name == MEMBERSHIP_SENSOR:
            assert (skip, requested) == (None, ["g-0", "g-1", "g-2", "g-3"]), (name, skip)
        else:
            assert (skip, requested) == (None, ["g-1", "g-3"]), (name, skip)


# ------------------------------------------------------------ lag, checks and reconcile events


async def test_backlog_sensor_records_lag_checks_and_reconciles(
        js: JetStreamContext, nats_server: NatsServer, unique_name: str, warehouse: str,
        instance: DagsterInstance) -> None:
    """Each tick observes the lag of partitions with a backlog at most every
    ``lag_refresh_s`` (a stuck partition's age is refreshed, an idle one is never observed),
    records the partitioned lag and runs checks only where they changed (first results
    run-less; later ones by a check-only run of the partition, whose results target its latest
    materialization), and the origin reconciliation at most every
    ``reconcile_interval_s``."""
    stream = unique_name
    await h.create_group(js, stream)
    info = await js.stream_info(stream)  # the reconciliation reads the origin by direct get
    await js.update_stream(replace(info.config, allow_direct=True))
    spec = replace(make_spec(stream), lag_objective_s=0.1, reconcile_interval_s=3600.0,
                   origin_seq_column="seq", lag_refresh_s=2.0)
    defs = build_definitions([spec], resources=make_resources(nats_server.url, warehouse))
    evs = h.events_on({1, 3})
    await h.publish(js, stream, evs, len(evs))
    await asyncio.sleep(0.3)  # older than the 0.1 s lag objective

    def observations(d: h.SensorExecutionData) -> dict[str, dict]:
        return {e.partition: e.metadata for e in d.asset_events
                if type(e).__name__ == "AssetObservation"}

    def states() -> dict[tuple[str, str], tuple[bool | None, bool]]:
        return {k: (s.passed, s.current) for k, s in check_states(
            instance, AssetKey(ASSET), ["lag_within_objective", "partition_runs_succeeding"]
        ).items()}

    t1 = time.time()
    d1 = await asyncio.to_thread(h.tick, defs, BACKLOG_SENSOR, instance)
    obs = observations(d1)
    assert sorted(obs) == ["g-1", "g-3"]  # nothing pending on 0 and 2: nothing to say
    pending = {p: sum(1 for k, _ in evs if h.partition_of(k) == p) for p in range(4)}
    assert {k: md["pending"].value for k, md in obs.items()} == {
        f"g-{p}": n for p, n in pending.items() if n}
    assert obs["g-1"]["oldest_pending_age_s"].value >= 0.1
    lag = {p: passed for (name, p), (passed, _) in states().items()
           if name == "lag_within_objective"}
    assert lag == {"g-0": True, "g-1": False, "g-2": True, "g-3": False}
    assert all(passed for (name, _), (passed, _) in states().items()
               if name == "partition_runs_succeeding")
    assert len(states()) == 8
    checks = {e.check_name: e for e in d1.asset_events if hasattr(e, "check_name")}
    # nothing processed yet: every origin message is still queued, so the group reconciles
    assert checks["origin_reconciled"].passed

    # Same backlog, within the refresh interval: no event, no check recorded again.
    d2 = await asyncio.to_thread(h.tick, defs, BACKLOG_SENSOR, instance, cursor=d1.cursor)
    assert d2.asset_events == []
    # ... and no request repeated: the same run keys were requested a moment ago.
    assert h.partitions_of(list(d1.run_requests or [])) == ["g-1", "g-3"]
    assert not d2.run_requests
    assert d2.skip_message is not None and "2 partition(s) already requested under the " \
        "same run key less than 300 s ago" in d2.skip_message, d2.skip_message
    d2b = await asyncio.to_thread(h.tick, defs, BACKLOG_SENSOR, instance)  # no cursor
    assert h.partitions_of(list(d2b.run_requests or [])) == ["g-1", "g-3"]

    # Partition 1 drained (a run): the run itself evaluates g-1's lag check after its
    # materialization (freshness per partition: passing and current, no check-only run);
    # partition 3, stuck, gets its age refreshed (older than at the first tick) and its lag
    # state stays "late".
    job = defs.resolve_job_def(JOB)
    assert (await asyncio.to_thread(job.execute_in_process, partition_key="g-1",
                                    instance=instance)).success
    assert states()[("lag_within_objective", "g-1")] == (True, True)
    await asyncio.sleep(max(0.0, t1 + 2.1 - time.time()))  # past lag_refresh_s (2 s) since d1
    d3 = await asyncio.to_thread(h.tick, defs, BACKLOG_SENSOR, instance, cursor=d2.cursor)
    obs3 = observations(d3)
    assert sorted(obs3) == ["g-1", "g-3"] and obs3["g-1"]["pending"].value == 0
    assert obs3["g-1"]["lag_state"].value == "caught_up"  # a change of state: drained
    assert obs3["g-1"]["last_committed_seq"].value > 0
    assert obs3["g-3"]["lag_state"].value == "late"  # same state: the slow cadence (2 s)
    assert obs3["g-3"]["oldest_pending_age_s"].value > obs["g-3"]["oldest_pending_age_s"].value
    assert obs3["g-3"]["oldest_pending_timestamp"].value == pytest.approx(
        obs["g-3"]["oldest_pending_timestamp"].value, abs=0.01)  # the same stuck message
    assert obs3["g-3"]["pending"].value == pending[3]
    checks_job = f"{ASSET}_checks"
    assert [r for r in d3.run_requests or [] if r.job_name == checks_job] == []
    now = states()
    assert now[("lag_within_objective", "g-1")] == (True, True)
    assert now[("lag_within_objective", "g-3")] == (False, True)
    assert not any(getattr(e, "check_name", "") == "origin_reconciled"
                   for e in d3.asset_events)  # not again within the hour


# ------------------------------------------------------------------------ checks by hand


async def test_check_executed_by_hand_computes_only_the_check(
        js: JetStreamContext, nats_server: NatsServer, unique_name: str, warehouse: str,
        instance: DagsterInstance) -> None:
    """Executing ``lag_within_objective`` / ``partition_runs_succeeding`` for one partition
    (the Checks tab's "Execute") evaluates that check of that partition, and nothing of a
    tick: a run of another partition whose worker process is gone stays as it is (a tick
    would mark it failed)."""
    stream = unique_name
    await h.create_group(js, stream)
    spec = replace(make_spec(stream), lag_objective_s=0.1)
    defs = build_definitions([spec], resources=make_resources(nats_server.url, warehouse))
    evs = h.events_on({1})
    await h.publish(js, stream, evs, len(evs))
    await asyncio.sleep(0.3)  # older than the 0.1 s lag objective
    lost = DagsterRun(job_name=JOB, run_id="lost-run", status=DagsterRunStatus.STARTED,
                      tags={"dagster/partition": pkey(1),
                            WORKER_TAG: f"{socket.gethostname()} 999999999 1"})
    instance.add_run(lost)
    job = defs.resolve_implicit_global_asset_job_def()

    def execute(name: str, key: str) -> AssetCheckEvaluation:
        check = AssetCheckKey(AssetKey(ASSET), name)
        result = job.get_subset(asset_selection=set(), asset_check_selection={check}) \
            .execute_in_process(partition_key=key, instance=instance)
        assert result.success
        (ev,) = result.get_asset_check_evaluations()
        return ev

    lag1 = await asyncio.to_thread(execute, "lag_within_objective", pkey(1))
    assert not lag1.passed and "more than the 0.1 s objective" in (lag1.description or "")
    assert (await asyncio.to_thread(execute, "lag_within_objective", pkey(0))).passed
    runs1 = await asyncio.to_thread(execute, "partition_runs_succeeding", pkey(1))
    assert runs1.passed and runs1.partition == pkey(1)
    run = instance.get_run_by_id("lost-run")
    assert run is not None and run.status == DagsterRunStatus.STARTED  # left to the sensor
    # the sensor's tick does handle it
    await asyncio.to_thread(h.tick, defs, BACKLOG_SENSOR, instance)
    run = instance.get_run_by_id("lost-run")
    assert run is not None and run.status == DagsterRunStatus.FAILURE
