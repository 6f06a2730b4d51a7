"""The Airflow layer without Airflow's processes: the spec's checks, the Dags build_dags makes
(and that Airflow serializes them), core's retry rule as a task retry policy, the dispatch
rule, and the backlog trigger's ``run()`` against a real nats-server."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from nats.js import JetStreamContext

from cg_pipelines.airflow import ConsumerGroupDag, CoreRetryPolicy, NatsBacklogTrigger, build_dags
from cg_pipelines.airflow.tasks import held_back, partitions_of_events
from cg_pipelines.core.errors import ConfigError
from cg_pipelines.core.triggers import RetryPolicy
from cg_pipelines.jetstream.connect import ConnectOptions
from cg_pipelines.local.nats_server import NatsServer
from tests.dagster import helpers as h
from tests.support import keyed
from tests.support.airflow_context import Outlet, StateStore


def spec(**kw: Any) -> ConsumerGroupDag:
    args: dict[str, Any] = {"name": "legs", "stream": "S", "group": "g", "partitions": 4,
                            "processor": keyed.processor(), "table_uri": "/tmp/t"}
    args.update(kw)
    return ConsumerGroupDag(**args)


@pytest.mark.parametrize(("kw", "field"), [
    ({"name": "bad name"}, "name"), ({"stream": "a.b"}, "stream"), ({"group": ""}, "group"),
    ({"partitions": 0}, "partitions"), ({"table_uri": ""}, "table_uri"),
    ({"recheck_s": 0}, "recheck_s"), ({"repeat_s": -1}, "repeat_s"),
    ({"run_timeout_s": 0}, "run_timeout_s"), ({"min_pending": 0}, "min_pending"),
    ({"members": ()}, "members"),
    ({"nats": ConnectOptions("nats://u:secret@h:4222")}, "nats"),
    ({"nats": ConnectOptions(token="t0k")}, "nats"),
    ({"nats": ConnectOptions(user="u", password="p")}, "nats"),
])
def test_spec_refuses(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        spec(**kw)
    assert e.value.field == field
    assert "secret" not in str(e.value) and "t0k" not in str(e.value)


def test_spec_keys() -> None:
    s = spec()
    assert s.partition_keys() == ["g-0", "g-1", "g-2", "g-3"]
    assert s.partition_of("g-2") == 2
    assert spec(partition_key_prefix="legs/").partition_key(3) == "legs/3"
    with pytest.raises(ConfigError, match="not a partition key of legs"):
        s.partition_of("g-4")


def test_build_dags_shape_and_serialization() -> None:
    from airflow.serialization.serialized_objects import DagSerialization

    s = spec(retry=RetryPolicy(max_failures=3, backoff_s=2.0, max_backoff_s=8.0))
    dags = build_dags([s])
    assert sorted(dags) == ["legs", "legs__dispatch"]
    worker = dags["legs"]
    assert sorted(worker.task_ids) == ["drain_p0", "drain_p1", "drain_p2", "drain_p3", "route"]
    assert type(worker.timetable).__name__ == "PartitionedAssetTimetable"
    for p in range(4):
        t = worker.get_task(f"drain_p{p}")
        assert t.upstream_task_ids == {"route"}
        assert t.max_active_tis_per_dag == 1
        assert (t.retries, t.retry_delay, t.retry_exponential_backoff, t.max_retry_delay) == \
            (2, timedelta(seconds=2), 2.0, timedelta(seconds=8))
        assert [o.name for o in t.outlets] == ["legs"]
    assert [o.name for o in dags["legs__dispatch"].get_task("dispatch").outlets] == \
        ["legs__backlog"]
    for d in dags.values():
        back = DagSerialization.from_dict(DagSerialization.to_dict(d))
        assert sorted(back.task_ids) == sorted(d.task_ids)


def test_build_dags_refuses_a_group_twice() -> None:
    with pytest.raises(ConfigError, match="two specs are named"):
        build_dags([spec(), spec(stream="T")])
    with pytest.raises(ConfigError, match="group S.g is in specs 'legs' and 'other'"):
        build_dags([spec(), spec(name="other")])


@pytest.mark.parametrize(("try_number", "delay_s"), [(1, 2.0), (2, 4.0), (3, 8.0), (4, 8.0)])
def test_core_retry_policy(try_number: int, delay_s: float) -> None:
    pol = CoreRetryPolicy(RetryPolicy(max_failures=5, backoff_s=2.0, max_backoff_s=8.0))
    d = pol.evaluate(ValueError("bad row\npartition 1 of S.g: ..."), try_number, 5)
    assert (d.action.value, d.retry_delay, d.reason) == \
        ("retry", timedelta(seconds=delay_s), "bad row")
    assert CoreRetryPolicy.deserialize(pol.serialize()).policy == pol.policy


def test_partitions_of_events() -> None:
    extras = [{"payload": {"partitions": [3, 1]}}, {"payload": {"partitions": [1, 9, -1, "2"]}},
              {}, {"payload": None}]
    assert partitions_of_events(extras, 4) == [1, 3]


def test_trigger_serializes_without_secrets() -> None:
    s = spec(nats=ConnectOptions("nats://h:4222", creds="/run/secrets/nats.creds"))
    path, kwargs = NatsBacklogTrigger("legs", [["g", "S", "g"]], 4,
                                       s.connect_kwargs()).serialize()
    assert path == "cg_pipelines.airflow.trigger.NatsBacklogTrigger"
    assert kwargs["connect"]["creds"] == "/run/secrets/nats.creds"
    assert NatsBacklogTrigger(**kwargs).serialize() == (path, kwargs)


@pytest.mark.integration
async def test_trigger_announces_exactly_the_partitions_with_backlog(
        js: JetStreamContext, nats_server: NatsServer, unique_name: str) -> None:
    stream = unique_name
    await h.create_group(js, stream)
    evs = h.events_on({0, 2})
    await h.publish(js, stream, evs, len(evs))
    trig = NatsBacklogTrigger("legs", [["g", stream, "g"]], h.PARTITIONS,
                              {"servers": nats_server.url}, recheck_s=0.05, repeat_s=600.0)
    gen = trig.run().__aiter__()
    first = await asyncio.wait_for(gen.__anext__(), 30)
    assert first.payload["partitions"] == [0, 2]
    assert set(first.payload["run_keys"]) == {"0", "2"}

    # The same backlog is not announced again (repeat_s); new backlog on 3 alone is.
    more = h.events_on({3}, prefix="y")
    await h.publish(js, stream, more, len(evs) + len(more))
    second = await asyncio.wait_for(gen.__anext__(), 30)
    assert second.payload["partitions"] == [3]
    await gen.aclose()


@pytest.mark.integration
async def test_trigger_survives_a_missing_group(nats_server: NatsServer, unique_name: str,
                                                caplog: pytest.LogCaptureFixture) -> None:
    trig = NatsBacklogTrigger("legs", [["g", unique_name, "g"]], 4,
                              {"servers": nats_server.url}, recheck_s=0.05)
    gen = trig.run().__aiter__()
    task = asyncio.ensure_future(gen.__anext__())
    done, _ = await asyncio.wait({task}, timeout=1.0)
    assert not done  # no event, and no exception either
    assert any("not read" in r.getMessage() for r in caplog.records)
    for _ in range(50):  # as the triggerer does: cancel it (a cancel that lands in a
        task.cancel()     # NATS timeout of Python 3.11 can be lost: ask again, bounded)
        done, _ = await asyncio.wait({task}, timeout=0.2)
        if done:
            break
    assert task.cancelled()


def test_the_example_dag_file_parses(tmp_path: Path) -> None:
    from airflow.dag_processing.dagbag import DagBag

    (tmp_path / "cg.py").write_text(
        "from cg_pipelines.airflow import ConsumerGroupDag, build_dags\n"
        "from tests.support import keyed\n"
        "globals().update(build_dags([ConsumerGroupDag('legs', 'S', 'g', 2, "
        "keyed.processor(), '/tmp/t')]))\n")
    bag = DagBag(str(tmp_path))
    assert bag.import_errors == {}
    assert sorted(bag.dags) == ["legs", "legs__dispatch"]


def test_the_guide_s_dag_file_parses_and_names_only_its_connection(tmp_path: Path) -> None:
    # docs/guides/airflow.md's Dag file, as written (its other blocks are shell commands
    # against a running Airflow, not played here)
    from airflow.dag_processing.dagbag import DagBag

    from tests.docs.pages import REPO, blocks

    files = [text for lang, text in blocks(REPO / "docs" / "guides" / "airflow.md")
             if lang == "python" and text.startswith("# dags/")]
    assert len(files) == 1
    (tmp_path / "customer_totals.py").write_text(files[0])
    bag = DagBag(str(tmp_path))
    assert bag.import_errors == {}
    assert sorted(bag.dags) == ["customer_totals", "customer_totals__dispatch"]
    (trigger,) = [w.trigger for a in bag.dags["customer_totals__dispatch"].timetable
                  .asset_condition.objects for w in a.watchers]
    _, kwargs = trigger.serialize()
    assert kwargs["conn_id"] == "nats_default"
    assert kwargs["inputs"] == [["totals", "orders", "totals"]]


def test_held_back_partitions_follow_core_rule() -> None:
    s = spec(retry=RetryPolicy(max_failures=3, backoff_s=1.0, max_backoff_s=4.0),
             run_timeout_s=60.0)
    now = 1000.0
    records = {
        0: {"state": "failed", "final": True, "try": 3, "code": "v1", "error": "ValueError: x",
            "at": 10.0},
        1: {"state": "failed", "final": False, "try": 2, "code": "v1", "at": 990.0},  # retried
        2: {"state": "failed", "final": True, "try": 3, "code": "v0", "at": 990.0},  # old code
        3: {"state": "succeeded", "try": 1, "code": "v1", "at": 999.0},
        4: None,
        5: {"state": "running", "final": False, "try": 1, "code": "v1", "at": 980.0},
        6: {"state": "running", "final": False, "try": 1, "code": "v1", "at": 900.0},  # lost
        7: {"state": "running", "final": True, "try": 3, "code": "v1", "at": 999.0},
        8: {"state": "queued", "final": False, "try": 0, "code": "v1", "at": 999.0},
        9: {"state": "queued", "final": False, "try": 0, "code": "v1", "at": 100.0},  # lost
    }
    gone, reasons = held_back(s, records, "v1", now)
    assert gone == [0, 1, 5, 7, 8]
    assert reasons == [
        "partition 0: failed 3 time(s) in a row, the limit (3); not retried until a run "
        "succeeds or new code is loaded; last error: ValueError: x",
        "partition 1: a run is already queued or in progress",
        "partition 5: a run is already queued or in progress",
        "partition 7: a run is already queued or in progress",
        "partition 8: a run is already queued or in progress"]


@pytest.mark.integration
async def test_dispatch_runs_announced_partitions_with_backlog_and_shows_their_lag(
        js: JetStreamContext, nats_server: NatsServer, unique_name: str) -> None:
    from types import SimpleNamespace

    from cg_pipelines.airflow.tasks import dispatch, record_key

    await h.create_group(js, unique_name)
    evs = h.events_on({1, 3})
    await h.publish(js, unique_name, evs, len(evs))
    s = spec(stream=unique_name, partitions=h.PARTITIONS,
             nats=ConnectOptions(nats_server.url))
    store, backlog, table = StateStore(), Outlet(), "table"
    # partition 3 was given up on under this code: held back, and said why
    store.set(record_key(3), {"state": "failed", "try": 3, "final": True,
                              "code": s.code_version(), "error": "bad row", "at": 1.0})
    context = {"triggering_asset_events": {"nats": [  # 0 and 2 have no backlog: not run
        SimpleNamespace(extra={"payload": {"partitions": [0, 1, 2, 3]}})]},
        "asset_state_store": {table: store}, "outlet_events": {"backlog": backlog}}
    keys = await asyncio.to_thread(dispatch, s, "backlog", table, context)
    assert keys == backlog.keys == ["g-1"]
    on_1 = sum(1 for k, _ in evs if h.partition_of(k) == 1)
    assert backlog.extra["backlog"]["g-1"]["pending"] == on_1
    assert backlog.extra["backlog"]["g-1"]["oldest_age_s"] >= 0
    assert list(backlog.extra["backlog"]) == ["g-1"]
    assert any("3" in r and "bad row" in r for r in backlog.extra["held_back"])
    assert store.get(record_key(1))["state"] == "queued"

