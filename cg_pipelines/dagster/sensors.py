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


import json
import time
from dataclasses import dataclass, field
from typing import Any

from dagster import (
    AssetCheckEvaluation,
    AssetCheckSeverity,
    AssetObservation,
    DagsterInstance,
    DagsterInvariantViolationError,
    DefaultScheduleStatus,
    DefaultSensorStatus,
    MetadataValue,
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
    RetryPolicy,
    RetryWait,
    decode_membership_cursor,
    encode_membership_cursor,
    gained_partitions,
    lag_breaches,
    plan_backlog_runs,
    served_partitions,
    summary_lines,
)
from cg_pipelines.dagster.assets import (
    MODE_TAG,
    TICK_ERRORS,
    asset_key_of,
    check_partitions,
    load_group_config,
)
from cg_pipelines.dagster.history import CODE_TAG, fail_lost_runs, partition_runs
from cg_pipelines.dagster.reconcile import reconcile_evaluation
from cg_pipelines.dagster.resources import (
    DeltaWarehouseResource,
    NatsResource,
    PartitionRunsResource,
)
from cg_pipelines.dagster.spec import ConsumerGroupAsset
from cg_pipelines.engine.runner import app_id_for
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.backlog import partition_backlog

__all__ = ["BacklogTick", "backlog_tick", "build_drain_schedule", "build_sensors"]

Job = Any
"""What ``define_asset_job`` returns (its class is not part of Dagster's public API) or a
``JobDefinition``."""


_LOG_LINES = 20
"""Per-partition log lines a tick writes at most (then one "... and <k> more")."""


def _request(spec: ConsumerGroupAsset, p: int, run_key: str) -> RunRequest:
    return RunRequest(run_key=run_key, partition_key=spec.partition_key(p),
                      tags={CODE_TAG: spec.current_code_version()})


BACKLOG_CHECK_NAMES = ("lag_within_objective", "partition_runs_succeeding")
"""The asset checks the backlog sensor evaluates (and that can be executed by hand)."""

LAG_CHECK, RUNS_CHECK = BACKLOG_CHECK_NAMES

RECONCILE_TIMEOUT_S = 30.0
"""Seconds a tick gives the ``origin_reconciled`` evaluation (the tick limit is 60 s)."""


@dataclass
class BacklogTick:
    """What one backlog tick decided: ``run_requests``; ``skip_reason`` when there are none;
    ``asset_events`` (per-partition lag observations and check evaluations whose outcome
    changed; the drain schedule drops them); the sensor's next ``cursor``."""

    run_requests: list[RunRequest] = field(default_factory=list)
    skip_reason: str | None = None
    asset_events: list[AssetObservation | AssetCheckEvaluation] = field(default_factory=list)
    cursor: str | None = None


@dataclass(frozen=True)
class GroupReading:
    """One bounded read of a group: the served partitions and their backlog."""

    served: list[int]
    backlog: list[PartitionBacklog]


def read_group(spec: ConsumerGroupAsset, nats_res: NatsResource,
               runs: PartitionRunsResource) -> GroupReading:
    """One bounded NATS session: the group's config (partition count checked), then the
    backlog of the partitions this deployment serves (and only those).

    Raises:
        GroupNotFoundError, ConfigError, JetStreamError, TimeoutError, OSError: as reading
        fails (all in :data:`~cg_pipelines.dagster.assets.TICK_ERRORS`).
    """
    served_members = runs.served()

    async def read(nc: Any) -> GroupReading:
        v = await admin.get_elastic(nc.jetstream(), spec.stream, spec.group,
                                    timeout=nats_res.call_timeout_s)
        check_partitions(v.config, spec)
        served = served_partitions(assignment(v.config), served_members)
        async with JetStreamAPI(nc, timeout=nats_res.call_timeout_s) as api:
            return GroupReading(served, await partition_backlog(api, spec.stream, spec.group,
                                                                served))

    return nats_res.run(read)


def lag_evaluation(spec: ConsumerGroupAsset, backlog: list[PartitionBacklog]
                   ) -> AssetCheckEvaluation | None:
    """The ``lag_within_objective`` check over the served partitions (``None`` without an
    objective): fails while any partition's oldest pending message is older than
    ``spec.lag_objective_s``; metadata names them and their ages."""
    if spec.lag_objective_s is None:
        return None
    late = lag_breaches(backlog, spec.lag_objective_s)
    worst = max(backlog, key=lambda b: b.age_s if b.pending else -1.0, default=None)
    return AssetCheckEvaluation(
        asset_key=asset_key_of(spec), check_name=LAG_CHECK, passed=not late,
        severity=AssetCheckSeverity.WARN,
        description=(f"{len(late)} partition(s) lag more than {spec.lag_objective_s:g} s: "
                     + ", ".join(f"{spec.partition_key(b.partition)} ({b.age_s:.0f} s, "
                                 f"{b.pending} pending)" for b in late[:10])) if late else
        f"every served partition's oldest pending message is under "
        f"{spec.lag_objective_s:g} s old",
        metadata={"objective_s": spec.lag_objective_s,
                  "partitions_late": [spec.partition_key(b.partition) for b in late],
                  "max_oldest_pending_age_s": round(worst.age_s, 1) if worst and worst.pending
                  else 0.0,
                  "pending_total": sum(b.pending for b in backlog)})


def runs_evaluation(spec: ConsumerGroupAsset, exhausted: list[RetryWait],
                    policy: RetryPolicy) -> AssetCheckEvaluation:
    """The ``partition_runs_succeeding`` check: fails while a partition has failed
    ``policy.max_failures`` times in a row (no longer retried); names them and their last
    error."""
    return AssetCheckEvaluation(
        asset_key=asset_key_of(spec), check_name=RUNS_CHECK, passed=not exhausted,
        severity=AssetCheckSeverity.ERROR,
        description="; ".join(
            f"{spec.partition_key(w.partition)} failed {w.failures} runs in a row, not retried "
            f"until a run succeeds or new code is loaded; last error: {w.last_error}"
            for w in exhausted[:10]) if exhausted else
        f"no partition has failed {policy.max_failures} runs in a row",
        metadata={"partitions_failing": [spec.partition_key(w.partition) for w in exhausted],
                  "max_failures": policy.max_failures,
                  "last_errors": {spec.partition_key(w.partition): w.last_error
                                  for w in exhausted[:10]}})


def _decode_cursor(cursor: str | None) -> dict[str, Any]:
    try:
        obj = json.loads(cursor) if cursor else {}
    except ValueError:
        obj = {}
    return obj if isinstance(obj, dict) else {}


def _observations(spec: ConsumerGroupAsset, reading: GroupReading, seen: dict[str, Any],
                  warehouse: DeltaWarehouseResource | None, log: Any
                  ) -> tuple[list[AssetObservation], dict[str, Any]]:
    """Per-partition lag observations for partitions whose backlog changed since the last
    emitted one (``seen``: partition -> [pending, first pending seq]); returns them and the
    new ``seen``."""
    now_seen: dict[str, Any] = {}
    changed = []
    for b in reading.backlog:
        state = [b.pending, b.first_seq]
        now_seen[str(b.partition)] = state
        if seen.get(str(b.partition)) != state:
            changed.append(b)
    if not changed:
        return [], now_seen
    committed: dict[int, int] = {}
    if warehouse is not None:
        try:
            ids = {b.partition: app_id_for(spec.stream, spec.group, b.partition)
                   for b in changed}
            marks = warehouse.sink(spec.table_name).watermarks(ids.values())
            committed = {p: marks[a] for p, a in ids.items()}
        except Exception as e:  # noqa: BLE001 - the lag is still worth reporting
            log.warning(f"cannot read the committed watermarks of {spec.table_name}: {e}")
    events = []
    for b in changed:
        md: dict[str, Any] = {"pending": b.pending,
                              "oldest_pending_age_s": MetadataValue.float(round(b.age_s, 1)),
                              "first_pending_seq": b.first_seq or 0}
        if b.partition in committed:
            md["last_committed_seq"] = committed[b.partition]
        events.append(AssetObservation(asset_key=asset_key_of(spec),
                                       partition=spec.partition_key(b.partition), metadata=md))
    return events, now_seen


def backlog_tick(spec: ConsumerGroupAsset, nats_res: NatsResource,
                 runs: PartitionRunsResource, log: Any, *,
                 instance: DagsterInstance | None = None,
                 warehouse: DeltaWarehouseResource | None = None,
                 cursor: str | None = None, observe: bool = False) -> BacklogTick:
    """One backlog tick: read the group (:func:`read_group`), mark failed the runs whose
    worker process is gone, plan the runs with retries
    (:func:`~cg_pipelines.core.triggers.plan_backlog_runs`, run history from ``instance``),
    and with ``observe`` add lag observations and the two check evaluations when they changed
    since ``cursor``. Never raises for NATS or config trouble: the skip reason says it."""
    try:
        reading = read_group(spec, nats_res, runs)
    except TICK_ERRORS as e:
        return BacklogTick(skip_reason=f"consumer group {spec.stream}.{spec.group}: {e}",
                           cursor=cursor)
    policy = runs.retry_policy()
    code = spec.current_code_version()
    keys = {b.partition: spec.partition_key(b.partition) for b in reading.backlog
            if b.pending > 0}
    history = {}
    if instance is not None:
        for run_id in fail_lost_runs(instance, keys.values()):
            log.warning(f"run {run_id}: its run worker process is gone; marked failed")
        history = partition_runs(instance, keys, code, policy,
                                 exclude_tag=(MODE_TAG, "rebuild"))
    plan = plan_backlog_runs(spec.group, reading.backlog, history, policy, time.time(),
                             code=code, min_pending=runs.min_pending, max_age_s=runs.max_age_s,
                             partitions=reading.served)
    reasons = plan.reason_lines(policy)
    for line in summary_lines([f"partition {r.partition}: {r.reason}" for r in plan.requests]
                              + reasons, _LOG_LINES):
        log.info(line)
    tags = {CODE_TAG: code, "dagster/max_runtime": str(int(runs.run_timeout_s + 120))}
    out = BacklogTick(
        run_requests=[RunRequest(run_key=r.run_key, partition_key=spec.partition_key(
            r.partition), tags=tags) for r in plan.requests],
        cursor=cursor)
    if not out.run_requests:
        out.skip_reason = "; ".join(summary_lines(reasons, 5)) or "no partition with backlog"
    if not observe:
        return out
    state = _decode_cursor(cursor)
    events, seen = _observations(spec, reading, state.get("observed") or {}, warehouse, log)
    checks: dict[str, list[int]] = dict(state.get("checks") or {})
    lag = lag_evaluation(spec, reading.backlog)
    late = sorted(b.partition for b in lag_breaches(reading.backlog, spec.lag_objective_s)
                  ) if spec.lag_objective_s is not None else []
    if lag is not None and checks.get(LAG_CHECK) != late:
        events.append(lag)
        checks[LAG_CHECK] = late
    failing = sorted(w.partition for w in plan.exhausted)
    if checks.get(RUNS_CHECK) != failing:
        events.append(runs_evaluation(spec, plan.exhausted, policy))
        checks[RUNS_CHECK] = failing
    reconciled_at = float(state.get("reconciled_at") or 0.0)
    if (spec.reconcile_interval_s is not None and warehouse is not None
            and time.time() - reconciled_at >= spec.reconcile_interval_s):
        try:
            events.append(reconcile_evaluation(spec, nats_res, warehouse,
                                               timeout_s=RECONCILE_TIMEOUT_S))
            reconciled_at = time.time()
        except Exception as e:  # noqa: BLE001 - reported, retried at the next tick
            log.warning(f"origin_reconciled not evaluated: {type(e).__name__}: {e}")
    out.asset_events = events
    out.cursor = json.dumps({"observed": seen, "checks": checks,
                             "reconciled_at": reconciled_at}, separators=(",", ":"))
    return out


def _instance_of(context: SensorEvaluationContext | ScheduleEvaluationContext
                 ) -> DagsterInstance | None:
    """The context's instance (always there under the daemon), or None in a test context
    built without one: then no run history is read (no retries, no lost-run detection)."""
    try:
        return context.instance
    except DagsterInvariantViolationError:
        return None


def build_sensors(spec: ConsumerGroupAsset, job: Job) -> list[SensorDefinition]:
    """The membership and backlog sensors of ``spec`` (both stopped by default)."""
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
                asset_key=asset_key_of(spec), partition=spec.partition_key(p),
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
            default_status=DefaultSensorStatus.STOPPED, required_resource_keys=backlog_keys,
            description="Runs each served partition whose backlog is above the threshold or "
            "older than the max age; one run per backlog (run key = first pending sequence), "
            "failed partitions again after a backoff (new run key per retry) up to a limit. "
            "Records each partition's lag (pending, oldest pending age, last committed "
            "sequence) as asset observations and evaluates the lag_within_objective and "
            "partition_runs_succeeding checks.")
    def backlog_sensor(context: SensorEvaluationContext) -> SensorResult:
        got = backlog_tick(spec, getattr(context.resources, spec.nats_resource_key),
                           getattr(context.resources, spec.runs_resource_key), context.log,
                           instance=_instance_of(context),
                           warehouse=getattr(context.resources, spec.warehouse_resource_key),
                           cursor=context.cursor, observe=True)
        return SensorResult(run_requests=got.run_requests, skip_reason=got.skip_reason,
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
