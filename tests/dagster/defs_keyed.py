"""Test Dagster definitions: the keyed-events pipeline as a partitioned group asset.

``make_defs`` builds the asset, job, sensors and schedule of one elastic group ``g`` (4
partitions) on a per-test stream, processed by the Arrow processor of
:mod:`tests.support.keyed` (no JVM), with real resources: NATS at ``url``, Delta tables under
``warehouse_root``, fast engine timings.
"""

from __future__ import annotations

from collections.abc import Sequence

from dagster import Definitions, in_process_executor

from assets.factory import GroupAsset, GroupDefinitions, build_group_definitions
from resources.group import PartitionRunsResource
from resources.nats import NatsResource
from resources.spark import SparkResource
from resources.warehouse import WarehouseResource
from tests.support import keyed

ASSET = "keyed_events"
GROUP = "g"
PARTITIONS = 4
JOB = f"{ASSET}_job"
MEMBERSHIP_SENSOR = f"{ASSET}_membership"
BACKLOG_SENSOR = f"{ASSET}_backlog"
DRAIN_SCHEDULE = f"{ASSET}_drain"


def group_definitions(stream: str) -> GroupDefinitions:
    return build_group_definitions(GroupAsset(
        name=ASSET, stream=stream, group=GROUP, max_members=PARTITIONS,
        processor=lambda spark: keyed.processor()))


def partition_runs(members: Sequence[str] | None = None, *, min_pending: int = 1,
                   max_age_s: float | None = None) -> PartitionRunsResource:
    """Fast engine timings (lease ack wait, pin timeout, hold wait) for tests."""
    return PartitionRunsResource(members=list(members or []), ack_wait_s=1.5,
                                 priority_timeout_s=1.5, hold_wait_s=3,
                                 min_pending=min_pending, max_age_s=max_age_s)


def make_resources(url: str, warehouse_root: str, members: Sequence[str] | None = None, *,
                   min_pending: int = 1, max_age_s: float | None = None) -> dict[str, object]:
    return {
        "nats": NatsResource(servers=url),
        "spark": SparkResource(),
        "warehouse": WarehouseResource(root=warehouse_root),
        "partition_runs": partition_runs(members, min_pending=min_pending, max_age_s=max_age_s),
    }


def make_defs(stream: str, url: str, warehouse_root: str,
              members: Sequence[str] | None = None) -> Definitions:
    """Definitions of the keyed-events group ``g`` on ``stream`` (``members``: the members this
    deployment serves; ``None``/empty = every member)."""
    gd = group_definitions(stream)
    return Definitions(
        assets=[gd.asset],
        jobs=[gd.job],
        sensors=gd.sensors,
        schedules=[gd.schedule],
        resources=make_resources(url, warehouse_root, members),
        # One process per run (not run worker + step subprocess): launched runs start twice as
        # fast; a one-asset job gains nothing from the multiprocess executor.
        executor=in_process_executor,
    )
