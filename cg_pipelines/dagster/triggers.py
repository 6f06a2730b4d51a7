"""What launches an asset's runs, one input or a set alike: the membership and backlog sensors
and the drain schedule (all stopped by default).

- ``<name>_membership`` (cursor: the inputs' newest KV revision and the assignment; a set's
  groups share their member mappings): on a change, one run per partition a member served
  by this deployment gained, and an observation of each move.
- ``<name>_backlog``: :func:`~cg_pipelines.dagster.tick.backlog_tick` with its observers.
- ``<name>_drain``: the backlog rule on a cron (no observers).
"""

from __future__ import annotations

from typing import Any

from dagster import (
    AssetObservation,
    DagsterInstance,
    DagsterInvariantViolationError,
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
    MembershipCursor,
    encode_cursor,
    gained_partitions,
    summary_lines,
)
from cg_pipelines.dagster.checks import LOG_LINES
from cg_pipelines.dagster.history import CODE_TAG
from cg_pipelines.dagster.resources import NatsResource, PartitionRunsResource
from cg_pipelines.dagster.spec import TICK_ERRORS, StreamAsset, asset_key_of, load_configs
from cg_pipelines.dagster.tick import backlog_tick, read_cursor, with_warning

__all__ = ["Job", "build_drain_schedule", "build_sensors"]

Job = Any
"""What ``define_asset_job`` returns (its class is not part of Dagster's public API) or a
``JobDefinition``."""


def _instance_of(context: SensorEvaluationContext | ScheduleEvaluationContext
                 ) -> DagsterInstance | None:
    """The context's instance (always there under the daemon), or None in a test context
    built without one: then no run history is read (no retries, no lost-run detection)."""
    try:
        return context.instance
    except DagsterInvariantViolationError:
        return None


def _membership(spec: StreamAsset, context: SensorEvaluationContext
                ) -> SensorResult | SkipReason:
    nats_res: NatsResource = getattr(context.resources, spec.nats_resource_key)
    runs: PartitionRunsResource = getattr(context.resources, spec.runs_resource_key)
    last, warning = read_cursor(context.cursor, MembershipCursor, context.log)
    try:
        configs = load_configs(nats_res, spec)
    except TICK_ERRORS as e:
        return SensorResult(skip_reason=with_warning(f"{spec.title}: {e}", warning),
                            cursor=encode_cursor(last) if warning else context.cursor)
    revision = max(c.revision for c in configs)
    if revision == last.revision:
        return SkipReason(f"no membership change (revision {last.revision})")
    new = assignment(configs[0].config)
    gained = gained_partitions(last.assignment, new, runs.served())
    for line in summary_lines([f"partition {p}: {was or 'unowned'} -> {now} (revision "
                               f"{revision})" for p, (was, now) in gained.items()], LOG_LINES):
        context.log.info(line)
    code = spec.current_code_version()
    return SensorResult(
        run_requests=[RunRequest(run_key=f"{spec.label}:member:{revision}:{p}",
                                 partition_key=spec.partition_key(p), tags={CODE_TAG: code})
                      for p in sorted(gained)],
        asset_events=[AssetObservation(asset_key=asset_key_of(spec),
                                       partition=spec.partition_key(p),
                                       metadata={"moved_from": was or "", "moved_to": now,
                                                 "config_revision": revision})
                      for p, (was, now) in gained.items()],
        cursor=encode_cursor(MembershipCursor(revision, {m: list(ps) for m, ps in new.items()})),
        skip_reason=None if gained else with_warning(
            f"membership changed (revision {revision}); no partition gained by the members "
            "served here", warning))


def build_sensors(spec: StreamAsset, job: Job, check_job: Job | None = None
                  ) -> list[SensorDefinition]:
    """The membership and backlog sensors of ``spec`` (both stopped by default). The backlog
    sensor also targets ``check_job`` (the ``<name>_checks`` job) when given, and then
    requests its check-only runs."""
    keys = {spec.nats_resource_key, spec.runs_resource_key}

    @sensor(name=f"{spec.name}_membership", job=job,
            minimum_interval_seconds=spec.sensor_interval_s,
            default_status=DefaultSensorStatus.STOPPED, required_resource_keys=keys,
            description="On a membership change (KV revision), runs the partitions this "
            "deployment's members gained.")
    def membership_sensor(context: SensorEvaluationContext) -> SensorResult | SkipReason:
        return _membership(spec, context)

    @sensor(name=f"{spec.name}_backlog", jobs=[job] if check_job is None else [job, check_job],
            minimum_interval_seconds=spec.sensor_interval_s,
            default_status=DefaultSensorStatus.STOPPED,
            required_resource_keys={*keys, spec.warehouse_resource_key},
            description="Runs each served partition where any input's backlog is above the "
            "threshold or older than the max age; one run per backlog (run key = first pending "
            "sequence), failed partitions again after a backoff up to a limit. Records each "
            "partition's lag (per input) when its state changes and every lag_refresh_s while "
            "it has a backlog, dead-letter counts when they change, and the partitioned "
            "lag_within_objective and partition_runs_succeeding checks where they changed.")
    def backlog_sensor(context: SensorEvaluationContext) -> SensorResult:
        got = backlog_tick(spec, getattr(context.resources, spec.nats_resource_key),
                           getattr(context.resources, spec.runs_resource_key), context.log,
                           instance=_instance_of(context),
                           warehouse=getattr(context.resources, spec.warehouse_resource_key),
                           cursor=context.cursor, observe=True, job_name=job.name,
                           check_job=None if check_job is None else check_job.name)
        requests = [*got.run_requests, *got.check_requests]
        if requests and got.skip_reason:
            context.log.info(f"no partition run requested: {got.skip_reason}")
        return SensorResult(run_requests=requests,
                            skip_reason=None if requests else got.skip_reason,
                            asset_events=got.asset_events, cursor=got.cursor)

    return [membership_sensor, backlog_sensor]


def build_drain_schedule(spec: StreamAsset, job: Job) -> ScheduleDefinition | None:
    """The drain-all schedule of ``spec`` (stopped by default), or ``None`` without a cron."""
    if spec.schedule_cron is None:
        return None

    @schedule(name=f"{spec.name}_drain", cron_schedule=spec.schedule_cron, job=job,
              default_status=DefaultScheduleStatus.STOPPED,
              required_resource_keys={spec.nats_resource_key, spec.runs_resource_key},
              description="Drains every served partition that has a backlog.")
    def drain_schedule(context: ScheduleEvaluationContext) -> list[RunRequest] | SkipReason:
        got = backlog_tick(spec, getattr(context.resources, spec.nats_resource_key),
                           getattr(context.resources, spec.runs_resource_key), context.log,
                           instance=_instance_of(context))
        return got.run_requests or SkipReason(got.skip_reason)

    return drain_schedule
