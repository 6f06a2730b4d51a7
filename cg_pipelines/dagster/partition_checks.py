"""The partitioned asset checks the backlog sensor evaluates, ``lag_within_objective`` and
``partition_runs_succeeding`` (:data:`BACKLOG_CHECK_NAMES`): their evaluation
(:func:`lag_evaluations`, :func:`runs_evaluations`), the planning of what a tick records
(:func:`plan_partition_checks`: first results run-less, at most :data:`CHECKS_PER_TICK`; later
changes by check-only runs, at most :data:`CHECK_RUNS_PER_TICK`, retried after
:data:`CHECK_RETRY_S`), a tick's step that records them (:func:`partition_checks`), one check
of one partition executed by hand (:func:`evaluate_check`), and the bounded read of a group
both the tick and a check by hand start from (:func:`read_group`).

The tick itself and the sensor and schedule builders are :mod:`cg_pipelines.dagster.sensors`;
the checks' definitions are :mod:`cg_pipelines.dagster.checks`.
"""


import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from dagster import (
    AssetCheckEvaluation,
    AssetCheckKey,
    AssetCheckSeverity,
    DagsterInstance,
    RunRequest,
)

from cg_pipelines.core.assignment import assignment
from cg_pipelines.core.config import dlq_stream_name
from cg_pipelines.core.errors import ConfigError
from cg_pipelines.core.triggers import (
    PartitionBacklog,
    RetryPolicy,
    RetryWait,
    plan_backlog_runs,
    served_partitions,
    summary_lines,
)
from cg_pipelines.dagster.history import (
    CHECK_MODE,
    MODE_TAG,
    CheckState,
    check_states,
    finished_runs,
    partition_runs,
    partition_runs_of,
    record_first_checks,
)
from cg_pipelines.dagster.resources import NatsResource, PartitionRunsResource
from cg_pipelines.dagster.spec import ConsumerGroupAsset, asset_key_of, check_partitions
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.backlog import (
    DeadLetterSummary,
    dead_letter_counts,
    latest_dead_letters,
    partition_backlog,
)

__all__ = ["BACKLOG_CHECK_NAMES", "CHECKS_PER_TICK", "CHECK_RETRY_S", "CHECK_RUNS_PER_TICK",
           "EXCLUDED_RUNS", "LAG_CHECK", "LOG_LINES", "RUNS_CHECK", "GroupReading",
           "PartitionChecks", "evaluate_check", "lag_evaluations", "partition_checks",
           "plan_partition_checks", "read_group", "runs_evaluations"]

LOG_LINES = 20
"""Per-partition log lines a tick writes at most (then one "... and <k> more"); the backlog
tick (:mod:`cg_pipelines.dagster.sensors`) and its partitioned checks alike."""


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
               only: Iterable[int] | None = None, any_owner: bool = False) -> GroupReading:
    """One bounded NATS session: the group's config (partition count checked), then the
    backlog of the partitions this deployment serves (and only those; with ``only``, of
    those of ``only`` it serves; with ``any_owner`` too, of all of ``only`` whoever owns
    them); with
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
            served = sorted(wanted) if any_owner else [p for p in served if p in wanted]
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
                          now: float, partition_runs: set[str] | None = None
                          ) -> PartitionChecks:
    """Which results to write, from the wanted outcomes ``{(check, partition key): passed}``
    and what Dagster shows (``states``, :func:`~cg_pipelines.dagster.history.check_states`).
    ``ended``: the run ids of those PLANNED states whose run has ended; ``partition_runs``:
    those of them that were partition runs (a drain or rebuild run planned
    ``lag_within_objective`` and failed before it: Dagster shows "execution failed"), not
    check-only runs; ``now``: Unix seconds (the retry's time bucket). Pure; raises nothing.

    - no execution recorded for (check, partition): a first result, recorded run-less (Dagster
      allows one run-less result per check and partition);
    - the recorded outcome differs from the wanted one, or it fails and a newer
      materialization made it stale (a failure stays visible against the latest
      materialization): the partition's checks are recorded again by a check-only run (its
      run key: the partition and the newest storage id of its checks, so one run per recorded
      state: Dagster never runs a sensor's run key twice);
    - planned only (a run is in progress): nothing until it ends; if a check-only run ended
      without a result, another one at most every :data:`CHECK_RETRY_S` seconds; if a
      partition run (failed) did, the same only while the wanted outcome is a failure (a late
      partition shows failing; a fresh one waits for its next drain run, which evaluates it);
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
            if st.run_id in ended and (ok is False or st.run_id not in (partition_runs or ())):
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


def partition_checks(spec: ConsumerGroupAsset, reading: GroupReading, exhausted: list[RetryWait],
                     policy: RetryPolicy, instance: DagsterInstance | None, log: Any,
                     now: float, check_job: str | None
                     ) -> tuple[list[AssetCheckEvaluation], list[RunRequest]]:
    """The served partitions' partitioned checks: without an instance, every evaluation
    (nothing recorded, no run); with one, :func:`plan_partition_checks` from one check-state
    read (plus one run-records query when a check run's result is still planned): the first
    results recorded run-less (returned), and one check-only run requested (``check_job``)
    per partition whose results changed. Outcomes are compared first (booleans): only the
    evaluations to record are built. Returns (evaluations recorded, check run requests).

    The partitioned-check step of :func:`cg_pipelines.dagster.sensors.backlog_tick` (with
    ``observe``), which logs whatever this raises and goes on."""
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
        ended = finished_runs(instance, planned)
        todo = plan_partition_checks(spec.group, want, states, ended, now,
                                     partition_runs_of(instance, ended))
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
                                   f"({why})" for k, why in todo.rerun.items()], LOG_LINES):
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
                   instance: DagsterInstance, now: float | None = None, *,
                   any_owner: bool = False) -> AssetCheckEvaluation | None:
    """Check ``name`` (:data:`LAG_CHECK` or :data:`RUNS_CHECK`) of one partition, computed as
    the backlog sensor computes it and nothing else (for a check executed by hand, or by the
    partition's own drain run): the group's config and that partition's backlog (one NATS
    session); for :data:`RUNS_CHECK` also its run history
    (:func:`~cg_pipelines.dagster.history.partition_runs`). Nothing is written, no run is
    marked failed, no other partition is read. ``now``: Unix seconds. ``any_owner``: evaluate
    it whoever owns the partition now (a drain run whose partition moved to another member
    while it ran still tells its lag).

    Returns:
        The evaluation, or ``None`` when this deployment does not serve the partition (and not
        ``any_owner``), or :data:`LAG_CHECK` without a lag objective.

    Raises:
        ConfigError: ``partition_key`` is not one of the asset's, or ``name`` is not one of
            :data:`BACKLOG_CHECK_NAMES`.
        GroupNotFoundError, JetStreamError, TimeoutError, OSError: reading the group fails
            (:data:`~cg_pipelines.dagster.spec.TICK_ERRORS`).
    """
    if name not in BACKLOG_CHECK_NAMES:
        raise ConfigError("check", f"{name!r} is not one of {', '.join(BACKLOG_CHECK_NAMES)}")
    p = spec.partition_of(partition_key)
    reading = read_group(spec, nats_res, runs, only=[p], any_owner=any_owner)
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
