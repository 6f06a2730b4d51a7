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
subscription); a tick logs at most ``_LOG_LINES`` per-partition lines; the Dagster instance is
asked a constant number of times (run history: :func:`cg_pipelines.dagster.history.partition_runs`;
check states: one read). A tick writes only check results that changed: at most
:data:`CHECKS_PER_TICK` first results (run-less events), and at most
:data:`CHECK_RUNS_PER_TICK` check-only runs requested for partitions whose results changed
(:func:`plan_partition_checks`); a steady tick writes nothing.
``bench/sensor_ticks.py`` measures ticks at 256 and 4096 partitions (SQLite and Postgres).
Signals, their meaning and volume: ``docs/signals.md``.
"""


import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dagster import (
    AssetCheckEvaluation,
    AssetCheckKey,
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
from cg_pipelines.core.config import dlq_stream_name
from cg_pipelines.core.errors import ConfigError
from cg_pipelines.core.triggers import (
    REPEAT_REQUEST_S,
    BacklogCursor,
    CursorError,
    MembershipCursor,
    PartitionBacklog,
    RetryPolicy,
    RetryWait,
    decode_cursor,
    drop_repeated_requests,
    encode_cursor,
    gained_partitions,
    lag_observations_due,
    plan_backlog_runs,
    served_partitions,
    summary_lines,
)
from cg_pipelines.dagster.history import (
    CHECK_MODE,
    CODE_TAG,
    MODE_TAG,
    CheckState,
    check_states,
    fail_lost_runs,
    finished_runs,
    partition_runs,
    record_first_checks,
)
from cg_pipelines.dagster.reconcile import reconcile_evaluation
from cg_pipelines.dagster.resources import (
    DeltaWarehouseResource,
    NatsResource,
    PartitionRunsResource,
)
from cg_pipelines.dagster.spec import (
    TICK_ERRORS,
    ConsumerGroupAsset,
    asset_key_of,
    check_partitions,
    load_group_config,
)
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.backlog import (
    DeadLetterSummary,
    dead_letter_counts,
    latest_dead_letters,
    partition_backlog,
)
from cg_pipelines.sinks.base import app_id_for

__all__ = ["BacklogTick", "PartitionChecks", "backlog_tick", "build_drain_schedule",
           "build_sensors", "evaluate_check", "plan_partition_checks"]

CursorT = TypeVar("CursorT", MembershipCursor, BacklogCursor)

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

CHECKS_PER_TICK = 400
"""First (run-less) partitioned check results a tick records at most (failing ones first);
the others are recorded by the next ticks (they still have none then). One Dagster event
write each (~15 ms on SQLite): keeps the first ticks of a large group (two checks per
partition: 21 ticks at 4,096 partitions) well inside the 60 s tick limit."""

CHECK_RUNS_PER_TICK = 16
"""Check-only runs (one per partition whose recorded results changed) a tick requests at
most (failing first); the others are requested by the next ticks (still changed then)."""

CHECK_RETRY_S = 300.0
"""Seconds before a partition whose check-only run ended without recording its results
(e.g. it failed) gets another one."""

EXCLUDED_RUNS = (MODE_TAG, ("rebuild", CHECK_MODE))
"""Runs that are not partition runs for the run history: rebuilds and check-only runs."""

RECONCILE_TIMEOUT_S = 30.0
"""Seconds a tick gives the ``origin_reconciled`` evaluation (the tick limit is 60 s)."""


@dataclass
class BacklogTick:
    """What one backlog tick decided: ``run_requests``; ``skip_reason`` when there are none;
    ``asset_events`` (per-partition lag and dead-letter observations, the unpartitioned
    ``origin_reconciled`` evaluation; the drain schedule drops them); the sensor's next
    ``cursor``; ``check_evaluations``: with an instance, the partitioned check results
    recorded run-less (first results), without one all of them; ``check_requests``: the
    check-only runs requested (partitions whose recorded results changed), apart from
    ``run_requests`` (the partition runs) and never reasons for a skip."""

    run_requests: list[RunRequest] = field(default_factory=list)
    skip_reason: str | None = None
    asset_events: list[AssetObservation | AssetCheckEvaluation] = field(default_factory=list)
    cursor: str | None = None
    check_evaluations: list[AssetCheckEvaluation] = field(default_factory=list)
    check_requests: list[RunRequest] = field(default_factory=list)


@dataclass(frozen=True)
class GroupReading:
    """One bounded read of a group: the served partitions and their backlog; with
    ``dead_letters``, the served partitions' dead-letter counts and the latest dead letter of
    each partition whose count changed."""

    served: list[int]
    backlog: list[PartitionBacklog]
    dead_counts: dict[int, int] = field(default_factory=dict)
    dead_changed: list[DeadLetterSummary] = field(default_factory=list)


def read_group(spec: ConsumerGroupAsset, nats_res: NatsResource,
               runs: PartitionRunsResource, *,
               dead_letters_seen: dict[int, int] | None = None,
               only: Iterable[int] | None = None) -> GroupReading:
    """One bounded NATS session: the group's config (partition count checked), then the
    backlog of the partitions this deployment serves (and only those; with ``only``, of
    those of ``only`` it serves); with
    ``dead_letters_seen`` (``{partition: count}`` last observed), also the dead-letter counts
    (one request) and the latest dead letter of each served partition whose count changed.

    Raises:
        GroupNotFoundError, ConfigError, JetStreamError, TimeoutError, OSError: as reading
        fails (all in :data:`~cg_pipelines.dagster.spec.TICK_ERRORS`).
    """
    served_members = runs.served()

    async def read(nc: Any) -> GroupReading:
        v = await admin.get_elastic(nc.jetstream(), spec.stream, spec.group,
                                    timeout=nats_res.call_timeout_s)
        check_partitions(v.config, spec)
        served = served_partitions(assignment(v.config), served_members)
        if only is not None:
            wanted = set(only)
            served = [p for p in served if p in wanted]
        async with JetStreamAPI(nc, timeout=nats_res.call_timeout_s) as api:
            backlog = await partition_backlog(api, spec.stream, spec.group, served)
            if dead_letters_seen is None:
                return GroupReading(served, backlog)
            dlq = dlq_stream_name(spec.stream, spec.group)
            mine = set(served)
            counts = {p: n for p, n in (await dead_letter_counts(api, dlq)).items()
                      if p in mine}
            changed = {p: counts.get(p, 0) for p in mine
                       if counts.get(p, 0) != dead_letters_seen.get(p, 0)}
            return GroupReading(served, backlog, counts,
                                await latest_dead_letters(api, dlq, changed))

    return nats_res.run(read)


def lag_evaluations(spec: ConsumerGroupAsset, backlog: list[PartitionBacklog]
                    ) -> list[AssetCheckEvaluation]:
    """The ``lag_within_objective`` check of each partition in ``backlog`` (none without an
    objective): fails while the partition's oldest pending message is older than
    ``spec.lag_objective_s`` seconds; the description gives its age and backlog."""
    if spec.lag_objective_s is None:
        return []
    out = []
    for b in backlog:
        late = b.pending > 0 and b.age_s > spec.lag_objective_s
        out.append(AssetCheckEvaluation(
            asset_key=asset_key_of(spec), check_name=LAG_CHECK, passed=not late,
            partition=spec.partition_key(b.partition), severity=AssetCheckSeverity.WARN,
            description=(f"oldest pending message {b.age_s:.0f} s old, more than the "
                         f"{spec.lag_objective_s:g} s objective ({b.pending} pending)")
            if late else f"oldest pending message under {spec.lag_objective_s:g} s old "
            f"({b.pending} pending)",
            metadata={"objective_s": spec.lag_objective_s, "pending": b.pending,
                      "oldest_pending_age_s": round(b.age_s, 1) if b.pending else 0.0}))
    return out


def runs_evaluations(spec: ConsumerGroupAsset, partitions: list[int],
                     exhausted: list[RetryWait], policy: RetryPolicy
                     ) -> list[AssetCheckEvaluation]:
    """The ``partition_runs_succeeding`` check of each of ``partitions``: fails while the
    partition has failed ``policy.max_failures`` runs in a row (no longer retried); the
    description names it and its last error (up to 400 characters)."""
    given_up = {w.partition: w for w in exhausted}
    out = []
    for p in partitions:
        w = given_up.get(p)
        key = spec.partition_key(p)
        out.append(AssetCheckEvaluation(
            asset_key=asset_key_of(spec), check_name=RUNS_CHECK, passed=w is None,
            partition=key, severity=AssetCheckSeverity.ERROR,
            description=(f"{key} failed {w.failures} runs in a row, not retried until a run "
                         f"succeeds or new code is loaded; last error: {w.last_error}")
            if w is not None else f"{key} has not failed {policy.max_failures} runs in a row",
            metadata={"max_failures": policy.max_failures,
                      "failures": w.failures if w is not None else 0,
                      "last_error": w.last_error if w is not None else ""}))
    return out


def _read_cursor(text: str | None, kind: type[CursorT], log: Any) -> tuple[CursorT, str]:
    """The sensor's cursor, or, when it is corrupt (:class:`CursorError`), an empty one and a
    warning (logged, and returned for the tick's reason; ``""`` when the cursor was fine)."""
    try:
        return decode_cursor(text, kind), ""
    except CursorError as e:
        warning = f"{e}; starting over from an empty cursor"
        log.warning(warning)
        return kind(), warning


def _lag_observations(spec: ConsumerGroupAsset, due: list[PartitionBacklog],
                      warehouse: DeltaWarehouseResource | None, log: Any
                      ) -> list[AssetObservation]:
    """Lag observations of the partitions ``due``
    (:func:`~cg_pipelines.core.triggers.lag_observations_due`), with each one's last committed
    sequence when the warehouse can tell it (one watermark read for all of them)."""
    if not due:
        return []
    committed: dict[int, int] = {}
    if warehouse is not None:
        try:
            ids = {b.partition: app_id_for(spec.stream, spec.group, b.partition) for b in due}
            marks = warehouse.sink(spec.table_name).watermarks(ids.values())
            committed = {p: marks[a] for p, a in ids.items()}
        except Exception as e:  # noqa: BLE001 - the lag is still worth reporting
            log.warning(f"cannot read the committed watermarks of {spec.table_name}: {e}")
    events = []
    for b in due:
        md: dict[str, Any] = {"pending": b.pending,
                              "oldest_pending_age_s": MetadataValue.float(round(b.age_s, 1)),
                              "first_pending_seq": b.first_seq or 0}
        if b.partition in committed:
            md["last_committed_seq"] = committed[b.partition]
        events.append(AssetObservation(asset_key=asset_key_of(spec),
                                       partition=spec.partition_key(b.partition), metadata=md))
    return events


def _dead_letter_observations(spec: ConsumerGroupAsset, changed: list[DeadLetterSummary]
                              ) -> list[AssetObservation]:
    """One observation per partition whose dead-letter count changed: how many, the latest
    one's dead-letter and source sequences and reason (cut at 400 characters)."""
    out = []
    for d in changed:
        reason = " ".join((d.latest_reason or "").split())
        out.append(AssetObservation(
            asset_key=asset_key_of(spec), partition=spec.partition_key(d.partition),
            metadata={"dead_letters": d.count, "latest_dead_letter_seq": d.latest_seq or 0,
                      "latest_dead_letter_source_seq": d.latest_source_seq or 0,
                      "latest_dead_letter_reason": reason[:400],
                      "dead_letter_stream": dlq_stream_name(spec.stream, spec.group)}))
    return out


@dataclass(frozen=True)
class PartitionChecks:
    """What a tick does about the partitioned checks: ``first``, the ``(check, partition
    key)`` results to record run-less (nothing recorded for them yet); ``rerun``,
    ``{partition key: why}`` of the partitions whose checks a check-only run records again;
    ``run_keys``, each such partition's run key."""

    first: list[tuple[str, str]] = field(default_factory=list)
    rerun: dict[str, str] = field(default_factory=dict)
    run_keys: dict[str, str] = field(default_factory=dict)


def plan_partition_checks(group: str, want: dict[tuple[str, str], bool],
                          states: dict[tuple[str, str], CheckState], ended: set[str],
                          now: float) -> PartitionChecks:
    """Which results to write, from the wanted outcomes ``{(check, partition key): passed}``
    and what Dagster shows (``states``, :func:`~cg_pipelines.dagster.history.check_states`).
    ``ended``: the run ids of those PLANNED states whose run has ended; ``now``: Unix seconds
    (the retry's time bucket). Pure; raises nothing.

    - no execution recorded for (check, partition): a first result, recorded run-less (Dagster
      allows one run-less result per check and partition);
    - the recorded outcome differs from the wanted one, or it fails and a newer
      materialization made it stale (a failure stays visible against the latest
      materialization): the partition's checks are recorded again by a check-only run (its
      run key: the partition and the newest storage id of its checks, so one run per recorded
      state: Dagster never runs a sensor's run key twice);
    - planned only (a check run is in progress): nothing until it ends; if it ended without a
      result, another check run at most every :data:`CHECK_RETRY_S` seconds;
    - anything else (same outcome; a passing result made stale by a materialization: Dagster
      then shows no status for that partition until its next result): nothing.

    At most :data:`CHECKS_PER_TICK` first results and :data:`CHECK_RUNS_PER_TICK` partitions,
    failing ones first.
    """
    first: list[tuple[str, str]] = []
    rerun: dict[str, list[str]] = {}
    retry: set[str] = set()
    for (name, key), ok in want.items():
        st = states.get((name, key))
        if st is None:
            first.append((name, key))
        elif st.passed is None:
            if st.run_id in ended:
                rerun.setdefault(key, []).append(
                    f"{name}: its check run {st.run_id} ended without a result")
                retry.add(key)
        elif st.passed is not ok:
            change = "passed -> failed" if st.passed else "failed -> passed"
            rerun.setdefault(key, []).append(f"{name} {change}")
        elif not ok and not st.current:
            rerun.setdefault(key, []).append(
                f"{name} still failing, recorded before the partition's latest materialization")
    failing = {key for (_, key), ok in want.items() if not ok}
    chosen = sorted(rerun, key=lambda k: k not in failing)[:CHECK_RUNS_PER_TICK]
    first = [k for k in sorted(first, key=lambda k: want[k]) if k[1] not in rerun
             ][:CHECKS_PER_TICK]
    keys: dict[str, str] = {}
    for key in chosen:
        newest = max((st.storage_id for (_, k), st in states.items() if k == key), default=0)
        keys[key] = f"{group}:checks:{key}:{newest}" + (
            f":{int(now // CHECK_RETRY_S)}" if key in retry else "")
    return PartitionChecks(first, {k: "; ".join(rerun[k]) for k in chosen}, keys)


def _partition_checks(spec: ConsumerGroupAsset, reading: GroupReading, exhausted: list[RetryWait],
                      policy: RetryPolicy, instance: DagsterInstance | None, log: Any,
                      now: float, check_job: str | None
                      ) -> tuple[list[AssetCheckEvaluation], list[RunRequest]]:
    """The served partitions' partitioned checks: without an instance, every evaluation
    (nothing recorded, no run); with one, :func:`plan_partition_checks` from one check-state
    read (plus one run-records query when a check run's result is still planned): the first
    results recorded run-less (returned), and one check-only run requested (``check_job``)
    per partition whose results changed. Outcomes are compared first (booleans): only the
    evaluations to record are built. Returns (evaluations recorded, check run requests)."""
    served = set(reading.served)
    backlog = [b for b in reading.backlog if b.partition in served]
    given_up = {w.partition for w in exhausted}
    want: dict[tuple[str, str], bool] = {}
    if spec.lag_objective_s is not None:
        for b in backlog:
            want[(LAG_CHECK, spec.partition_key(b.partition))] = not (
                b.pending > 0 and b.age_s > spec.lag_objective_s)
    for p in sorted(served):
        want[(RUNS_CHECK, spec.partition_key(p))] = p not in given_up
    if instance is None or not want:
        keys = set(want)
    else:
        states = check_states(instance, asset_key_of(spec), {n for n, _ in want})
        planned = {st.run_id for k, st in states.items() if k in want and st.passed is None}
        todo = plan_partition_checks(spec.group, want, states,
                                     finished_runs(instance, planned), now)
        keys = set(todo.first)
    out = [*lag_evaluations(spec, [b for b in backlog
                                   if (LAG_CHECK, spec.partition_key(b.partition)) in keys]),
           *runs_evaluations(spec, [p for p in sorted(served)
                                    if (RUNS_CHECK, spec.partition_key(p)) in keys],
                             exhausted, policy)]
    if instance is None or not want:
        return out, []
    out = record_first_checks(instance, out, log) if out else []
    requests = []
    if check_job is not None:
        for line in summary_lines([f"partition {k}: checks recorded again by a check run "
                                   f"({why})" for k, why in todo.rerun.items()], _LOG_LINES):
            log.info(line)
        # The checks only (no asset: nothing materialized), as the Checks tab's "Execute".
        names = [LAG_CHECK, RUNS_CHECK] if spec.lag_objective_s is not None else [RUNS_CHECK]
        selected = [AssetCheckKey(asset_key_of(spec), n) for n in names]
        requests = [RunRequest(run_key=todo.run_keys[k], partition_key=k, job_name=check_job,
                               asset_selection=[], asset_check_keys=selected,
                               tags={MODE_TAG: CHECK_MODE}) for k in todo.rerun]
    return out, requests


def evaluate_check(spec: ConsumerGroupAsset, name: str, partition_key: str,
                   nats_res: NatsResource, runs: PartitionRunsResource,
                   instance: DagsterInstance, now: float | None = None
                   ) -> AssetCheckEvaluation | None:
    """Check ``name`` (:data:`LAG_CHECK` or :data:`RUNS_CHECK`) of one partition, computed as
    the backlog sensor computes it and nothing else (for a check executed by hand): the
    group's config and that partition's backlog (one NATS session); for :data:`RUNS_CHECK`
    also its run history (:func:`~cg_pipelines.dagster.history.partition_runs`). Nothing is
    written, no run is marked failed, no other partition is read. ``now``: Unix seconds.

    Returns:
        The evaluation, or ``None`` when this deployment does not serve the partition (or
        :data:`LAG_CHECK` without a lag objective).

    Raises:
        ConfigError: ``partition_key`` is not one of the asset's, or ``name`` is not one of
            :data:`BACKLOG_CHECK_NAMES`.
        GroupNotFoundError, JetStreamError, TimeoutError, OSError: reading the group fails
            (:data:`~cg_pipelines.dagster.spec.TICK_ERRORS`).
    """
    if name not in BACKLOG_CHECK_NAMES:
        raise ConfigError("check", f"{name!r} is not one of {', '.join(BACKLOG_CHECK_NAMES)}")
    p = spec.partition_of(partition_key)
    reading = read_group(spec, nats_res, runs, only=[p])
    if p not in reading.served:
        return None
    if name == LAG_CHECK:
        found = lag_evaluations(spec, reading.backlog)
        return found[0] if found else None
    policy = runs.retry_policy()
    code = spec.current_code_version()
    pending = {b.partition: partition_key for b in reading.backlog if b.pending > 0}
    history = partition_runs(instance, pending, code, policy,
                             exclude_tag=EXCLUDED_RUNS) if pending else {}
    plan = plan_backlog_runs(spec.group, reading.backlog, history, policy,
                             time.time() if now is None else now, code=code,
                             min_pending=runs.min_pending, max_age_s=runs.max_age_s,
                             partitions=[p])
    return runs_evaluations(spec, [p], plan.exhausted, policy)[0]


def backlog_tick(spec: ConsumerGroupAsset, nats_res: NatsResource,
                 runs: PartitionRunsResource, log: Any, *,
                 instance: DagsterInstance | None = None,
                 warehouse: DeltaWarehouseResource | None = None,
                 cursor: str | None = None, observe: bool = False,
                 now: float | None = None, job_name: str | None = None,
                 check_job: str | None = None) -> BacklogTick:
    """One backlog tick: read the group (:func:`read_group`), mark failed the runs whose
    worker process is gone, plan the runs with retries
    (:func:`~cg_pipelines.core.triggers.plan_backlog_runs`, run history from ``instance``:
    a constant number of queries, :func:`~cg_pipelines.dagster.history.partition_runs`).

    With ``observe``: lag observations at a bounded rate
    (:func:`~cg_pipelines.core.triggers.lag_observations_due`, every
    ``spec.lag_refresh_s`` seconds at most), dead-letter observations of the partitions whose
    count changed, and the partitioned ``lag_within_objective`` and
    ``partition_runs_succeeding`` checks of the served partitions, only where they changed
    (:func:`plan_partition_checks`: first results recorded run-less in ``instance``, later
    ones by check-only runs of ``check_job`` in ``check_requests``, none without
    ``check_job``; all evaluations are returned in ``check_evaluations`` instead without an
    instance; a check executed by hand is :func:`evaluate_check`, not a tick). Repeated run
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
    policy = runs.retry_policy()
    code = spec.current_code_version()
    keys = {b.partition: spec.partition_key(b.partition) for b in reading.backlog
            if b.pending > 0}
    history = {}
    errors = dict(state.errors)
    if instance is not None:
        for run_id in fail_lost_runs(instance, keys.values()):
            log.warning(f"run {run_id}: its run worker process is gone; marked failed")
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
                              + reasons, _LOG_LINES):
        log.info(line)
    tags = {CODE_TAG: code, "dagster/max_runtime": str(int(runs.run_timeout_s + 120))}
    out = BacklogTick(
        run_requests=[RunRequest(run_key=r.run_key, partition_key=spec.partition_key(
            r.partition), tags=tags, job_name=job_name) for r in send],
        cursor=cursor)
    if not out.run_requests:
        out.skip_reason = _with_warning(
            "; ".join(summary_lines(reasons, 5)) or "no partition with backlog", warning)
    if not observe:
        return out
    due, seen = lag_observations_due(reading.backlog, state.observed, now, spec.lag_refresh_s)
    events: list[AssetObservation | AssetCheckEvaluation] = [
        *_lag_observations(spec, due, warehouse, log),
        *_dead_letter_observations(spec, reading.dead_changed)]
    try:
        out.check_evaluations, out.check_requests = _partition_checks(
            spec, reading, plan.exhausted, policy, instance, log, now, check_job)
    except Exception as e:  # noqa: BLE001 - the runs and the lag still matter; next tick
        log.warning(f"partitioned checks not recorded: {type(e).__name__}: {e}")
    reconciled_at = state.reconciled_at
    if (spec.reconcile_interval_s is not None and warehouse is not None
            and now - reconciled_at >= spec.reconcile_interval_s):
        try:
            events.append(reconcile_evaluation(spec, nats_res, warehouse,
                                               timeout_s=RECONCILE_TIMEOUT_S))
            reconciled_at = now
        except Exception as e:  # noqa: BLE001 - reported, retried at the next tick
            log.warning(f"origin_reconciled not evaluated: {type(e).__name__}: {e}")
    out.asset_events = events
    # errors: pruned by partition_runs to the partitions' newest failures
    out.cursor = encode_cursor(BacklogCursor(seen, reconciled_at, dict(reading.dead_counts),
                                             errors, requested))
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
            "Records the lag (pending, oldest pending age, last committed sequence) of each "
            "partition with a backlog as asset observations, at most every lag_refresh_s; "
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
