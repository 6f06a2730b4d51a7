"""The example's code location with a no-op job added, for ``bench/scale.py``'s same-run
baseline (issue 42): ``defs`` = ``definitions.defs`` (the same imports, resources and
``gc.freeze``) plus ``noop_job`` of :mod:`bench.noop_bare_location`. A run of ``noop_job`` here
pays what any run of this deployment pays to start and end (process start, imports, code
location load, Dagster run and step, run end) and nothing else: its op needs no resource, so
Dagster initializes none (no Spark session, no NATS connection)."""

from __future__ import annotations

from dagster import Definitions

from bench.noop_bare_location import noop_job
from definitions import defs as example_defs

defs = Definitions.merge(example_defs, Definitions(jobs=[noop_job]))
