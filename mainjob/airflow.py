"""The main job driven by Airflow 3 (``python -m mainjob --orchestrator airflow``): the same
flights, stream, group, processor, table and verification as the Dagster main job
(:mod:`mainjob.run`), with Airflow starting the runs.

Steps:

1. load the flights, start a nats-server and, in the background, a local Airflow
   (:class:`~mainjob.airflow_services.AirflowServices`: SQLite, LocalExecutor, home
   ``<state>/airflow``, fresh each time) while stream ``flights`` and group ``legs`` are
   created and the flights published (:func:`mainjob.run.publish`);
2. write the Dag file ``<state>/airflow/dags/aircraft_legs.py``: ``ConsumerGroupDag`` over
   group ``legs`` with the Dagster asset's processor (``flights.legs.legs_processor()``: Spark,
   ``local[2]`` in each drain task, or the Spark Connect server with ``--spark-connect``), the
   table ``<state>/mainjob/warehouse/aircraft_legs``, and the backlog trigger re-reading every
   2 s; ``build_dags`` makes the dispatch Dag and the worker Dag;
3. wait until the api-server reports every component healthy, then until the backlog trigger
   has made the dispatch start one worker run per partition, each of them succeeded, none is
   queued or running and the group's backlog is 0; each partition is compared with the pandas
   reference as soon as its run succeeded (:class:`~mainjob.run.OverlappedVerifier`);
4. print ``verified <rows> rows against the reference: <n> mismatches`` and the stage
   breakdown, stop every Airflow process by process group (SIGTERM, then SIGKILL; also on
   failure, Ctrl-C and SIGTERM) and the nats-server.

Returns the mismatches, or -1 when a run failed or the runs did not finish in time (the
Airflow logs' tails are printed).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from mainjob.airflow_services import AirflowServices
from mainjob.run import (
    GROUP,
    OverlappedVerifier,
    Stages,
    fresh_work,
    legs_partitions,
    legs_table,
    load,
    project_root,
    publish,
    start_spark_connect,
    warm_up_in_background,
)

DAG_ID = "aircraft_legs"
"""The worker Dag's id and the table asset's name (the Dagster asset's name)."""

HEALTHY_TIMEOUT_S = 300.0
"""Seconds Airflow may take to report healthy (``db migrate`` included; about 60 on a loaded
2-core host)."""

RUNS_TIMEOUT_S = 900.0
"""Seconds the eight partition runs may take once Airflow is healthy."""

DAG_FILE = '''\
"""The main job's Dag file, written by `python -m mainjob --orchestrator airflow`: the flights'
group `legs` as one Airflow Dag run per partition, the Dagster asset's processor."""

from cg_pipelines.airflow import ConsumerGroupDag, build_dags
from cg_pipelines.engine.options import EngineOptions
from cg_pipelines.jetstream.connect import ConnectOptions
from flights.data import STREAM
from flights.legs import legs_processor

SPEC = ConsumerGroupDag(
    {name!r}, STREAM, {group!r}, {partitions}, legs_processor(), {table!r},
    nats=ConnectOptions({url!r}),
    spark_master={master!r}, spark_remote={remote!r}, spark_config={conf!r},
    engine=EngineOptions(batch_max_msgs={batch}, adaptive_max_msgs=200_000),
    recheck_s={recheck_s!r},
)
globals().update(build_dags([SPEC]))
'''


def dag_file(url: str, table: Path, *, batch: int = 50_000, remote: str | None = None,
             master: str = "local[2]", conf: dict[str, str] | None = None,
             recheck_s: float = 2.0) -> str:
    """The Dag file's text: ``ConsumerGroupDag`` :data:`DAG_ID` over group ``legs`` on the
    nats-server at ``url``, the table at ``table``, batches of ``batch`` messages (the main
    job's 50,000: a partition's backlog in one batch), Spark on ``master`` or the Connect
    server ``remote``, settings ``conf``."""
    return DAG_FILE.format(name=DAG_ID, group=GROUP, partitions=legs_partitions(), table=str(table),
                           url=url, master=master, remote=remote, conf=conf or {},
                           batch=batch, recheck_s=recheck_s)


def write_dag_file(dags: Path, text: str) -> Path:
    """Write ``<dags>/aircraft_legs.py`` atomically (the dag-processor never reads half a
    file)."""
    dags.mkdir(parents=True, exist_ok=True)
    path, tmp = dags / f"{DAG_ID}.py", dags / f".{DAG_ID}.tmp"
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def spark_config(jvm: bool = True) -> dict[str, str]:
    """The Spark settings of the Dagster main job's Spark resource: ``CG_SPARK_CONF`` and,
    for a JVM of the drain task's own (``jvm``), the JVM class archive (when it exists) in
    ``spark.driver.extraJavaOptions``."""
    from cg_pipelines.spark.session import class_archive_options
    from resources import _spark_conf, class_archive

    conf = _spark_conf(os.environ.get("CG_SPARK_CONF", ""))
    archive = class_archive()
    if jvm and os.path.exists(archive):
        key = "spark.driver.extraJavaOptions"
        conf[key] = f"{conf.get(key, '')} {class_archive_options(archive)}".strip()
    return conf


@contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """SIGTERM ends this process through ``SystemExit`` (so ``finally`` blocks stop what it
    started), as Ctrl-C does through ``KeyboardInterrupt``."""
    def leave(signum: int, frame: object) -> None:
        sys.exit(128 + signum)

    before = signal.signal(signal.SIGTERM, leave)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def run_on_airflow(state: Path, limit: int | None = None, batch: int | None = None,
                   parallelism: int = 2, spark_connect: bool = False) -> int:
    """Run the main job on Airflow (see the module docstring); returns the mismatches, or -1
    when a run failed or did not finish. ``parallelism``: Airflow's task slots (each task is a
    process of its own; a drain task without ``spark_connect`` starts a JVM)."""
    from cg_pipelines.local.nats_server import NatsServer

    stages = Stages()
    work = fresh_work(state)
    home = state / "airflow"
    shutil.rmtree(home, ignore_errors=True)
    with _sigterm_as_exit():
        df = load(limit, stages)
        t = time.monotonic()
        with NatsServer(work / "nats", port=0) as server:
            stages.add("nats-server start", time.monotonic() - t)
            click.echo(f"nats-server {server.url} (JetStream store {work / 'nats'})")
            services = AirflowServices(home, home / "dags", project_root(), parallelism)
            t_airflow = time.monotonic()
            services.start()  # migrates and starts while the flights publish
            click.echo(f"airflow starting: {services.base} (home {home}, SQLite, "
                       f"LocalExecutor, parallelism {parallelism})")
            # after the nats-server (see warm_up_in_background), while the flights publish
            connect = _ConnectStarter(state) if spark_connect else None
            try:
                return _drive(services, server.url, work, df, stages, t_airflow, batch,
                              connect)
            except RuntimeError as e:  # start-up failed, a service exited, a timeout
                click.echo(str(e), err=True)
                return -1
            finally:
                t = time.monotonic()
                services.stop()
                stages.add("stop airflow", time.monotonic() - t)
                if connect is not None:
                    connect.stop()
                click.echo(stages.report())
                click.echo(f"Airflow home {home} (its logs: {home}/*.log, {home}/logs)")


class _ConnectStarter:
    """:func:`~mainjob.run.start_spark_connect` in a thread (the server's JVM starts while
    the flights publish)."""

    def __init__(self, state: Path) -> None:
        self.server: Any = None
        self.seconds = 0.0
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._start, args=(state,), daemon=True,
                                       name="spark-connect-start")
        self.thread.start()

    def _start(self, state: Path) -> None:
        t = time.monotonic()
        try:
            self.server = start_spark_connect(state, Stages())
        except Exception as e:  # raised by wait()
            self.error = e
        self.seconds = time.monotonic() - t

    def wait(self, stages: Stages) -> tuple[str, threading.Thread | None]:
        """The server's URL and its warm-up thread (None for a server of
        ``CG_SPARK_REMOTE``)."""
        t = time.monotonic()
        self.thread.join()
        stages.add("spark connect start (waited)", time.monotonic() - t)
        if self.error is not None:
            raise RuntimeError(f"Spark Connect server not started: {self.error}")
        click.echo(f"spark connect server started in {self.seconds:.1f} s (in the background; "
                   f"{time.monotonic() - t:.1f} s waited for it)")
        url = os.environ["CG_SPARK_REMOTE"]
        return url, warm_up_in_background(url) if self.server is not None else None

    def stop(self) -> None:
        self.thread.join()
        if self.server is not None:
            self.server.stop()


def _drive(services: AirflowServices, url: str, work: Path, df: Any, stages: Stages,
           t_airflow: float, batch: int | None, connect: _ConnectStarter | None) -> int:
    publish(url, df, stages)
    remote, warm = connect.wait(stages) if connect is not None else (None, None)
    verifier = OverlappedVerifier(legs_table(work), df)  # the reference builds meanwhile
    write_dag_file(services.dags, dag_file(url, legs_table(work), batch=batch or 50_000,
                                           remote=remote,
                                           conf=spark_config(jvm=remote is None)))
    t = time.monotonic()
    if warm is not None:
        warm.join()
        stages.add("spark warm-up (waited)", time.monotonic() - t)
    t = time.monotonic()
    services.wait_healthy(HEALTHY_TIMEOUT_S)
    stages.add("airflow start-up (waited)", time.monotonic() - t)
    click.echo(f"airflow healthy {time.monotonic() - t_airflow:.1f} s after its start "
               f"(db migrate + 4 services; {time.monotonic() - t:.1f} s waited after "
               "publishing); Dag file written")
    t = time.monotonic()
    failed, msgs = _wait_runs(services, url, verifier, t)
    runs_s = time.monotonic() - t
    stages.add("runs", runs_s)
    click.echo(f"{legs_partitions()} partition runs: {msgs:,} messages in {runs_s:.1f} s from "
               f"Airflow healthy (Dag parse, trigger, dispatch, runs)")
    if failed:
        return -1
    t = time.monotonic()
    mismatches = verifier.finish()
    stages.add("verify (rest)", time.monotonic() - t)
    return mismatches


def _wait_runs(services: AirflowServices, url: str, verifier: OverlappedVerifier,
               t0: float) -> tuple[int, int]:
    """Wait until every partition has a successful worker run, none is queued or running, and
    the backlog is 0; hand each partition to ``verifier`` as its run succeeds. Returns (failed
    runs, messages committed).

    Raises:
        RuntimeError: not done in :data:`RUNS_TIMEOUT_S` seconds, or a service exited (the
            Airflow logs' tails in the message).
    """
    done: dict[int, int] = {}
    deadline = t0 + RUNS_TIMEOUT_S
    while True:
        services.check()
        runs = services.dag_runs(DAG_ID)
        failed = [r for r in runs if r["state"] == "failed"]
        if failed:
            for r in failed:
                click.echo(f"  run {r['dag_run_id']} ({r.get('partition_key')}) failed: "
                           f"{services.task_states(DAG_ID, r['dag_run_id'])}", err=True)
            return len(failed), sum(done.values())
        for r in runs:
            if r["state"] == "success" and r.get("partition_key"):
                p = int(str(r["partition_key"]).rsplit("-", 1)[1])
                if p not in done:
                    done[p] = _report_run(services, r, t0)
                    verifier.partition_done(p)
        busy = [r for r in runs if r["state"] not in ("success", "failed")]
        if len(done) == legs_partitions() and not busy and asyncio.run(_backlog(url)) == 0:
            return 0, sum(done.values())
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"runs not done after {RUNS_TIMEOUT_S:g} s: {len(done)} of {legs_partitions()} "
                f"partitions succeeded, runs {[(r.get('partition_key'), r['state']) for r in runs]}"
                f"\n{services.logs_tail()}")
        time.sleep(1.0)


def _report_run(services: AirflowServices, run: dict[str, Any], t0: float) -> int:
    """Print one successful run's line (its table event's figures); returns its messages."""
    from datetime import datetime

    def at(stamp: str | None) -> float:
        if not stamp:
            return 0.0
        wall = datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
        return wall - (time.time() - (time.monotonic() - t0))  # seconds since t0

    x = _event_extra(services, run["dag_run_id"])
    click.echo(f"  {run['partition_key']}: run {run['dag_run_id']} {x.get('status', '?')}, "
               f"{int(x.get('messages', 0)):,} messages, {x.get('commits', 0)} commit(s), "
               f"{at(run.get('start_date')):5.1f} .. {at(run.get('end_date')):5.1f} s "
               f"(engine {float(x.get('seconds', 0.0)):.2f} s, drain task "
               f"{float(x.get('task_seconds', 0.0)):.2f} s)")
    return int(x.get("messages", 0))


def _event_extra(services: AirflowServices, run_id: str) -> dict[str, Any]:
    """The extra of the table asset's event from run ``run_id`` (empty if none)."""
    found = services.api(f"/assets?name_pattern={DAG_ID}") or {}
    ids = [a["id"] for a in found.get("assets", []) if a["name"] == DAG_ID]
    if not ids:
        return {}
    events = services.api(f"/assets/events?asset_id={ids[0]}&limit=100") or {}
    for e in events.get("asset_events", []):
        if e.get("source_run_id") == run_id:
            return dict(e.get("extra") or {})
    return {}


async def _backlog(url: str) -> int:
    """Messages pending in the group's partitions now."""
    import nats

    from cg_pipelines.jetstream.api import JetStreamAPI
    from cg_pipelines.jetstream.backlog import partition_backlog
    from flights.data import STREAM

    nc = await nats.connect(url)
    try:
        async with JetStreamAPI(nc) as api:
            return sum(b.pending for b in await partition_backlog(api, STREAM, GROUP,
                                                                  range(legs_partitions())))
    finally:
        await nc.close()
