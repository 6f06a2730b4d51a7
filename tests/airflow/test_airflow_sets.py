"""A co-partitioned set as one Airflow Dag (``CoPartitionedDag``): the spec's checks, the Dags
it builds, and its trigger, dispatch and drain tasks called as Airflow calls them (the context
parts they read, ``tests/support/airflow_context``) against a real nats-server; the table is
compared with the join's independent pandas reference (``tests/support/joined``). The same set
on the running Airflow services is in ``tests/airflow/test_airflow_runs.py``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowException
from deltalake import DeltaTable
from nats.js.client import JetStreamContext

from cg_pipelines.airflow import (
    ConsumerGroupDag,
    CoPartitionedDag,
    JoinInput,
    NatsBacklogTrigger,
    build_dags,
)
from cg_pipelines.airflow.tasks import dispatch, drain, summary_line
from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.core.copartition import CoPartitionError
from cg_pipelines.core.errors import ConfigError
from cg_pipelines.core.subjects import partition_for
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.connect import ConnectOptions
from cg_pipelines.local.nats_server import NatsServer
from tests.support import joined, keyed
from tests.support.airflow_context import Outlet, StateStore, run_context

N = 4
TABLE, BACKLOG = "table", "backlog"


def set_spec(stream: str = "S", url: str = "nats://127.0.0.1:4222", **kw: Any
             ) -> CoPartitionedDag:
    args: dict[str, Any] = {"write": joined.WRITE, "nats": ConnectOptions(url), **kw}
    return CoPartitionedDag("ads", joined.inputs(stream), N, joined.processor(),
                            args.pop("table_uri", "/tmp/ads"), **args)


@pytest.mark.parametrize(("make", "field"), [
    (lambda: CoPartitionedDag("ads", joined.inputs("S")[:1], N, joined.processor(), "/t"),
     "inputs"),
    (lambda: CoPartitionedDag("ads", joined.inputs("S"), N, keyed.processor(), "/t"),
     "processor"),
    (lambda: CoPartitionedDag("ads", joined.inputs("S", (joined.IMP, joined.CONV)), N,
                              joined.processor(), "/t"), "inputs"),
    (lambda: CoPartitionedDag("ads", [JoinInput(joined.IMP, "S", "g"),
                                      JoinInput(joined.CLK, "S", "g")], N,
                              joined.processor(), "/t"), "inputs"),
    (lambda: CoPartitionedDag("ads", [JoinInput(joined.IMP, "S.x", "g"),
                                      JoinInput(joined.CLK, "T", "g")], N,
                              joined.processor(), "/t"), "stream"),
])
def test_a_set_spec_refuses(make: Any, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        make()
    assert e.value.field == field


def test_a_set_has_the_dagster_keys_and_code_version() -> None:
    from cg_pipelines.dagster import CoPartitionedAsset

    s = set_spec()
    asset = CoPartitionedAsset("ads", joined.inputs("S"), N, s.processor)
    assert s.partition_keys() == asset.partition_keys() == [f"g-{p}" for p in range(N)]
    assert s.code_version() == asset.current_code_version()
    assert s.title == asset.title == \
        "co-partitioned set ads (S_impressions.g, S_clicks.g)"


def test_a_group_is_driven_by_one_dag_even_inside_a_set() -> None:
    lone = ConsumerGroupDag("clicks", "S_clicks", "g", N, keyed.processor(), "/t")
    with pytest.raises(ConfigError, match="group S_clicks.g is in specs 'ads' and 'clicks'"):
        build_dags([set_spec(), lone])


def test_a_set_dag_file_parses_with_one_trigger_over_every_input(tmp_path: Path) -> None:
    from airflow.dag_processing.dagbag import DagBag

    (tmp_path / "ads.py").write_text(
        "from cg_pipelines.airflow import CoPartitionedDag, build_dags\n"
        "from tests.support import joined\n"
        "globals().update(build_dags([CoPartitionedDag('ads', joined.inputs('S'), 4, "
        "joined.processor(), '/tmp/ads', write=joined.WRITE)]))\n")
    bag = DagBag(str(tmp_path))
    assert bag.import_errors == {}
    assert sorted(bag.dags) == ["ads", "ads__dispatch"]
    assert sorted(bag.dags["ads"].task_ids) == ["drain_p0", "drain_p1", "drain_p2", "drain_p3",
                                                "route"]
    (trigger,) = [w.trigger for a in bag.dags["ads__dispatch"].timetable
                  .asset_condition.objects for w in a.watchers]
    _, kwargs = trigger.serialize()
    assert kwargs["inputs"] == [["impressions", "S_impressions", "g"],
                                ["clicks", "S_clicks", "g"]]
    assert kwargs["partitions"] == N


def _partitions(evs: joined.Events) -> list[int]:
    return sorted({partition_for([str(m["auction"])], N) for msgs in evs.values()
                   for m in msgs})


def _trigger(spec: CoPartitionedDag) -> NatsBacklogTrigger:
    """The trigger exactly as the built Dag stores it (serialized and made again)."""
    dag = build_dags([spec])[f"{spec.name}__dispatch"]
    (trig,) = [w.trigger for a in dag.timetable.asset_condition.objects for w in a.watchers]
    _, kwargs = trig.serialize()
    json.dumps(kwargs)  # what Airflow stores
    return NatsBacklogTrigger(**kwargs)


def _context(key: str, store: StateStore, outlet: Outlet, mode: str = "drain"
             ) -> dict[str, Any]:
    ctx = run_context(key, {TABLE: store}, {TABLE: outlet})
    ctx["dag_run"].conf = {"mode": mode}
    return ctx


@pytest.mark.integration
async def test_a_set_runs_as_one_dag_exactly_once(
        js: JetStreamContext, nats_server: NatsServer, unique_name: str, tmp_path: Path
) -> None:
    evs = joined.events(60)
    api = await joined.setup(js, unique_name, evs, N)
    uri = str(tmp_path / "ads")
    spec = set_spec(unique_name, nats_server.url, table_uri=uri, recheck_s=0.05,
                    repeat_s=600.0)
    gen = _trigger(spec).run().__aiter__()
    first = await asyncio.wait_for(gen.__anext__(), 30)
    assert first.payload["partitions"] == _partitions(evs)
    assert first.payload["inputs"][1] == ["clicks", f"{unique_name}_clicks", "g"]

    store, backlog = StateStore(), Outlet()
    ctx = {"triggering_asset_events": {"nats": [SimpleNamespace(extra={"payload":
                                                                       first.payload})]},
           "asset_state_store": {TABLE: store}, "outlet_events": {BACKLOG: backlog}}
    keys = await asyncio.to_thread(dispatch, spec, BACKLOG, TABLE, ctx)
    assert keys == [f"g-{p}" for p in _partitions(evs)]
    per_key = backlog.extra["backlog"]  # the lag: pending summed over the inputs
    assert sum(v["pending"] for v in per_key.values()) == sum(len(m) for m in evs.values())

    outs = {}
    for key in keys:
        p = int(key.removeprefix("g-"))
        outs[p] = await asyncio.to_thread(drain, spec, p, TABLE,
                                          _context(key, store, Outlet()))
    assert joined.mismatches(DeltaTable(uri).to_pyarrow_table(), evs) is None
    assert await joined.left(api, unique_name) == 0
    assert sum(o["messages"] for o in outs.values()) == sum(len(m) for m in evs.values())
    for p, out in outs.items():
        assert [row["input"] for row in out["lineage"]] == [joined.IMP, joined.CLK]
        assert out["messages"] == sum(row["messages"] for row in out["lineage"])
        assert "first_seq" not in out  # a set's ranges are per input, in the lineage
        assert f"partition {p}: drained (drain), " in summary_line(p, out)
        assert store.get(f"p{p}")["state"] == "succeeded"

    # one new click: only its partition is announced again (the set's run key moved)
    a = "a7"
    evs[joined.CLK].append({"auction": a})
    await js.publish(f"{unique_name}_clicks.{a}", json.dumps({"auction": a}).encode())
    second = await asyncio.wait_for(gen.__anext__(), 30)
    await gen.aclose()
    p = partition_for([a], N)
    assert second.payload["partitions"] == [p]
    out = await asyncio.to_thread(drain, spec, p, TABLE, _context(f"g-{p}", store, Outlet()))
    assert [row["messages"] for row in out["lineage"]] == [0, 1]
    assert joined.mismatches(DeltaTable(uri).to_pyarrow_table(), evs) is None

    # backfill of one partition = a rebuild from both origin streams: the same table
    before = DeltaTable(uri).to_pyarrow_table().sort_by("auction")
    out = await asyncio.to_thread(drain, spec, p, TABLE,
                                  _context(f"g-{p}", store, Outlet(), mode="rebuild"))
    assert out["rebuilt"] is True and out["mode"] == "rebuild"
    assert all(row["origin_last_seq"] > 0 for row in out["lineage"])
    assert joined.mismatches(DeltaTable(uri).to_pyarrow_table(), evs) is None
    after = DeltaTable(uri).to_pyarrow_table().sort_by("auction")
    assert after.select(joined.COLUMNS).equals(before.select(joined.COLUMNS))


@pytest.mark.integration
async def test_a_set_whose_groups_stopped_being_co_partitioned_fails_naming_why(
        js: JetStreamContext, nats_server: NatsServer, unique_name: str, tmp_path: Path
) -> None:
    evs = {n: m[:5] for n, m in joined.events(10).items()}
    await joined.setup(js, unique_name, evs, N)
    # the clicks group is made again with other partitions: no longer co-partitioned
    s = f"{unique_name}_{joined.CLK}"
    await admin.delete_elastic(js, s, "g")
    await admin.create_elastic(js, s, "g", ElasticConfig(
        N * 2, (PartitioningFilter(f"{s}.*", (1,)),), members=("m1",)))
    spec = set_spec(unique_name, nats_server.url, table_uri=str(tmp_path / "ads"))
    with pytest.raises(AirflowException) as e:
        await asyncio.to_thread(drain, spec, 0, TABLE,
                                _context("g-0", StateStore(), Outlet()))
    assert str(e.value).startswith(f"{CoPartitionError.__name__}: ")
    assert not (tmp_path / "ads").exists()  # nothing written
