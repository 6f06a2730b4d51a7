"""No-op Dagster code locations for ``bench/scale.py``'s same-run baseline (issue 42).

``noop_job``: one op that does nothing, partitioned by the ``aircraft_legs`` partition keys
(``legs-0`` .. ``legs-7``, so the instance's ``dagster/partition`` limit treats its runs as it
treats the main job's). This module imports only Dagster: its ``bare_defs`` is Dagster's own
floor for a launched run. :mod:`bench.noop_location` adds the job to the example's code
location.
"""

from __future__ import annotations

from dagster import Definitions, StaticPartitionsDefinition, job, op

NOOP_PARTITIONS = StaticPartitionsDefinition([f"legs-{p}" for p in range(8)])
"""The partition keys of ``aircraft_legs`` (group-qualified, ``legs-<p>``)."""


@op
def noop() -> None:
    """Does nothing."""


@job(partitions_def=NOOP_PARTITIONS)
def noop_job() -> None:
    """A run that starts, runs one empty step and ends."""
    noop()


bare_defs = Definitions(jobs=[noop_job])
