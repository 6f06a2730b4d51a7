"""The backlog sensor of a co-partitioned asset (:mod:`cg_pipelines.dagster.joins`): each tick
reads every input's backlog per partition in one bounded NATS session, requests a run of
partition ``p`` when ANY input has a backlog there (the group asset's retry rule, lost-run
detection and repeat suppression over the merged backlog, :mod:`cg_pipelines.core.triggers`),
and observes each input's lag per partition when the set's lag state there changes, else at the
slow cadence ``lag_refresh_s``, under a daily budget per partition (as a group asset's backlog
sensor: :func:`cg_pipelines.core.lag.lag_observations_due`)."""

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dagster import (
    AssetKey,
    AssetObservation,
    DefaultSensorStatus,
    MetadataValue,
    RunRequest,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from cg_pipelines.core.assignment import assignment
from cg_pipelines.core.copartition import SetGroup, check_copartitioned
from cg_pipelines.core.errors import ConfigError
from cg_pipelines.core.lag import LAG_STATES, lag_observations_due, lag_state
from cg_pipelines.core.triggers import (
    PartitionBacklog,
    drop_repeated_requests,
    plan_backlog_runs,
    served_partitions,
)
from cg_pipelines.dagster.history import CODE_TAG, partition_runs
from cg_pipelines.dagster.join_spec import CoPartitionedAsset
from cg_pipelines.dagster.lost_runs import fail_lost, lease_of
from cg_pipelines.dagster.resources import NatsResource, PartitionRunsResource
from cg_pipelines.dagster.spec import TICK_ERRORS
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.backlog import partition_backlog

__all__ = ["JoinTick", "SetReading", "build_join_sensor", "join_backlog_tick", "merge_backlog",
           "read_set_backlog", "set_configs"]


# ------------------------------------------------------------------------------ reading

@dataclass(frozen=True)
class SetReading:
    """One read of the set: the partitions this deployment serves, each input's backlog per
    partition (``{input name: [PartitionBacklog, ...]}``, in served order) and the set's
    backlog merged (:func:`merge_backlog`)."""

    served: list[int]
    by_input: dict[str, list[PartitionBacklog]]
    merged: list[PartitionBacklog]


async def set_configs(nc: Any, spec: CoPartitionedAsset, timeout: float) -> list[SetGroup]:
    """Every input's elastic config (one KV read each), the set checked
    (:func:`~cg_pipelines.core.copartition.check_copartitioned`) against the declared
    partition count.

    Raises:
        GroupNotFoundError, CoPartitionError, ConfigError, JetStreamError, TimeoutError.
    """
    groups = []
    for inp in spec.inputs:
        v = await admin.get_elastic(nc.jetstream(), inp.stream, inp.group, timeout=timeout)
        groups.append(SetGroup(inp.stream, inp.group, v.config))
    n = check_copartitioned(groups)
    if n != spec.partitions:
        raise ConfigError("max_members", f"the set of {spec.name} has {n} partitions in KV "
                          f"but the code declares {spec.partitions}")
    return groups


def read_set_backlog(spec: CoPartitionedAsset, nats_res: NatsResource,
                     runs: PartitionRunsResource) -> SetReading:
    """One bounded NATS session: every input's config (the set checked), then each input's
    backlog at the partitions this deployment serves (the first input's assignment: a set's
    groups share their member mappings, ``cg elastic set-members``).

    Raises:
        GroupNotFoundError, CoPartitionError, ConfigError, JetStreamError, TimeoutError: as
        reading fails (all in :data:`~cg_pipelines.dagster.spec.TICK_ERRORS`).
    """
    async def read(nc: Any) -> SetReading:
        groups = await set_configs(nc, spec, nats_res.call_timeout_s)
        served = served_partitions(assignment(groups[0].config), runs.served())
        by_input: dict[str, list[PartitionBacklog]] = {}
        lasts: dict[str, int] = {}
        async with JetStreamAPI(nc, timeout=nats_res.call_timeout_s) as api:
            for inp in spec.inputs:
                by_input[inp.name] = await partition_backlog(api, inp.stream, inp.group, served)
                info = await api.stream_info(f"{inp.stream}-{inp.group}")
                lasts[inp.name] = int((info.get("state") or {}).get("last_seq") or 0)
        return SetReading(served, by_input, merge_backlog(by_input, lasts))

    return nats_res.run(read)


def merge_backlog(by_input: Mapping[str, Sequence[PartitionBacklog]],
                  last_seqs: Mapping[str, int]) -> list[PartitionBacklog]:
    """The set's backlog per partition: ``pending`` summed over the inputs, ``age_s`` the
    oldest, and ``first_seq`` (None when nothing is pending) the sum over the inputs of each
    input's *next unprocessed sequence* at the partition: its first pending sequence, or its
    work queue's last sequence + 1 when it has none (``last_seqs``). Each term never decreases
    (a work queue only loses messages below the first pending one, and new messages get higher
    sequences), so the sum changes exactly when some input's first pending message changes:
    the sensor's run key (``<name>:<p>:<first_seq>``) is then new, and a partition whose
    backlog did not move keeps its key (the retry rule decides)."""
    names = list(by_input)
    out = []
    for i, first in enumerate(by_input[names[0]]):
        rows = [by_input[n][i] for n in names]
        pending = sum(r.pending for r in rows)
        if pending == 0:
            out.append(PartitionBacklog(first.partition, 0, None, 0.0))
            continue
        token = sum(r.first_seq if r.first_seq is not None else last_seqs.get(n, 0) + 1
                    for n, r in zip(names, rows, strict=True))
        times = [r.first_time_s for r in rows if r.pending and r.first_time_s is not None]
        out.append(PartitionBacklog(first.partition, pending, token,
                                    max(r.age_s for r in rows), min(times, default=None)))
    return out


# ------------------------------------------------------------------------------ the sensor

@dataclass
class JoinTick:
    """One backlog tick's outcome: run requests, lag observations, the next cursor, or why
    nothing was requested."""

    run_requests: list[RunRequest] = field(default_factory=list)
    observations: list[AssetObservation] = field(default_factory=list)
    cursor: str | None = None
    skip_reason: str | None = None


def join_backlog_tick(spec: CoPartitionedAsset, nats_res: NatsResource,
                      runs: PartitionRunsResource, log: Any, *, instance: Any = None,
                      cursor: str | None = None, now: float | None = None) -> JoinTick:
    """One tick of the set's backlog sensor: read every input's backlog
    (:func:`read_set_backlog`), fail lost runs, plan runs for the partitions where any input
    has a backlog (the group asset's retry rule, :func:`~cg_pipelines.core.triggers.
    plan_backlog_runs`, over :func:`merge_backlog`), drop repeated requests, and observe each
    due partition's lag per input (:func:`~cg_pipelines.core.lag.lag_observations_due`:
    on a change of state, else every ``lag_refresh_s``, at most ``lag_observations_per_day``
    a day). ``cursor`` is JSON ``{"observed":
    ..., "requested": ...}``. Never raises for NATS or config trouble: the skip reason says
    it. ``now``: Unix seconds."""
    now = time.time() if now is None else now
    state = _decode(cursor)
    try:
        reading = read_set_backlog(spec, nats_res, runs)
    except TICK_ERRORS as e:
        return JoinTick(skip_reason=f"co-partitioned set {spec.name}: {e}", cursor=cursor)
    policy = runs.retry_policy()
    code = spec.current_code_version()
    keys = {b.partition: spec.partition_key(b.partition) for b in reading.merged
            if b.pending > 0}
    history = {}
    if instance is not None:
        fail_lost(instance, list(keys.values()), nats_res, runs,
                  lambda key: [lease_of(i.stream, i.group, spec.partition_of(key))
                               for i in spec.inputs], log, now)
        history = partition_runs(instance, keys, code, policy)
    plan = plan_backlog_runs(spec.run_key_group, reading.merged, history, policy, now,
                             code=code, min_pending=runs.min_pending, max_age_s=runs.max_age_s,
                             partitions=reading.served)
    requested = {int(k): (v[0], float(v[1])) for k, v in state["requested"].items()}
    send, dropped, requested = drop_repeated_requests(plan.requests, requested, keys, now)
    tags = {CODE_TAG: code, "dagster/max_runtime": str(int(runs.run_timeout_s + 120))}
    out = JoinTick(run_requests=[RunRequest(run_key=r.run_key,
                                            partition_key=spec.partition_key(r.partition),
                                            tags=tags) for r in send])
    reasons = plan.reason_lines(policy)
    if dropped:
        reasons.append(f"{dropped} partition(s) already requested under the same run key")
    if not out.run_requests:
        out.skip_reason = "; ".join(reasons[:5]) or "no partition with backlog"
    due, seen = lag_observations_due(reading.merged, state["observed"], now, spec.lag_refresh_s,
                                     per_day=spec.lag_observations_per_day)
    index = {p: i for i, p in enumerate(reading.served)}
    key = AssetKey([*_prefix(spec.key_prefix), spec.name])
    for b in due:
        md: dict[str, Any] = {"lag_state": LAG_STATES[lag_state(b)], "pending": b.pending,
                              "oldest_pending_age_s": MetadataValue.float(round(b.age_s, 3))}
        if b.pending > 0:
            md["oldest_pending_timestamp"] = MetadataValue.timestamp(
                round(b.oldest_pending_time(now), 3))
        for name, rows in reading.by_input.items():
            r = rows[index[b.partition]]
            md[f"{name}/pending"] = r.pending
            md[f"{name}/oldest_pending_age_s"] = MetadataValue.float(round(r.age_s, 3))
        out.observations.append(AssetObservation(
            asset_key=key, partition=spec.partition_key(b.partition), metadata=md))
    out.cursor = json.dumps({"observed": seen,
                             "requested": {str(p): list(v) for p, v in requested.items()}},
                            separators=(",", ":"))
    return out


def _decode(cursor: str | None) -> dict[str, Any]:
    """The sensor's cursor; a cursor that does not decode starts afresh (nothing is lost: the
    backlog is read again, repeated requests are dropped by their run keys)."""
    try:
        got = json.loads(cursor) if cursor else {}
        return {"observed": dict(got.get("observed") or {}),
                "requested": dict(got.get("requested") or {})}
    except (ValueError, TypeError, AttributeError):
        return {"observed": {}, "requested": {}}


def _prefix(key_prefix: str | Sequence[str] | None) -> list[str]:
    return [key_prefix] if isinstance(key_prefix, str) else list(key_prefix or [])


def build_join_sensor(spec: CoPartitionedAsset, job: Any) -> SensorDefinition:
    """``<name>_backlog``: :func:`join_backlog_tick` every ``sensor_interval_s`` (stopped by
    default, like the group sensors)."""
    keys = {spec.nats_resource_key, spec.runs_resource_key}

    @sensor(name=f"{spec.name}_backlog", job=job, minimum_interval_seconds=spec.sensor_interval_s,
            default_status=DefaultSensorStatus.STOPPED, required_resource_keys=keys,
            description=f"Requests a run of {spec.name} for each partition where any input "
            "has a backlog; observes each input's lag per partition.")
    def _sensor(context: SensorEvaluationContext) -> SensorResult | SkipReason:
        tick = join_backlog_tick(spec, getattr(context.resources, spec.nats_resource_key),
                                 getattr(context.resources, spec.runs_resource_key),
                                 context.log, instance=context.instance, cursor=context.cursor)
        if not tick.run_requests and not tick.observations:
            if tick.cursor is not None:
                context.update_cursor(tick.cursor)
            return SkipReason(tick.skip_reason or "nothing to do")
        return SensorResult(run_requests=tick.run_requests, asset_events=tick.observations,
                            cursor=tick.cursor, skip_reason=tick.skip_reason
                            if not tick.run_requests else None)

    return _sensor
