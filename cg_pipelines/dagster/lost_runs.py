"""The backlog sensors' NATS reading for lost-run detection: a
:data:`~cg_pipelines.dagster.history.Probe` over a :class:`NatsResource` (heartbeats and lease
pins of the suspected runs, :mod:`cg_pipelines.jetstream.liveness`), and the one call both
backlog ticks make (:func:`fail_lost`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dagster import DagsterInstance
from nats.aio.client import Client

from cg_pipelines.core.config import work_queue_stream_name
from cg_pipelines.dagster.history import Probe, Suspect, fail_lost_runs
from cg_pipelines.dagster.resources import NatsResource, PartitionRunsResource
from cg_pipelines.dagster.spec import TICK_ERRORS
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.liveness import any_pinned, read_heartbeats, read_pins

__all__ = ["fail_lost", "lease_of", "nats_probe"]

Lease = tuple[str, str]
"""``(work-queue stream, lease consumer)``."""


def lease_of(stream: str, group: str, partition: int) -> Lease:
    """The lease of an elastic group's partition: ``partition-<p>`` on ``<stream>-<group>``
    (:func:`cg_pipelines.engine.lease.lease_consumer_name`)."""
    return work_queue_stream_name(stream, group), f"partition-{partition}"


def nats_probe(nats_res: NatsResource, leases_of: Callable[[str], Sequence[Lease]]) -> Probe:
    """A probe reading, in one NATS session bounded by ``call_timeout_s``, each suspect's
    heartbeat and whether any lease of its partition key (``leases_of(key)``) is pinned. NATS
    trouble answers nothing (every fact unknown: the runs stay alive)."""

    def probe(suspects: Sequence[Suspect]) -> Mapping[str, tuple[bool | None, bool | None]]:
        leases = {s.run_id: list(leases_of(s.partition_key)) for s in suspects}

        async def read(nc: Client) -> dict[str, tuple[bool | None, bool | None]]:
            api = JetStreamAPI(nc, timeout=nats_res.call_timeout_s / 2)
            try:
                beats = await read_heartbeats(api, leases)
                pins = await read_pins(api, {x for ls in leases.values() for x in ls})
            finally:
                await api.close()
            return {r: (beats.get(r), any_pinned(pins, ls)) for r, ls in leases.items()}

        try:
            return nats_res.run(read)
        except TICK_ERRORS:
            return {}

    return probe


def fail_lost(instance: DagsterInstance, keys: Sequence[str], nats_res: NatsResource,
              runs: PartitionRunsResource, leases_of: Callable[[str], Sequence[Lease]],
              log: Any, now: float) -> None:
    """Mark failed the lost runs of partition ``keys``
    (:func:`~cg_pipelines.dagster.history.fail_lost_runs` with :func:`nats_probe`), one
    warning each naming why."""
    for run_id, reason in fail_lost_runs(instance, keys, nats_probe(nats_res, leases_of),
                                         grace_s=runs.lost_run_grace_s, now=now):
        log.warning(f"run {run_id} is lost: {reason}; marked failed")
