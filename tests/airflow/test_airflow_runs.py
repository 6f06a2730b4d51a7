"""A real Airflow 3 drives consumer-group partitions (issue 52's "Done when"): the backlog
trigger starts runs for exactly the partitions with backlog, one run per partition key, the
table exact; a drain task killed with SIGKILL mid-run is retried by Airflow and the table
stays exact (0 lost, 0 duplicated, 0 reordered against the pandas reference); a co-partitioned
set runs as one Dag.

Airflow (scheduler, triggerer, dag-processor, api-server) is started once for the module
(:mod:`tests.airflow.conftest`); each test writes its own Dag file over its own stream."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from nats.js import JetStreamContext

from cg_pipelines.local.nats_server import NatsServer
from tests.airflow.conftest import write_dag_file
from tests.dagster import helpers as h
from tests.support import keyed
from tests.support.airflow_stack import AirflowStack
from tests.support.wait import wait_for

pytestmark = [pytest.mark.airflow, pytest.mark.integration]

RUN_TIMEOUT_S = 180.0
"""Seconds a scenario's runs may take on a loaded 2-core host (Dag parse, dispatch, worker
runs, each task a fresh process)."""

DAG_FILE = '''
from cg_pipelines.airflow import ConsumerGroupDag, build_dags
from cg_pipelines.core.triggers import RetryPolicy
from cg_pipelines.engine.options import EngineOptions
from cg_pipelines.jetstream.connect import ConnectOptions
{imports}

globals().update(build_dags([ConsumerGroupDag(
    {name!r}, {stream!r}, "g", 4, {processor}, {table!r},
    nats=ConnectOptions({url!r}), recheck_s=1.0, repeat_s={repeat_s},
    retry=RetryPolicy(max_failures=4, backoff_s=1.0, max_backoff_s=4.0),
    engine=EngineOptions(batch_max_msgs={batch}, ack_wait_s=1.5, priority_timeout_s=1.5,
                         hold_wait_s=3.0))]))
'''


def dag_file(name: str, stream: str, table: Path, url: str, *, batch: int = 20_000,
             processor: str = "keyed.processor()",
             imports: str = "from tests.support import keyed", repeat_s: float = 600.0) -> str:
    return DAG_FILE.format(name=name, stream=stream, table=str(table), url=url, batch=batch,
                           processor=processor, imports=imports, repeat_s=repeat_s)


async def start_scenario(airflow: AirflowStack, js: JetStreamContext, nats_server: NatsServer,
                         stream: str, name: str, table: Path, evs: list[tuple[str, int]],
                         **dag: Any) -> None:
    """A scenario's start: group ``g`` on ``stream``, ``evs`` published and sourced, and the
    Dag file of ``name`` (:func:`dag_file` with ``dag``) written."""
    await h.create_group(js, stream)
    await h.publish(js, stream, evs, len(evs))
    write_dag_file(airflow.dags, name, dag_file(name, stream, table, nats_server.url, **dag))


def table_of(path: Path, evs: list[tuple[str, int]]) -> pd.DataFrame:
    from cg_pipelines.sinks.delta import DeltaSink
    return keyed.table_frame(DeltaSink(str(path), schema=keyed.OUT_SCHEMA).read())


def assert_exact(path: Path, evs: list[tuple[str, int]]) -> None:
    """The table equals the pandas reference row for row: 0 lost, 0 duplicated, 0 reordered
    (``count`` and ``prev_n`` are right only in per-key order)."""
    pd.testing.assert_frame_equal(table_of(path, evs), keyed.reference(evs), check_dtype=False)


def runs_by_state(af: AirflowStack, dag_id: str) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r in af.dag_runs(dag_id):
        out.setdefault(r["state"], []).append(r)
    return out


def finished(af: AirflowStack, dag_id: str, n: int) -> list[dict[str, Any]] | None:
    """The Dag's runs once ``n`` have ended and none is queued or running; fails fast on a
    failed run (with its tasks' states)."""
    runs = af.dag_runs(dag_id)
    failed = [r for r in runs if r["state"] == "failed"]
    assert not failed, "failed run(s): " + str(
        [(r["dag_run_id"], r.get("partition_key"), af.task_instances(dag_id, r["dag_run_id"]))
         for r in failed])[:3000]
    done = [r for r in runs if r["state"] == "success"]
    if len(done) >= n and len(done) == len(runs):
        return runs
    return None


async def test_backlog_in_two_of_four_partitions_starts_exactly_those_runs(
        airflow: AirflowStack, js: JetStreamContext, nats_server: NatsServer, unique_name: str,
        tmp_path: Path) -> None:
    stream, name = unique_name, f"a_{unique_name}"
    table = tmp_path / "table"
    evs = h.events_on({1, 3})
    await start_scenario(airflow, js, nats_server, stream, name, table, evs)

    runs = await wait_for(lambda: finished(airflow, name, 2), RUN_TIMEOUT_S,
                          "2 successful worker runs")
    assert sorted(r["partition_key"] for r in runs) == ["g-1", "g-3"]
    assert_exact(table, evs)
    for r in runs:
        tis = {t["task_id"]: t["state"] for t in airflow.task_instances(name, r["dag_run_id"])}
        p = int(r["partition_key"].rsplit("-", 1)[1])
        assert tis.pop("route") == "success" and tis.pop(f"drain_p{p}") == "success", tis
        assert set(tis.values()) == {"skipped"}, tis  # the other partitions' tasks

    events = airflow.asset_events(name)
    assert sorted(e["partition_key"] for e in events) == ["g-1", "g-3"]
    for e in events:
        p = int(e["partition_key"].rsplit("-", 1)[1])
        mine = [ev for ev in evs if h.partition_of(ev[0]) == p]
        x = e["extra"]
        assert (x["status"], x["mode"], x["partition"], x["messages"]) == \
            ("drained", "drain", p, len(mine))
        assert x["lineage"][0]["last_seq"] >= x["lineage"][0]["first_seq"] >= 1
        assert x["watermark"] == x["last_seq"] and x["dead_lettered"] == 0
    # the dispatch events show each dispatched partition's backlog (its lag) at dispatch
    shown = {k: v["pending"] for e in airflow.asset_events(f"{name}__backlog")
             for k, v in (e["extra"] or {}).get("backlog", {}).items()}
    assert set(shown) == {"g-1", "g-3"}, shown
    assert all(0 < n <= sum(1 for ev in evs if h.partition_of(ev[0]) == int(k[2:]))
               for k, n in shown.items()), shown

    # New backlog on partition 1 only: exactly one more run, of g-1 (had the trigger
    # announced partitions 0 or 2 in the rounds since, their runs would be here too).
    more = h.events_on({1}, prefix="x")
    await h.publish(js, stream, more, len(evs) + len(more))
    runs = await wait_for(lambda: finished(airflow, name, 3), RUN_TIMEOUT_S,
                          "a third successful worker run")
    assert sorted(r["partition_key"] for r in runs) == ["g-1", "g-1", "g-3"]
    assert_exact(table, evs + more)


async def test_drain_killed_mid_run_is_retried_and_the_table_is_exact(
        airflow: AirflowStack, js: JetStreamContext, nats_server: NatsServer, unique_name: str,
        tmp_path: Path) -> None:
    stream, name = unique_name, f"b_{unique_name}"
    table, marker, pidfile = tmp_path / "table", tmp_path / "kill-me", tmp_path / "pid"
    marker.write_text("")
    evs = h.events_on({2}, n_keys=40, n_events=600)
    await start_scenario(
        airflow, js, nats_server, stream, name, table, evs, batch=25,
        processor=f"killable.processor({str(marker)!r}, {str(pidfile)!r})",
        imports="from tests.airflow import killable")

    await wait_for(pidfile.exists, RUN_TIMEOUT_S, "the drain task to stop in its 2nd batch")
    pid = int(pidfile.read_text())
    os.kill(pid, signal.SIGKILL)
    killed_at = time.time()

    runs = await wait_for(lambda: finished(airflow, name, 1), RUN_TIMEOUT_S,
                          "the worker run to succeed after the kill")
    assert [r["partition_key"] for r in runs] == ["g-2"]
    tries = airflow.tries(name, runs[0]["dag_run_id"], "drain_p2")
    assert len(tries) >= 2, tries
    assert tries[0]["state"] == "failed" and tries[-1]["state"] == "success", \
        [(t["try_number"], t["state"]) for t in tries]
    assert tries[-1]["start_date"] is not None and killed_at > 0
    assert_exact(table, evs)
    assert not marker.exists()  # the retry ran the whole backlog without stopping


def ended(af: AirflowStack, dag_id: str, n: int) -> list[dict[str, Any]] | None:
    """The Dag's runs once ``n`` have ended (success or failed) and none is queued or
    running."""
    runs = af.dag_runs(dag_id)
    done = [r for r in runs if r["state"] in ("success", "failed")]
    return runs if len(done) >= n and len(done) == len(runs) else None


def when(stamp: str) -> float:
    from datetime import datetime
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


async def test_failing_partition_is_retried_with_backoff_then_stops(
        airflow: AirflowStack, js: JetStreamContext, nats_server: NatsServer, unique_name: str,
        tmp_path: Path) -> None:
    stream, name = unique_name, f"c_{unique_name}"
    table = tmp_path / "table"
    await h.create_group(js, stream)
    evs = h.events_on({1})
    await h.publish(js, stream, evs, len(evs))
    write_dag_file(airflow.dags, name, dag_file(
        name, stream, table, nats_server.url, processor=f"killable.failing({evs[0][0]!r})",
        imports="from tests.airflow import killable", repeat_s=10.0,
    ).replace("max_failures=4", "max_failures=3"))

    runs = await wait_for(lambda: ended(airflow, name, 1), RUN_TIMEOUT_S,
                          "the failing run to end")
    assert [(r["partition_key"], r["state"]) for r in runs] == [("g-1", "failed")]
    tries = airflow.tries(name, runs[0]["dag_run_id"], "drain_p1")
    assert [t["state"] for t in tries] == ["failed", "failed", "failed"], tries
    gaps = [when(b["start_date"]) - when(a["end_date"]) for a, b in
            zip(tries, tries[1:], strict=False)]
    assert gaps[0] >= 1.0 and gaps[1] >= 2.0, gaps  # core's backoff: 1 s, then 2 s

    # It stops: the trigger announces partition 1's backlog again (repeat_s), and the dispatcher
    # gives up on it with core's reason in its log; no second run of g-1 starts.
    failed_at = when(runs[0]["end_date"])
    dispatch = f"{name}__dispatch"

    def gave_up() -> bool:
        for r in airflow.dag_runs(dispatch):
            if r["state"] != "success" or when(r["start_date"]) < failed_at:
                continue
            [ti] = airflow.task_instances(dispatch, r["dag_run_id"])
            if ti["state"] == "skipped":
                log = airflow.task_log(dispatch, r["dag_run_id"], "dispatch", 1)
                assert "failed 3 time(s) in a row, the limit (3)" in log, log[-2000:]
                assert "poisoned key" in log, log[-2000:]
                return True
        return False

    await wait_for(gave_up, RUN_TIMEOUT_S, "a dispatch run after the failure giving up")
    # New backlog elsewhere still runs; partition 1 has still one (failed) run.
    more = h.events_on({2}, prefix="z")
    await h.publish(js, stream, more, len(evs) + len(more))
    runs = await wait_for(lambda: ended(airflow, name, 2), RUN_TIMEOUT_S, "partition 2's run")
    assert sorted((r["partition_key"], r["state"]) for r in runs) == \
        [("g-1", "failed"), ("g-2", "success")]


async def test_rebuild_of_one_partition_is_identical_to_the_drained_one(
        airflow: AirflowStack, js: JetStreamContext, nats_server: NatsServer, unique_name: str,
        tmp_path: Path) -> None:
    stream, name = unique_name, f"d_{unique_name}"
    table = tmp_path / "table"
    evs = h.events_on({0})
    await start_scenario(airflow, js, nats_server, stream, name, table, evs)
    await wait_for(lambda: finished(airflow, name, 1), RUN_TIMEOUT_S, "the drain run")
    drained = table_of(table, evs)

    airflow.api("POST", f"/dags/{name}/dagRuns", {
        "logical_date": None, "partition_key": "g-0", "conf": {"mode": "rebuild"}})
    runs = await wait_for(lambda: finished(airflow, name, 2), RUN_TIMEOUT_S, "the rebuild run")
    assert [r["partition_key"] for r in runs] == ["g-0", "g-0"]
    pd.testing.assert_frame_equal(table_of(table, evs), drained)
    assert_exact(table, evs)
    rebuilt = [e["extra"] for e in airflow.asset_events(name) if e["extra"].get("mode") ==
               "rebuild"]
    assert len(rebuilt) == 1 and rebuilt[0]["rebuilt"] is True, rebuilt
    assert rebuilt[0]["lineage"][0]["rows_replaced"] == len(evs)


SET_DAG_FILE = '''
from cg_pipelines.airflow import CoPartitionedDag, build_dags
from cg_pipelines.jetstream.connect import ConnectOptions
from tests.support import joined

globals().update(build_dags([CoPartitionedDag(
    {name!r}, joined.inputs({stream!r}), 4, joined.processor(), {table!r},
    write=joined.WRITE, nats=ConnectOptions({url!r}), recheck_s=1.0, repeat_s=600.0)]))
'''


async def test_a_co_partitioned_set_runs_as_one_dag(
        airflow: AirflowStack, js: JetStreamContext, nats_server: NatsServer, unique_name: str,
        tmp_path: Path) -> None:
    from deltalake import DeltaTable

    from cg_pipelines.core.subjects import partition_for
    from tests.support import joined

    stream, name = unique_name, f"s_{unique_name}"
    table = tmp_path / "table"
    # auctions of partitions 0 and 2 only, on both inputs: exactly those two runs
    evs = {n: [m for m in msgs if partition_for([str(m["auction"])], 4) in (0, 2)]
           for n, msgs in joined.events(40).items()}
    api = await joined.setup(js, stream, evs, 4)
    write_dag_file(airflow.dags, name, SET_DAG_FILE.format(
        name=name, stream=stream, table=str(table), url=nats_server.url))

    runs = await wait_for(lambda: finished(airflow, name, 2), RUN_TIMEOUT_S,
                          "2 successful runs of the set")
    assert sorted(r["partition_key"] for r in runs) == ["g-0", "g-2"]
    assert joined.mismatches(DeltaTable(str(table)).to_pyarrow_table(), evs) is None
    assert await joined.left(api, stream) == 0
    events = airflow.asset_events(name)
    assert sorted(e["partition_key"] for e in events) == ["g-0", "g-2"]
    for e in events:  # one lineage row per input, summing to the run's messages
        lineage = e["extra"]["lineage"]
        assert [row["input"] for row in lineage] == [joined.IMP, joined.CLK]
        assert e["extra"]["messages"] == sum(row["messages"] for row in lineage) > 0
    assert sum(e["extra"]["messages"] for e in events) == sum(len(m) for m in evs.values())


CLEANED = "dag_run,task_instance,task_instance_history,asset_event,log"
"""Tables the guide's ``airflow db clean`` bounds (docs/guides/airflow.md, What grows). Not
``job`` here: the test cleans everything before *now*, which would delete the running
scheduler's and triggerer's job rows too (seen: no run after the clean); with the guide's
cutoff of days, live components' rows (heartbeats every few seconds) are never that old."""


async def test_db_clean_bounds_the_history_and_the_loop_goes_on(
        airflow: AirflowStack, js: JetStreamContext, nats_server: NatsServer, unique_name: str,
        tmp_path: Path) -> None:
    # last in the module: the asset events of every Dag before now are cleaned
    from datetime import UTC, datetime

    stream, name = unique_name, f"e_{unique_name}"
    table = tmp_path / "table"
    first = h.events_on({1, 2})
    await start_scenario(airflow, js, nats_server, stream, name, table, first)
    await wait_for(lambda: finished(airflow, name, 2), RUN_TIMEOUT_S, "the first runs")
    assert len(airflow.asset_events(name)) == 2

    airflow.cli("db", "clean", "--clean-before-timestamp", datetime.now(UTC).isoformat(),
                "--tables", CLEANED, "--skip-archive", "--yes", "--error-on-cleanup-failure")
    assert airflow.asset_events(name) == [] and airflow.asset_events(f"{name}__backlog") == []
    assert len(airflow.dag_runs(name)) == 1  # Airflow keeps each Dag's latest run

    # after the clean, a new backlog runs as before and the table stays exact
    second = h.events_on({2}, prefix="y")
    await h.publish(js, stream, second, len(first) + len(second))
    await wait_for(lambda: finished(airflow, name, 2), RUN_TIMEOUT_S, "the run after the clean")
    assert_exact(table, first + second)
    (event,) = airflow.asset_events(name)
    assert (event["partition_key"], event["extra"]["messages"]) == ("g-2", len(second))
