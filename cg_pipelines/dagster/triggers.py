"""What launches an asset's runs, one input or a set alike: the ``<name>_membership`` sensor
(runs the partitions this deployment's members gained), the ``<name>_backlog`` sensor and the
``<name>_drain`` schedule (stopped by default), and the ONE backlog tick they share
(:func:`backlog_tick`: read every input, fail the lost runs, plan runs over the merged backlog,
then the :data:`OBSERVERS`, each keeping its part of the one cursor). Bounded: NATS calls within
``call_timeout_s``, constant instance queries, only changed check results written
(``docs/signals.md``, ``bench/sensor_ticks.py``)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from dagster import (
    AssetCheckEvaluation,
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
from nats.aio.client import Client

from cg_pipelines.core.assignment import assignment
from cg_pipelines.core.blocks import plan_ranges
from cg_pipelines.core.config import dlq_stream_name, work_queue_stream_name
from cg_pipelines.core.lag import LAG_STATES, lag_observations_due, lag_state
from cg_pipelines.core.triggers import (
    REPEAT_REQUEST_S,
    BacklogCursor,
    BacklogRequest,
    CursorError,
    MembershipCursor,
    PartitionBacklog,
    RetryPolicy,
    RetryWait,
    TickPlan,
    decode_cursor,
    drop_repeated_requests,
    encode_cursor,
    gained_partitions,
    plan_backlog_runs,
    summary_lines,
)
from cg_pipelines.dagster.checks import (
    EXCLUDED_RUNS,
    LOG_LINES,
    partition_checks,
    reconcile_evaluation,
)
from cg_pipelines.dagster.history import (
    CODE_TAG,
    Probe,
    Suspect,
    fail_lost_runs,
    partition_runs,
    range_tags,
)
from cg_pipelines.dagster.reading import Reading, read_inputs
from cg_pipelines.dagster.resources import NatsResource, PartitionRunsResource
from cg_pipelines.dagster.spec import TICK_ERRORS, StreamAsset, asset_key_of, load_configs
from cg_pipelines.dagster.warehouse import Warehouse
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.liveness import any_pinned, read_heartbeats, read_pins
from cg_pipelines.sinks.base import app_id_for

__all__ = ["OBSERVERS", "RECONCILE_TIMEOUT_S", "BacklogObserver", "BacklogTick", "Job",
           "TickView", "backlog_tick", "build_drain_schedule", "build_sensors", "fail_lost",
           "leases_of", "nats_probe", "read_cursor", "with_warning"]


RECONCILE_TIMEOUT_S = 30.0
"""Seconds a tick gives the ``origin_reconciled`` evaluations (the tick limit is 60 s)."""

CursorT = TypeVar("CursorT", MembershipCursor, BacklogCursor)
Lease = tuple[str, str]
"""``(work-queue stream, lease consumer)``."""


def read_cursor(text: str | None, kind: type[CursorT], log: Any) -> tuple[CursorT, str]:
    """The sensor's cursor, or, when it is corrupt, an empty one and a warning (logged, and
    returned for the tick's reason; ``""`` when the cursor was fine)."""
    try:
        return decode_cursor(text, kind), ""
    except CursorError as e:
        warning = f"{e}; starting over from an empty cursor"
        log.warning(warning)
        return kind(), warning


def with_warning(reason: str, warning: str) -> str:
    """``reason``, after ``warning`` when there is one."""
    return f"{warning}. {reason}" if warning else reason


# ------------------------------------------------------------------------------ lost runs

def leases_of(spec: StreamAsset, partition: int) -> list[Lease]:
    """Every input's lease of ``partition``: ``partition-<p>`` on ``<stream>-<group>``
    (:func:`cg_pipelines.engine.lease.lease_consumer_name`)."""
    return [(work_queue_stream_name(i.stream, i.group), f"partition-{partition}")
            for i in spec.inputs]


def nats_probe(nats_res: NatsResource, spec: StreamAsset) -> Probe:
    """A probe reading, in one bounded NATS session, each suspect's heartbeat and whether any
    input's lease of its partition is pinned; NATS trouble answers nothing (runs stay alive)."""

    def probe(suspects: Sequence[Suspect]) -> Mapping[str, tuple[bool | None, bool | None]]:
        wanted = {s.run_id: [lease for p in (s.partitions if s.partitions is not None
                                             else (spec.partition_of(s.partition_key),))
                             for lease in leases_of(spec, p)] for s in suspects}

        async def read(nc: Client) -> dict[str, tuple[bool | None, bool | None]]:
            api = JetStreamAPI(nc, timeout=nats_res.call_timeout_s / 2)
            try:
                beats = await read_heartbeats(api, wanted)
                pins = await read_pins(api, {x for ls in wanted.values() for x in ls})
            finally:
                await api.close()
            return {r: (beats.get(r), any_pinned(pins, ls)) for r, ls in wanted.items()}

        try:
            return nats_res.run(read)
        except TICK_ERRORS:
            return {}

    return probe


def fail_lost(instance: DagsterInstance, spec: StreamAsset, keys: Sequence[str],
              nats_res: NatsResource, runs: PartitionRunsResource, log: Any, now: float
              ) -> None:
    """Mark failed the lost runs of partition ``keys`` (:func:`fail_lost_runs` with
    :func:`nats_probe`), one warning each naming why."""
    for run_id, reason in fail_lost_runs(instance, keys, nats_probe(nats_res, spec),
                                         grace_s=runs.lost_run_grace_s, now=now,
                                         key_of=spec.partition_key):
        log.warning(f"run {run_id} is lost: {reason}; marked failed")


# ------------------------------------------------------------------------------ the tick

@dataclass
class BacklogTick:
    """What one tick decided: ``run_requests`` (else a ``skip_reason``), ``asset_events``,
    the next ``cursor``, ``check_evaluations`` (recorded run-less; all without an instance)
    and ``check_requests`` (check-only runs)."""

    run_requests: list[RunRequest] = field(default_factory=list)
    skip_reason: str | None = None
    asset_events: list[AssetObservation | AssetCheckEvaluation] = field(default_factory=list)
    cursor: str | None = None
    check_evaluations: list[AssetCheckEvaluation] = field(default_factory=list)
    check_requests: list[RunRequest] = field(default_factory=list)


@dataclass(frozen=True)
class TickView:
    """What every observer of one tick reads (``now``: Unix seconds; ``exhausted``: the
    partitions whose runs used up their retries; ``previous``: the cursor it started from)."""

    spec: StreamAsset
    nats_res: NatsResource
    warehouse: Warehouse | None
    instance: DagsterInstance | None
    log: Any
    now: float
    reading: Reading
    exhausted: list[RetryWait]
    policy: RetryPolicy
    check_job: str | None
    previous: BacklogCursor


BacklogObserver = Callable[[TickView, BacklogCursor, BacklogTick], BacklogCursor]
"""``observer(view, cursor, out) -> cursor``: adds its events to ``out`` and returns ``cursor``
with its own fields replaced."""


def backlog_tick(spec: StreamAsset, nats_res: NatsResource, runs: PartitionRunsResource,
                 log: Any, *, instance: DagsterInstance | None = None,
                 warehouse: Warehouse | None = None, cursor: str | None = None,
                 observe: bool = False, now: float | None = None, job_name: str | None = None,
                 check_job: str | None = None) -> BacklogTick:
    """One backlog tick: a run for each served partition whose merged backlog reaches
    ``min_pending`` or ``max_age_s``, run key ``<label>:<p>:<first pending sequence>``
    (retries: a new key after a backoff, up to ``retry_max_failures``). With ``observe`` (the
    sensor, not the schedule): repeats dropped, the :data:`OBSERVERS`, the cursor.
    ``instance`` None: no history. ``now``: Unix seconds. Never raises for NATS or config
    trouble: the skip reason says it."""
    now = time.time() if now is None else now
    state, warning = read_cursor(cursor, BacklogCursor, log) if observe else (
        BacklogCursor(), "")
    if warning:
        cursor = encode_cursor(state)
    try:
        reading = read_inputs(spec, nats_res, runs,
                              dead_letters_seen=state.dead_letters if observe else None)
    except TICK_ERRORS as e:
        return BacklogTick(skip_reason=with_warning(f"{spec.title}: {e}", warning),
                           cursor=cursor)
    policy, code = runs.retry_policy(), spec.current_code_version()
    keys = {b.partition: spec.partition_key(b.partition) for b in reading.backlog
            if b.pending > 0}
    history, errors = {}, dict(state.errors)
    if instance is not None:
        fail_lost(instance, spec, list(keys.values()), nats_res, runs, log, now)
        history = partition_runs(instance, keys, code, policy, exclude_tag=EXCLUDED_RUNS,
                                 errors=errors)
    plan = plan_backlog_runs(spec.label, reading.backlog, history, policy, now, code=code,
                             min_pending=runs.min_pending, max_age_s=runs.max_age_s,
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
    d = reading.layout.partitions_per_run if reading.layout is not None \
        else runs.partitions_per_run  # `cg runs set` wins over the deployment's setting
    out = BacklogTick(run_requests=run_requests(spec, send, plan, d, tags, job_name),
                      cursor=cursor)
    if not out.run_requests:
        out.skip_reason = with_warning(
            "; ".join(summary_lines(reasons, 5)) or "no partition with backlog", warning)
    if not observe:
        return out
    view = TickView(spec, nats_res, warehouse, instance, log, now, reading, plan.exhausted,
                    policy, check_job, state)
    nxt = BacklogCursor(dict(state.observed), state.reconciled_at, dict(state.dead_letters),
                        errors, requested)
    for observer in OBSERVERS:
        nxt = observer(view, nxt, out)
    out.cursor = encode_cursor(nxt)
    return out


def run_requests(spec: StreamAsset, send: Sequence[BacklogRequest], plan: TickPlan, d: int,
                 tags: Mapping[str, str], job_name: str | None) -> list[RunRequest]:
    """The tick's run requests: one per partition (``d == 1``, or a set), else one per range
    :func:`~cg_pipelines.core.blocks.plan_ranges` gives (aligned blocks of ``d``; a block
    with a partition in progress waits; partitions waiting for a retry or given up on are
    carved out). A range run carries Dagster's range tags and :func:`~cg_pipelines.dagster.
    history.range_tags`, runs no asset check (Dagster 1.13 records a range run's check results
    without a partition: the sensor's check-only runs evaluate them per partition), and its
    run key is ``<label>:<first>-<last>:<digest of its partitions' run keys>``."""
    if d == 1 or spec.is_set:
        return [RunRequest(run_key=r.run_key, partition_key=spec.partition_key(r.partition),
                           tags=dict(tags), job_name=job_name) for r in send]
    by_p = {r.partition: r for r in send}
    ranges = plan_ranges(spec.partitions, d, by_p, plan.in_progress,
                         [w.partition for w in (*plan.exhausted, *plan.waiting)])
    out = []
    for first, last in ranges:
        keys = [by_p[p].run_key for p in range(first, last + 1) if p in by_p]
        digest = hashlib.sha256("\n".join(keys).encode()).hexdigest()[:16]
        if first == last:
            out.append(RunRequest(run_key=by_p[first].run_key,
                                  partition_key=spec.partition_key(first), tags=dict(tags),
                                  job_name=job_name))
            continue
        out.append(RunRequest(
            run_key=f"{spec.label}:{first}-{last}:{digest}", job_name=job_name,
            asset_selection=[asset_key_of(spec)], asset_check_keys=[],
            tags={**tags, **range_tags(first, last),
                  ASSET_PARTITION_RANGE_START_TAG: spec.partition_key(first),
                  ASSET_PARTITION_RANGE_END_TAG: spec.partition_key(last)}))
    return out


ASSET_PARTITION_RANGE_START_TAG = "dagster/asset_partition_range_start"
ASSET_PARTITION_RANGE_END_TAG = "dagster/asset_partition_range_end"
"""Dagster's run tags of a run over a partition key range (what a single-run backfill sets;
``RunRequest`` has no range argument in 1.13)."""


# ------------------------------------------------------------------------------ observers

def _committed(view: TickView, due: list[PartitionBacklog]) -> dict[tuple[str, int], int]:
    """``{(input name, partition): last committed sequence}`` (one watermark read)."""
    spec = view.spec
    if view.warehouse is None or not due:
        return {}
    ids = {(i.name, b.partition): app_id_for(i.stream, i.group, b.partition)
           for i in spec.inputs for b in due}
    try:
        marks = view.warehouse.sink(spec.table_name).watermarks(ids.values())
        return {k: marks[a] for k, a in ids.items()}
    except Exception as e:  # the lag is still worth reporting
        view.log.warning(f"cannot read the committed watermarks of {spec.table_name}: {e}")
        return {}


def observe_lag(view: TickView, cursor: BacklogCursor, out: BacklogTick) -> BacklogCursor:
    """Lag observations when a partition's lag state changes, else every ``lag_refresh_s``
    while it has a backlog (:func:`~cg_pipelines.core.lag.lag_observations_due`): ``lag_state``,
    ``pending``, ``oldest_pending_age_s`` (s), ``first_pending_seq``,
    ``oldest_pending_timestamp``, per input (``<input>/`` on a set) ``pending``,
    ``oldest_pending_age_s``, ``last_committed_seq``."""
    spec, now = view.spec, view.now
    due, observed = lag_observations_due(
        view.reading.backlog, view.previous.observed, now, spec.lag_refresh_s,
        objective_s=spec.lag_objective_s, per_day=spec.lag_observations_per_day)
    committed = _committed(view, due)
    index = {p: n for n, p in enumerate(view.reading.served)}
    for b in due:
        md: dict[str, Any] = {"lag_state": LAG_STATES[lag_state(b, spec.lag_objective_s)],
                              "pending": b.pending,
                              "oldest_pending_age_s": MetadataValue.float(round(b.age_s, 1)),
                              "first_pending_seq": b.first_seq or 0}
        if b.pending > 0:
            md["oldest_pending_timestamp"] = MetadataValue.timestamp(
                round(b.oldest_pending_time(now), 3))
        for i in spec.inputs:
            pre = spec.md_prefix(i)
            if pre:
                r = view.reading.by_input[i.name][index[b.partition]]
                md[f"{pre}pending"] = r.pending
                md[f"{pre}oldest_pending_age_s"] = MetadataValue.float(round(r.age_s, 1))
            if (i.name, b.partition) in committed:
                md[f"{pre}last_committed_seq"] = committed[(i.name, b.partition)]
        out.asset_events.append(AssetObservation(
            asset_key=asset_key_of(spec), partition=spec.partition_key(b.partition), metadata=md))
    return replace(cursor, observed=observed)


def observe_dead_letters(view: TickView, cursor: BacklogCursor, out: BacklogTick
                         ) -> BacklogCursor:
    """One observation per input and partition whose dead-letter count changed (``<input>/``
    keys on a set): the count, the latest one's sequences and reason, the stream."""
    spec = view.spec
    for i in spec.inputs:
        pre = spec.md_prefix(i)
        for d in view.reading.dead_changed.get(i.name, []):
            reason = " ".join((d.latest_reason or "").split())
            out.asset_events.append(AssetObservation(
                asset_key=asset_key_of(spec), partition=spec.partition_key(d.partition),
                metadata={f"{pre}dead_letters": d.count,
                          f"{pre}latest_dead_letter_seq": d.latest_seq or 0,
                          f"{pre}latest_dead_letter_source_seq": d.latest_source_seq or 0,
                          f"{pre}latest_dead_letter_reason": reason[:400],
                          f"{pre}dead_letter_stream": dlq_stream_name(i.stream, i.group)}))
    return replace(cursor, dead_letters=dict(view.reading.dead_counts))


def observe_checks(view: TickView, cursor: BacklogCursor, out: BacklogTick) -> BacklogCursor:
    """The partitioned checks (:func:`~cg_pipelines.dagster.checks.partition_checks`)."""
    try:
        out.check_evaluations, out.check_requests = partition_checks(
            view.spec, view.reading, view.exhausted, view.policy, view.instance, view.log,
            view.now, view.check_job)
    except Exception as e:  # the runs and the lag still matter; next tick
        view.log.warning(f"partitioned checks not recorded: {type(e).__name__}: {e}")
    return cursor


def observe_reconcile(view: TickView, cursor: BacklogCursor, out: BacklogTick
                      ) -> BacklogCursor:
    """Each input's ``origin_reconciled`` every ``reconcile_interval_s`` seconds."""
    spec = view.spec
    if (spec.reconcile_interval_s is None or view.warehouse is None
            or view.now - view.previous.reconciled_at < spec.reconcile_interval_s):
        return cursor
    try:
        for i in spec.inputs:
            out.asset_events.append(reconcile_evaluation(
                spec, view.nats_res, view.warehouse, inp=i,
                timeout_s=RECONCILE_TIMEOUT_S / len(spec.inputs)))
    except Exception as e:  # reported, retried at the next tick
        view.log.warning(f"origin_reconciled not evaluated: {type(e).__name__}: {e}")
        return cursor
    return replace(cursor, reconciled_at=view.now)


OBSERVERS: tuple[BacklogObserver, ...] = (observe_lag, observe_dead_letters, observe_checks,
                                          observe_reconcile)
"""The observers a backlog tick calls, in this order (the order of its asset events)."""


Job = Any
"""What ``define_asset_job`` returns (its class is not part of Dagster's public API) or a
``JobDefinition``."""


def _instance_of(context: SensorEvaluationContext | ScheduleEvaluationContext
                 ) -> DagsterInstance | None:
    """The context's instance, or None in a test context built without one."""
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
