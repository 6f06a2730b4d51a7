"""The ONE backlog tick of an asset, one input or a set alike (:func:`backlog_tick`): read
every input (:func:`~cg_pipelines.dagster.reading.read_inputs`), mark failed the lost runs of
the partitions with a backlog (every input's lease of the partition probed,
:func:`fail_lost`), plan the runs with retries over the merged backlog (a run of partition
``p`` when ANY input has one there), then the observers (:data:`OBSERVERS`) over every input,
each keeping its part of the one cursor (:class:`~cg_pipelines.core.triggers.BacklogCursor`).

Every NATS call is bounded by the NATS resource's ``call_timeout_s``; a tick that cannot read
the inputs returns a skip reason naming why. A tick logs at most
:data:`~cg_pipelines.dagster.checks.LOG_LINES` per-partition lines, asks the Dagster instance
a constant number of times, and writes only check results that changed. The decisions are
pure functions of :mod:`cg_pipelines.core` (``triggers``, ``lag``, ``liveness``);
``bench/sensor_ticks.py`` measures ticks at 256 and 4096 partitions; ``docs/signals.md`` what
each observer writes and how often.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from dagster import (
    AssetCheckEvaluation,
    AssetObservation,
    DagsterInstance,
    MetadataValue,
    RunRequest,
)
from nats.aio.client import Client

from cg_pipelines.core.config import dlq_stream_name, work_queue_stream_name
from cg_pipelines.core.lag import LAG_STATES, lag_observations_due, lag_state
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
    plan_backlog_runs,
    summary_lines,
)
from cg_pipelines.dagster.checks import EXCLUDED_RUNS, LOG_LINES, partition_checks
from cg_pipelines.dagster.history import (
    CODE_TAG,
    Probe,
    Suspect,
    fail_lost_runs,
    partition_runs,
)
from cg_pipelines.dagster.reading import Reading, read_inputs
from cg_pipelines.dagster.reconcile import reconcile_evaluation
from cg_pipelines.dagster.resources import NatsResource, PartitionRunsResource
from cg_pipelines.dagster.spec import TICK_ERRORS, StreamAsset, asset_key_of
from cg_pipelines.dagster.warehouse import Warehouse
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.liveness import any_pinned, read_heartbeats, read_pins
from cg_pipelines.sinks.base import app_id_for

__all__ = ["OBSERVERS", "RECONCILE_TIMEOUT_S", "BacklogObserver", "BacklogTick", "TickView",
           "backlog_tick", "fail_lost", "leases_of", "nats_probe", "read_cursor",
           "with_warning"]

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


def nats_probe(nats_res: NatsResource, leases: Callable[[str], Sequence[Lease]]) -> Probe:
    """A probe reading, in one bounded NATS session, each suspect's heartbeat and whether any
    lease of its partition key (``leases(key)``) is pinned. NATS trouble answers nothing
    (every fact unknown: the runs stay alive)."""

    def probe(suspects: Sequence[Suspect]) -> Mapping[str, tuple[bool | None, bool | None]]:
        wanted = {s.run_id: list(leases(s.partition_key)) for s in suspects}

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
    """Mark failed the lost runs of partition ``keys``
    (:func:`~cg_pipelines.dagster.history.fail_lost_runs`, probing every input's lease of the
    partition), one warning each naming why."""
    probe = nats_probe(nats_res, lambda key: leases_of(spec, spec.partition_of(key)))
    for run_id, reason in fail_lost_runs(instance, keys, probe, grace_s=runs.lost_run_grace_s,
                                         now=now):
        log.warning(f"run {run_id} is lost: {reason}; marked failed")


# ------------------------------------------------------------------------------ the tick

@dataclass
class BacklogTick:
    """What one backlog tick decided: ``run_requests``; ``skip_reason`` when there are none;
    ``asset_events`` (lag and dead-letter observations, ``origin_reconciled`` evaluations);
    the next ``cursor``; ``check_evaluations`` (with an instance: the partitioned check
    results recorded run-less; without: all of them); ``check_requests``: the check-only runs."""

    run_requests: list[RunRequest] = field(default_factory=list)
    skip_reason: str | None = None
    asset_events: list[AssetObservation | AssetCheckEvaluation] = field(default_factory=list)
    cursor: str | None = None
    check_evaluations: list[AssetCheckEvaluation] = field(default_factory=list)
    check_requests: list[RunRequest] = field(default_factory=list)


@dataclass(frozen=True)
class TickView:
    """What every observer of one tick reads: the ``spec`` and its resources (``warehouse``
    None: no watermarks in lag observations, no reconcile), the ``instance`` (None: check
    results returned, not recorded), the ``log``, the tick's clock ``now`` (Unix seconds), its
    one ``reading``, the partitions whose runs used up their retries (``exhausted``), the
    retry ``policy``, the ``check_job``'s name and the ``previous`` cursor."""

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
    """One backlog tick (see the module docstring): runs for the served partitions whose
    merged backlog is at least ``min_pending`` or older than ``max_age_s``, run key
    ``<label>:<p>:<first pending sequence>`` (retries: a new key per attempt, after a backoff,
    up to ``retry_max_failures``); repeated requests dropped. With ``observe`` (the backlog
    sensor; the drain schedule does not), the :data:`OBSERVERS` and the cursor. ``instance``
    None: no run history (no retries, no lost-run detection). ``now``: Unix seconds.
    ``job_name``: the runs' job, set on their requests. Never raises for NATS or config
    trouble: the skip reason says it.
    """
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
    out = BacklogTick(run_requests=[
        RunRequest(run_key=r.run_key, partition_key=spec.partition_key(r.partition),
                   tags=tags, job_name=job_name) for r in send], cursor=cursor)
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


# ------------------------------------------------------------------------------ observers

def _committed(view: TickView, due: list[PartitionBacklog]) -> dict[tuple[str, int], int]:
    """``{(input name, partition): last committed sequence}`` of the partitions ``due``, when
    the warehouse can tell (one watermark read)."""
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
    """Lag observations of the partitions whose lag state changed, else every
    ``lag_refresh_s`` while they have a backlog, within ``lag_observations_per_day``
    (:func:`~cg_pipelines.core.lag.lag_observations_due`). Metadata: ``lag_state``,
    ``pending``, ``oldest_pending_age_s`` (seconds at ``now``), ``first_pending_seq``, with a
    backlog ``oldest_pending_timestamp``, and per input (``<input>/...`` on a set) its
    ``pending``, ``oldest_pending_age_s`` and ``last_committed_seq``; keeps ``observed``."""
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
    keys on a set): how many, the latest one's dead-letter and source sequences and reason
    (cut at 400 characters), the dead-letter stream; keeps the counts."""
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
    """The served partitions' partitioned checks
    (:func:`~cg_pipelines.dagster.checks.partition_checks`); a failure is logged and retried
    at the next tick."""
    try:
        out.check_evaluations, out.check_requests = partition_checks(
            view.spec, view.reading, view.exhausted, view.policy, view.instance, view.log,
            view.now, view.check_job)
    except Exception as e:  # the runs and the lag still matter; next tick
        view.log.warning(f"partitioned checks not recorded: {type(e).__name__}: {e}")
    return cursor


def observe_reconcile(view: TickView, cursor: BacklogCursor, out: BacklogTick
                      ) -> BacklogCursor:
    """Each input's ``origin_reconciled`` every ``reconcile_interval_s`` seconds (with a
    warehouse); keeps ``reconciled_at``. A failure is logged and retried at the next tick."""
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
