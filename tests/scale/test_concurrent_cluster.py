"""Four partitions run concurrently, each in its own process, through Dagster's queued run
coordinator and daemon, all on one standalone Spark master with two workers (started from the
pyspark package): the legs equal the reference (no loss, no duplicate, per-key order), the runs
overlapped, and the master ran one application per run."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pandas as pd
import pytest
from nats.js.api import StreamConfig

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter
from cg_pipelines.core.subjects import partition_for
from cg_pipelines.jetstream import admin
from cg_pipelines.local.nats_server import NatsServer
from cg_pipelines.local.spark_cluster import SparkStandaloneCluster
from cg_pipelines.sinks.delta import DeltaSink
from flights.data import PARTITION_FILTER, STREAM, load_flights, publish_flights
from flights.reference import compare_legs, reference_legs
from mainjob.queued import run_queued, write_instance_config
from tests.support.wait import wait_for

ROOT = Path(__file__).resolve().parents[2]
RUN = [f"legs-{p}" for p in range(4)]


@pytest.fixture(scope="module")
def flights() -> pd.DataFrame:
    return load_flights().head(6000)


async def _setup(url: str, df: pd.DataFrame) -> None:
    import nats

    nc = await nats.connect(url)
    try:
        js = nc.jetstream(timeout=30)
        await js.add_stream(StreamConfig(name=STREAM, subjects=[f"{STREAM}.>"]))
        await admin.create_elastic(js, STREAM, "legs", ElasticConfig(
            8, (PartitioningFilter(PARTITION_FILTER, (2,)),), members=("m1", "m2")))
        await publish_flights(nc, df)
        async def sourced() -> bool:
            return (await js.stream_info("flights-legs")).state.last_seq >= len(df)
        await wait_for(sourced, 120, f"flights-legs to receive {len(df)} messages",
                       interval=0.1)
    finally:
        await nc.close()


def _overlap(runs: list) -> int:
    """The most runs in progress at one time."""
    events = sorted([(r.start, 1) for r in runs] + [(r.end, -1) for r in runs])
    now = most = 0
    for _, d in events:
        now += d
        most = max(most, now)
    return most


def test_four_partitions_concurrently_on_a_standalone_cluster(
        tmp_path: Path, flights: pd.DataFrame) -> None:
    with NatsServer(tmp_path / "nats", port=0) as server, \
            SparkStandaloneCluster(workers=2, cores=1, memory="1g",
                                   log_dir=tmp_path / "spark") as cluster:
        asyncio.run(_setup(server.url, flights))
        home = tmp_path / "home"
        write_instance_config(home, concurrency=4)
        env = {k: v for k, v in os.environ.items()
               if not (k.startswith("CG_") or k.startswith("NATS_"))}
        env.update({"NATS_URL": server.url, "CG_WAREHOUSE": str(tmp_path / "wh"),
                    "CG_SPARK_MASTER": cluster.master_url,
                    "CG_SPARK_CONF": "spark.cores.max=1,spark.executor.memory=512m",
                    "CG_BATCH_MAX_MSGS": "400", "CG_ADAPTIVE_MAX_MSGS": "0"})
        res = run_queued(ROOT, home, env, RUN, timeout_s=600)
        apps = cluster.applications()
    assert sorted(r.partition for r in res.runs) == RUN
    assert all(r.status == "SUCCESS" for r in res.runs), res.runs
    assert _overlap(res.runs) >= 2, res.runs  # the runs really ran side by side
    assert len(apps) == 4 and {a["state"] for a in apps} == {"FINISHED"}, apps
    # the legs of the four partitions' aircraft equal the reference
    ref = reference_legs(flights)
    tails = ref["tailnum"].astype(str)
    mine = ref[[partition_for([t], 8) < 4 for t in tails]]
    table = DeltaSink(str(tmp_path / "wh" / "aircraft_legs")).read()
    assert set(table["_partition"].to_pylist()) == {0, 1, 2, 3}
    rows, mismatches, desc = compare_legs(table, mine)
    assert mismatches == 0 and rows == len(mine), desc
    assert res.messages == len(mine)
