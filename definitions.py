"""The example's Dagster code location (``workspace.yaml`` loads ``defs`` from here): the
aircraft-legs consumer group, built with the library's public ``cg_pipelines.dagster``.

Never connects to NATS at import time; settings come from the environment
(:mod:`resources`)."""

from __future__ import annotations

from assets.legs import AIRCRAFT_LEGS
from cg_pipelines.dagster import build_definitions
from resources import build_resources

defs = build_definitions([AIRCRAFT_LEGS], resources=build_resources())
