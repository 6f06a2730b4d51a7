"""Test Dagster definitions: the keyed-events pipeline as a partitioned group asset.

``make_defs`` builds the asset, job, sensors and schedule of one elastic group ``g`` (4
partitions) on a per-test stream, processed by the Arrow processor of
:mod:`tests.support.keyed` (no JVM), with real resources: NATS at ``url``, Delta tables under
``warehouse_root``, fast engine timings.
"""

from __future__ import annotations

from collections.abc import Sequence

from dagster import Definitions

from cg_pipelines.dagster import (
    ConsumerGroupAsset,
    DeltaTableIOManager,
    DeltaWarehouseResource,
    GroupDefinitions,
    NatsResource,
    PartitionRunsResource,
    build_definitions,
    build_group_definitions,
)
from tests.support import keyed

ASSET = "keyed_events"
GROUP = "g"
PARTITIONS = 4
JOB = f"{ASSET}_job"
MEMBERSHIP_SENSOR = f"{ASSET}_membership"
BACKLOG_SENSOR = f"{ASSET}_backlog"
DRAIN_SCHEDULE = f"{ASSET}_drain"


def spec(stream: str) -> ConsumerGroupAsset:
    return ConsumerGroupAsset(name=ASSET, stream=stream, group=GROUP, partitions=PARTITIONS,
                              processor=keyed.processor())


def pkey(p: int) -> str:
    """Dagster partition key of group partition ``p`` (``g-<p>``)."""
    return f"{GROUP}-{p}"


def group_definitions(stream: str) -> GroupDefinitions:
    return build_group_definitions(spec(stream))


def partition_runs(members: Sequence[str] | None = None, *, min_pending: int = 1,
                   max_age_s: float | None = None) -> PartitionRunsResource:
    """Fast engine timings (lease ack wait, pin timeout, hold wait) and retry backoff
    (1 s, doubling up to 4 s) for tests."""
    return PartitionRunsResource(members=list(members or []), ack_wait_s=1.5,
                                 priority_timeout_s=1.5, hold_wait_s=3,
                                 min_pending=min_pending, max_age_s=max_age_s,
                                 retry_backoff_s=1.0, retry_max_backoff_s=4.0)


def make_resources(url: str, warehouse_root: str, members: Sequence[str] | None = None, *,
                   min_pending: int = 1, max_age_s: float | None = None) -> dict[str, object]:
    """No Spark resource: the keyed processor runs on Arrow."""
    warehouse = DeltaWarehouseResource(root=warehouse_root)
    return {
        "nats": NatsResource(servers=url),
        "warehouse": warehouse,
        "partition_runs": partition_runs(members, min_pending=min_pending, max_age_s=max_age_s),
        "cg_io_manager": DeltaTableIOManager(warehouse=warehouse),
    }


def make_defs(stream: str, url: str, warehouse_root: str,
              members: Sequence[str] | None = None) -> Definitions:
    """Definitions of the keyed-events group ``g`` on ``stream`` (``members``: the members this
    deployment serves; ``None``/empty = every member)."""
    return build_definitions([spec(stream)], resources=make_resources(url, warehouse_root,
                                                                       members))
