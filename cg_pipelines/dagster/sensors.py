"""A consumer group's triggers: the membership and backlog sensors and the drain schedule.

- **membership** (cursor = the group's KV revision and assignment): on a change, one run per
  partition that a member served by this deployment gained, and an observation of each move.
- **backlog**: one run per served partition whose backlog is at least ``min_pending`` or older
  than ``max_age_s``; run key ``<group>:<p>:<first pending sequence>``, so a retried tick for
  the same backlog is one run.
- **drain schedule**: the backlog rule on a cron, for deployments that prefer fixed times.

Every NATS call of a tick is bounded by the NATS resource's ``call_timeout_s``; a tick that
cannot read the group returns a skip reason naming why (never a crash loop). The decisions are
pure functions of :mod:`cg_pipelines.core.triggers`.

At scale: a backlog tick is one NATS session (the config, then the backlog of the served
partitions only, read as :mod:`cg_pipelines.jetstream.backlog` describes: a constant number of
stream requests plus one direct get per partition that may hold messages, on one reply
subscription); a tick logs at most ``_LOG_LINES`` per-partition lines.
``bench/sensor_ticks.py`` measures ticks at 16 to 4096 partitions.
"""


from typing import Any

from dagster import (
    AssetKey,
    AssetObservation,
    DefaultScheduleStatus,
    DefaultSensorStatus,
    RunRequest,
    ScheduleDefinition,
    ScheduleEvaluationContext,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    schedule,
    sensor,
)

from cg_pipelines.core.assignment import assignment
from cg_pipelines.core.triggers import (
    PartitionBacklog,
    backlog_requests,
    decode_membership_cursor,
    encode_membership_cursor,
    gained_partitions,
    served_partitions,
    summary_lines,
)
from cg_pipelines.dagster.assets import TICK_ERRORS, check_partitions, load_group_config
from cg_pipelines.dagster.resources import NatsResource, PartitionRunsResource
from cg_pipelines.dagster.spec import ConsumerGroupAsset
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.backlog import partition_backlog

__all__ = ["backlog_tick", "build_drain_schedule", "build_sensors"]

Job = Any
"""What ``define_asset_job`` returns (its class is not part of Dagster's public API) or a
``JobDefinition``."""


_LOG_LINES = 20
"""Per-partition log lines a tick writes at most (then one "... and <k> more")."""


def _asset_key(spec: ConsumerGroupAsset) -> AssetKey:
    prefix = [spec.key_prefix] if isinstance(spec.key_prefix, str) else list(spec.key_prefix or [])
    return AssetKey([*prefix, spec.name])


def _request(spec: ConsumerGroupAsset, p: int, run_key: str) -> RunRequest:
    return RunRequest(run_key=run_key, partition_key=spec.partition_key(p))


def backlog_tick(spec: ConsumerGroupAsset, nats_res: NatsResource,
                 runs: PartitionRunsResource, log: Any) -> list[RunRequest] | SkipReason:
    """One bounded NATS session: the group's config, then the backlog of the partitions this
    deployment serves (and only those); one run request per served partition with backlog, or
    the reason for none."""
    served_members = runs.served()

    async def read(nc: Any) -> tuple[list[int], list[PartitionBacklog]]:
        v = await admin.get_elastic(nc.jetstream(), spec.stream, spec.group,
                                    timeout=nats_res.call_timeout_s)
        check_partitions(v.config, spec)
        served = served_partitions(assignment(v.config), served_members)
        async with JetStreamAPI(nc, timeout=nats_res.call_timeout_s) as api:
            return served, await partition_backlog(api, spec.stream, spec.group, served)

    try:
        served, backlog = nats_res.run(read)
    except TICK_ERRORS as e:
        return SkipReason(f"consumer group {spec.stream}.{spec.group}: {e}")
    reqs = backlog_requests(spec.group, backlog, min_pending=runs.min_pending,
                            max_age_s=runs.max_age_s, partitions=served)
    for line in summary_lines([f"partition {r.partition}: {r.reason}" for r in reqs],
                              _LOG_LINES):
        log.info(line)
    return [_request(spec, r.partition, r.run_key) for r in reqs] or SkipReason(
        "no partition with backlog")


def build_sensors(spec: ConsumerGroupAsset, job: Job) -> list[SensorDefinition]:
    """The membership and backlog sensors of ``spec`` (both stopped by default)."""
    keys = {spec.nats_resource_key, spec.runs_resource_key}

    @sensor(name=f"{spec.name}_membership", job=job,
            minimum_interval_seconds=spec.sensor_interval_s,
            default_status=DefaultSensorStatus.STOPPED, required_resource_keys=keys,
            description="On a membership change (KV revision), runs the partitions this "
            "deployment's members gained.")
    def membership_sensor(context: SensorEvaluationContext) -> SensorResult | SkipReason:
        nats_res: NatsResource = getattr(context.resources, spec.nats_resource_key)
        runs: PartitionRunsResource = getattr(context.resources, spec.runs_resource_key)
        try:
            v = load_group_config(nats_res, spec)
            rev, old = decode_membership_cursor(context.cursor)
        except TICK_ERRORS as e:
            return SkipReason(f"consumer group {spec.stream}.{spec.group}: {e}")
        if v.revision == rev:
            return SkipReason(f"no membership change (revision {rev})")
        new = assignment(v.config)
        gained = gained_partitions(old, new, runs.served())
        events = []
        for line in summary_lines([f"partition {p}: {was or 'unowned'} -> {now} (revision "
                                   f"{v.revision})" for p, (was, now) in gained.items()],
                                  _LOG_LINES):
            context.log.info(line)
        for p, (was, now) in gained.items():
            events.append(AssetObservation(
                asset_key=_asset_key(spec), partition=spec.partition_key(p),
                metadata={"moved_from": was or "", "moved_to": now,
                          "config_revision": v.revision}))
        return SensorResult(
            run_requests=[_request(spec, p, f"{spec.group}:member:{v.revision}:{p}")
                          for p in sorted(gained)],
            asset_events=events,
            cursor=encode_membership_cursor(v.revision, new),
            skip_reason=None if gained else
            f"membership changed (revision {v.revision}); no partition gained by the members "
            f"served here",
        )

    @sensor(name=f"{spec.name}_backlog", job=job,
            minimum_interval_seconds=spec.sensor_interval_s,
            default_status=DefaultSensorStatus.STOPPED, required_resource_keys=keys,
            description="Runs each served partition whose backlog is above the threshold or "
            "older than the max age; one run per backlog (run key = first pending sequence).")
    def backlog_sensor(context: SensorEvaluationContext) -> SensorResult | SkipReason:
        got = backlog_tick(spec, getattr(context.resources, spec.nats_resource_key),
                           getattr(context.resources, spec.runs_resource_key), context.log)
        return got if isinstance(got, SkipReason) else SensorResult(run_requests=got)

    return [membership_sensor, backlog_sensor]


def build_drain_schedule(spec: ConsumerGroupAsset, job: Job) -> ScheduleDefinition | None:
    """The drain-all schedule of ``spec`` (stopped by default), or ``None`` without a cron."""
    if spec.schedule_cron is None:
        return None

    @schedule(name=f"{spec.name}_drain", cron_schedule=spec.schedule_cron, job=job,
              default_status=DefaultScheduleStatus.STOPPED,
              required_resource_keys={spec.nats_resource_key, spec.runs_resource_key},
              description="Drains every served partition that has a backlog.")
    def drain_schedule(context: ScheduleEvaluationContext) -> list[RunRequest] | SkipReason:
        return backlog_tick(spec, getattr(context.resources, spec.nats_resource_key),
                            getattr(context.resources, spec.runs_resource_key), context.log)

    return drain_schedule
