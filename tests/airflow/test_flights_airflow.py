"""``python -m mainjob --orchestrator airflow`` (the flights example on Airflow 3), without
Airflow's processes: the Dag file the job writes parses in Airflow's DagBag into the dispatch
and worker Dags of group ``legs`` (8 partitions, the table and NATS it was given, the trigger
re-reading every 2 s) and runs the Dagster asset's processor; the options Airflow does not
take are refused. The whole run (336,776 flights, a real Airflow) takes minutes: its figures
are in the commit that added it, not in the suite."""

from __future__ import annotations

import runpy
from pathlib import Path

from click.testing import CliRunner


def test_the_dag_file_builds_the_legs_dags_with_the_dagster_asset_s_processor(
        tmp_path: Path) -> None:
    from airflow.dag_processing.dagbag import DagBag

    from assets.legs import AIRCRAFT_LEGS
    from cg_pipelines.core.fingerprint import code_version
    from mainjob.airflow import dag_file, spark_config, write_dag_file

    table = tmp_path / "warehouse" / "aircraft_legs"
    path = write_dag_file(tmp_path / "dags", dag_file(
        "nats://127.0.0.1:4999", table, conf=spark_config() | {"spark.x": "1"}))
    bag = DagBag(str(path.parent))
    assert bag.import_errors == {}
    assert sorted(bag.dags) == ["aircraft_legs", "aircraft_legs__dispatch"]
    worker = bag.dags["aircraft_legs"]
    assert sorted(worker.task_ids) == sorted(["route", *(f"drain_p{p}" for p in range(8))])
    assert {o.name for p in range(8) for o in worker.get_task(f"drain_p{p}").outlets} == \
        {"aircraft_legs"}
    (trigger,) = [w.trigger for a in bag.dags["aircraft_legs__dispatch"].timetable
                  .asset_condition.objects for w in a.watchers]
    _, kwargs = trigger.serialize()
    assert kwargs["connect"]["servers"] == "nats://127.0.0.1:4999"
    assert kwargs["recheck_s"] == 2.0

    spec = runpy.run_path(str(path))["SPEC"]
    assert (spec.stream, spec.group, spec.table_uri) == ("flights", "legs", str(table))
    assert spec.partition_keys() == [AIRCRAFT_LEGS.partition_key(p) for p in range(8)]
    assert (spec.spark_master, spec.spark_remote, spec.spark_config["spark.x"]) == \
        ("local[2]", None, "1")
    assert spec.engine.batch_max_msgs == 50_000
    assert code_version(spec.processor) == code_version(AIRCRAFT_LEGS.processor)


def test_options_airflow_does_not_take_are_refused() -> None:
    from mainjob.__main__ import main

    for args in (["--rebuild", "1"], ["--spark-cluster"], ["--table-format", "iceberg"]):
        got = CliRunner().invoke(main, ["--orchestrator", "airflow", *args])
        assert got.exit_code == 2 and "not with --orchestrator airflow" in got.output, got.output
