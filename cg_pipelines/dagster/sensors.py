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
subscription); a tick logs at most ``LOG_LINES`` per-partition lines; the Dagster instance is
asked a constant number of times (run history: :func:`cg_pipelines.dagster.history.partition_runs`;
check states: one read). A tick writes only check results that changed: at most
:data:`~cg_pipelines.dagster.partition_checks.CHECKS_PER_TICK` first results (run-less
events), and at most :data:`~cg_pipelines.dagster.partition_checks.CHECK_RUNS_PER_TICK`
check-only runs requested for partitions whose results changed
(:func:`~cg_pipelines.dagster.partition_checks.plan_partition_checks`); a steady tick writes
nothing. The partitioned checks themselves (evaluation, planning, a check executed by hand):
:mod:`cg_pipelines.dagster.partition_checks`.
``bench/sensor_ticks.py`` measures ticks at 256 and 4096 partitions (SQLite and Postgres).
Signals, their meaning and volume: ``docs/signals.md``.
"""


import time
from dataclasses import dataclass
from typing import Any, TypeVar

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
    REPEAT_REQUEST_S,
    BacklogCursor,
    BacklogRequest,
    CursorError,
    MembershipCursor,
    RetryPolicy,
    TickPlan,
    decode_cursor,
    drop_repeated_requests,
    encode_cursor,
    gained_partitions,
    plan_backlog_runs,
    summary_lines,
)
from cg_pipelines.dagster.backlog_observers import OBSERVERS, BacklogTick, TickView
from cg_pipelines.dagster.history import CODE_TAG, partition_runs
from cg_pipelines.dagster.lost_runs import fail_lost, lease_of
from cg_pipelines.dagster.partition_checks import (
    EXCLUDED_RUNS,
    LOG_LINES,
    GroupReading,
    read_group,
)
from cg_pipelines.dagster.resources import NatsResource, PartitionRunsResource
from cg_pipelines.dagster.spec import (
    TICK_ERRORS,
    ConsumerGroupAsset,
    asset_key_of,
    load_group_config,
)
from cg_pipelines.dagster.warehouse import Warehouse

__all__ = ["BacklogTick", "backlog_tick", "build_drain_schedule", "build_sensors"]

CursorT = TypeVar("CursorT", MembershipCursor, BacklogCursor)

Job = Any
"""What ``define_asset_job`` returns (its class is not part of Dagster's public API) or a
``JobDefinition``."""


def _request(spec: ConsumerGroupAsset, p: int, run_key: str) -> RunRequest:
    return RunRequest(run_key=run_key, partition_key=spec.partition_key(p),
                      tags={CODE_TAG: spec.current_code_version()})


def _read_cursor(text: str | None, kind: type[CursorT], log: Any) -> tuple[CursorT, str]:
    """The sensor's cursor, or, when it is corrupt (:class:`CursorError`), an empty one and a
    warning (logged, and returned for the tick's reason; ``""`` when the cursor was fine)."""
    try:
        return decode_cursor(text, kind), ""
    except CursorError as e:
        warning = f"{e}; starting over from an empty cursor"
        log.warning(warning)
        return kind(), warning


@dataclass
class _RunPlan:
    """The runs part of a tick: the plan, the requests to send (repeats dropped), the reason
    lines, the requests' tags and the cursor's ``errors`` and ``requested``."""

    plan: TickPlan
    policy: RetryPolicy
    send: list[BacklogRequest]
    reasons: list[str]
    tags: dict[str, str]
    errors: dict[str, str]
    requested: dict[int, tuple[str, float]]


def _plan_runs(spec: ConsumerGroupAsset, nats_res: NatsResource, runs: PartitionRunsResource,
               reading: GroupReading, state: BacklogCursor, instance: DagsterInstance | None,
               log: Any, now: float, *, observe: bool) -> _RunPlan:
    """Mark failed the lost runs (:func:`~cg_pipelines.dagster.lost_runs.fail_lost`), read
    the run history (a constant number of queries), plan the runs with retries and drop
    repeated requests (with ``observe``); logs at most ``LOG_LINES`` lines."""
    policy = runs.retry_policy()
    code = spec.current_code_version()
    keys = {b.partition: spec.partition_key(b.partition) for b in reading.backlog
            if b.pending > 0}
    history = {}
    errors = dict(state.errors)
    if instance is not None:
        fail_lost(instance, list(keys.values()), nats_res, runs,
                  lambda key: [lease_of(spec.stream, spec.group, spec.partition_of(key))],
                  log, now)
        history = partition_runs(instance, keys, code, policy,
                                 exclude_tag=EXCLUDED_RUNS, errors=errors)
    plan = plan_backlog_runs(spec.group, reading.backlog, history, policy, now,
                             code=code, min_pending=runs.min_pending, max_age_s=runs.max_age_s,
                             partitions=reading.served)
    reasons = plan.reason_lines(policy)
    send, requested = plan.requests, dict(state.requested)
    if observe:
        send, dropped, requested = drop_repeated_requests(plan.requests, state.requested,
                                                          keys, now)
        if dropped:
            reasons.append(f"{dropped} partition(s) already requested under the same run key "
                           f"less than {REPEAT_REQUEST_S:g} s ago")
    for line in summary_lines([f"partition {r.partition}: {r.reason}" for r in send]
                              + reasons, LOG_LINES):
        log.info(line)
    tags = {CODE_TAG: code, "dagster/max_runtime": str(int(runs.run_timeout_s + 120))}
    return _RunPlan(plan, policy, send, reasons, tags, errors, requested)


def backlog_tick(spec: ConsumerGroupAsset, nats_res: NatsResource,
                 runs: PartitionRunsResource, log: Any, *,
                 instance: DagsterInstance | None = None,
                 warehouse: Warehouse | None = None,
                 cursor: str | None = None, observe: bool = False,
                 now: float | None = None, job_name: str | None = None,
                 check_job: str | None = None) -> BacklogTick:
    """One backlog tick: read the group
    (:func:`~cg_pipelines.dagster.partition_checks.read_group`), mark failed the lost runs
    (:func:`~cg_pipelines.core.liveness.judge_run`), plan the runs with retries
    (:func:`~cg_pipelines.core.triggers.plan_backlog_runs`, run history from ``instance``:
    a constant number of queries, :func:`~cg_pipelines.dagster.history.partition_runs`).

    With ``observe``, the observers of :data:`~cg_pipelines.dagster.backlog_observers.
    OBSERVERS`, in order: lag observations when a partition's lag state changes, else every
    ``spec.lag_refresh_s`` seconds while it has a backlog, at most
    ``spec.lag_observations_per_day`` a day per partition
    (:func:`~cg_pipelines.core.lag.lag_observations_due`), dead-letter observations of
    the partitions whose count changed, and the partitioned ``lag_within_objective`` and
    ``partition_runs_succeeding`` checks of the served partitions, only where they changed
    (:func:`~cg_pipelines.dagster.partition_checks.plan_partition_checks`: first results
    recorded run-less in ``instance``, later ones by check-only runs of ``check_job`` in
    ``check_requests``, none without ``check_job``; all evaluations are returned in
    ``check_evaluations`` instead without an instance; a check executed by hand is
    :func:`~cg_pipelines.dagster.partition_checks.evaluate_check`, not a tick). Repeated run
    requests are dropped (:func:`~cg_pipelines.core.triggers.drop_repeated_requests`).
    ``now``: Unix seconds (default the clock). ``job_name``: the partition runs' job, set on
    their requests (needed when the sensor targets several jobs). Never raises for NATS or
    config trouble: the skip reason says it.
    """
    now = time.time() if now is None else now
    state, warning = _read_cursor(cursor, BacklogCursor, log) if observe else (
        BacklogCursor(), "")
    if warning:
        cursor = encode_cursor(state)
    try:
        reading = read_group(spec, nats_res, runs,
                             dead_letters_seen=state.dead_letters if observe else None)
    except TICK_ERRORS as e:
        return BacklogTick(skip_reason=_with_warning(
            f"consumer group {spec.stream}.{spec.group}: {e}", warning), cursor=cursor)
    rp = _plan_runs(spec, nats_res, runs, reading, state, instance, log, now, observe=observe)
    out = BacklogTick(run_requests=[
        RunRequest(run_key=r.run_key, partition_key=spec.partition_key(r.partition),
                   tags=rp.tags, job_name=job_name) for r in rp.send], cursor=cursor)
    if not out.run_requests:
        out.skip_reason = _with_warning(
            "; ".join(summary_lines(rp.reasons, 5)) or "no partition with backlog", warning)
    if not observe:
        return out
    view = TickView(spec, nats_res, warehouse, instance, log, now, reading,
                    rp.plan.exhausted, rp.policy, check_job, state)
    # errors: pruned by partition_runs to the partitions' newest failures
    nxt = BacklogCursor(dict(state.observed), state.reconciled_at, dict(state.dead_letters),
                        rp.errors, rp.requested)
    for observer in OBSERVERS:
        nxt = observer(view, nxt, out)
    out.cursor = encode_cursor(nxt)
    return out


def _with_warning(reason: str, warning: str) -> str:
    return f"{warning}. {reason}" if warning else reason


def _instance_of(context: SensorEvaluationContext | ScheduleEvaluationContext
                 ) -> DagsterInstance | None:
    """The context's instance (always there under the daemon), or None in a test context
    built without one: then no run history is read (no retries, no lost-run detection)."""
    try:
        return context.instance
    except DagsterInvariantViolationError:
        return None


def build_sensors(spec: ConsumerGroupAsset, job: Job, check_job: Job | None = None
                  ) -> list[SensorDefinition]:
    """The membership and backlog sensors of ``spec`` (both stopped by default). The backlog
    sensor also targets ``check_job`` (the ``<asset>_checks`` job: the partitioned checks
    only) when given, and then requests its check-only runs (:func:`backlog_tick`)."""
    keys = {spec.nats_resource_key, spec.runs_resource_key}
    backlog_keys = {*keys, spec.warehouse_resource_key}

    @sensor(name=f"{spec.name}_membership", job=job,
            minimum_interval_seconds=spec.sensor_interval_s,
            default_status=DefaultSensorStatus.STOPPED, required_resource_keys=keys,
            description="On a membership change (KV revision), runs the partitions this "
            "deployment's members gained.")
    def membership_sensor(context: SensorEvaluationContext) -> SensorResult | SkipReason:
        nats_res: NatsResource = getattr(context.resources, spec.nats_resource_key)
        runs: PartitionRunsResource = getattr(context.resources, spec.runs_resource_key)
        last, warning = _read_cursor(context.cursor, MembershipCursor, context.log)
        try:
            v = load_group_config(nats_res, spec)
        except TICK_ERRORS as e:
            return SensorResult(skip_reason=_with_warning(
                f"consumer group {spec.stream}.{spec.group}: {e}", warning),
                cursor=encode_cursor(last) if warning else context.cursor)
        if v.revision == last.revision:
            return SkipReason(f"no membership change (revision {last.revision})")
        new = assignment(v.config)
        gained = gained_partitions(last.assignment, new, runs.served())
        events = []
        for line in summary_lines([f"partition {p}: {was or 'unowned'} -> {now} (revision "
                                   f"{v.revision})" for p, (was, now) in gained.items()],
                                  LOG_LINES):
            context.log.info(line)
        for p, (was, now) in gained.items():
            events.append(AssetObservation(
                asset_key=asset_key_of(spec), partition=spec.partition_key(p),
                metadata={"moved_from": was or "", "moved_to": now,
                          "config_revision": v.revision}))
        return SensorResult(
            run_requests=[_request(spec, p, f"{spec.group}:member:{v.revision}:{p}")
                          for p in sorted(gained)],
            asset_events=events,
            cursor=encode_cursor(MembershipCursor(v.revision, {m: list(ps) for m, ps in
                                                               new.items()})),
            skip_reason=None if gained else _with_warning(
                f"membership changed (revision {v.revision}); no partition gained by the "
                f"members served here", warning),
        )

    backlog_jobs = [job] if check_job is None else [job, check_job]

    @sensor(name=f"{spec.name}_backlog", jobs=backlog_jobs,
            minimum_interval_seconds=spec.sensor_interval_s,
            default_status=DefaultSensorStatus.STOPPED, required_resource_keys=backlog_keys,
            description="Runs each served partition whose backlog is above the threshold or "
            "older than the max age; one run per backlog (run key = first pending sequence), "
            "failed partitions again after a backoff (new run key per retry) up to a limit. "
            "Records each partition's lag (state, pending, oldest pending age and timestamp, "
            "last committed sequence) as an asset observation when its state changes (caught "
            "up, behind, late, stopped) and every lag_refresh_s while it has a backlog; "
            "dead-letter counts when they change; and the partitioned lag_within_objective "
            "and partition_runs_succeeding checks of each partition whose outcome changed "
            "(a partition's first results run-less, later ones by a run of its checks job).")
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


def build_drain_schedule(spec: ConsumerGroupAsset, job: Job) -> ScheduleDefinition | None:
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
