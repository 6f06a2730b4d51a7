"""What a backlog tick records besides its run requests, as a list of observers
(:data:`OBSERVERS`): lag, dead letters, the partitioned checks and the origin reconcile check.

:func:`cg_pipelines.dagster.sensors.backlog_tick` reads the group once and plans the runs, then
(with ``observe``) calls each observer in order with the same :class:`TickView`; an observer
adds its events to the tick's result and keeps its own part of the sensor's next cursor
(:class:`~cg_pipelines.core.triggers.BacklogCursor`). The decisions are pure functions in
:mod:`cg_pipelines.core` (:func:`~cg_pipelines.core.lag.lag_observations_due`,
:func:`~cg_pipelines.dagster.partition_checks.plan_partition_checks`); what each observer writes
and how often: ``docs/signals.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from dagster import (
    AssetCheckEvaluation,
    AssetObservation,
    DagsterInstance,
    MetadataValue,
    RunRequest,
)

from cg_pipelines.core.config import dlq_stream_name
from cg_pipelines.core.lag import LAG_STATES, lag_observations_due, lag_state
from cg_pipelines.core.triggers import BacklogCursor, PartitionBacklog, RetryPolicy, RetryWait
from cg_pipelines.dagster.partition_checks import GroupReading, partition_checks
from cg_pipelines.dagster.reconcile import reconcile_evaluation
from cg_pipelines.dagster.resources import NatsResource
from cg_pipelines.dagster.spec import ConsumerGroupAsset, asset_key_of
from cg_pipelines.dagster.warehouse import Warehouse
from cg_pipelines.jetstream.backlog import DeadLetterSummary
from cg_pipelines.sinks.base import app_id_for

__all__ = ["OBSERVERS", "RECONCILE_TIMEOUT_S", "BacklogObserver", "BacklogTick", "TickView",
           "dead_letter_observations", "lag_observations", "observe_checks",
           "observe_dead_letters", "observe_lag", "observe_reconcile"]

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
class TickView:
    """What every observer of one backlog tick reads.

    Attributes:
        spec, nats_res, warehouse: the group asset and its resources (``warehouse`` None: no
            watermark in lag observations, no reconcile check).
        instance: the Dagster instance (None: check results returned, not recorded).
        log: the sensor's logger.
        now: the tick's clock, Unix seconds.
        reading: the tick's one read of the group.
        exhausted: partitions whose runs used up their retries (the run plan's).
        policy: the runs' retry policy.
        check_job: the check-only job's name, or None.
        previous: the cursor the tick started from.
    """

    spec: ConsumerGroupAsset
    nats_res: NatsResource
    warehouse: Warehouse | None
    instance: DagsterInstance | None
    log: Any
    now: float
    reading: GroupReading
    exhausted: list[RetryWait]
    policy: RetryPolicy
    check_job: str | None
    previous: BacklogCursor


BacklogObserver = Callable[[TickView, BacklogCursor, BacklogTick], BacklogCursor]
"""``observer(view, cursor, out) -> cursor``: adds its events to ``out`` and returns ``cursor``
(the sensor's next cursor so far, frozen) with its own fields replaced."""


def lag_observations(spec: ConsumerGroupAsset, due: list[PartitionBacklog],
                     warehouse: Warehouse | None, log: Any, now: float
                     ) -> list[AssetObservation]:
    """Lag observations of the partitions ``due``
    (:func:`~cg_pipelines.core.lag.lag_observations_due`), with each one's last committed
    sequence when the warehouse can tell it (one watermark read for all of them). Metadata:
    ``lag_state`` (caught_up / behind / late), ``pending``, ``oldest_pending_age_s`` (seconds,
    at ``now``), ``first_pending_seq`` and, with a backlog, ``oldest_pending_timestamp``
    (the oldest pending message's time, Unix seconds: its age at any later time is that
    time's distance from it, true as long as the partition is stuck on that message)."""
    if not due:
        return []
    committed: dict[int, int] = {}
    if warehouse is not None:
        try:
            ids = {b.partition: app_id_for(spec.stream, spec.group, b.partition) for b in due}
            marks = warehouse.sink(spec.table_name).watermarks(ids.values())
            committed = {p: marks[a] for p, a in ids.items()}
        except Exception as e:  # the lag is still worth reporting
            log.warning(f"cannot read the committed watermarks of {spec.table_name}: {e}")
    events = []
    for b in due:
        state = LAG_STATES[lag_state(b, spec.lag_objective_s)]
        md: dict[str, Any] = {"lag_state": state, "pending": b.pending,
                              "oldest_pending_age_s": MetadataValue.float(round(b.age_s, 1)),
                              "first_pending_seq": b.first_seq or 0}
        if b.pending > 0:
            md["oldest_pending_timestamp"] = MetadataValue.timestamp(
                round(b.oldest_pending_time(now), 3))
        if b.partition in committed:
            md["last_committed_seq"] = committed[b.partition]
        events.append(AssetObservation(asset_key=asset_key_of(spec),
                                       partition=spec.partition_key(b.partition), metadata=md))
    return events


def dead_letter_observations(spec: ConsumerGroupAsset, changed: list[DeadLetterSummary]
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


def observe_lag(view: TickView, cursor: BacklogCursor, out: BacklogTick) -> BacklogCursor:
    """Lag observations of the partitions whose lag state changed, else at the slow cadence
    (``spec.lag_refresh_s``) within ``spec.lag_observations_per_day``; keeps the cursor's
    ``observed``."""
    spec = view.spec
    due, observed = lag_observations_due(
        view.reading.backlog, view.previous.observed, view.now, spec.lag_refresh_s,
        objective_s=spec.lag_objective_s, per_day=spec.lag_observations_per_day)
    out.asset_events.extend(lag_observations(spec, due, view.warehouse, view.log, view.now))
    return replace(cursor, observed=observed)


def observe_dead_letters(view: TickView, cursor: BacklogCursor, out: BacklogTick
                         ) -> BacklogCursor:
    """Dead-letter observations of the partitions whose count changed; keeps the counts."""
    out.asset_events.extend(dead_letter_observations(view.spec, view.reading.dead_changed))
    return replace(cursor, dead_letters=dict(view.reading.dead_counts))


def observe_checks(view: TickView, cursor: BacklogCursor, out: BacklogTick) -> BacklogCursor:
    """The served partitions' partitioned checks
    (:func:`~cg_pipelines.dagster.partition_checks.partition_checks`); a failure is logged
    and retried at the next tick (the runs and the lag still matter)."""
    try:
        out.check_evaluations, out.check_requests = partition_checks(
            view.spec, view.reading, view.exhausted, view.policy, view.instance, view.log,
            view.now, view.check_job)
    except Exception as e:  # the runs and the lag still matter; next tick
        view.log.warning(f"partitioned checks not recorded: {type(e).__name__}: {e}")
    return cursor


def observe_reconcile(view: TickView, cursor: BacklogCursor, out: BacklogTick
                      ) -> BacklogCursor:
    """The ``origin_reconciled`` evaluation every ``spec.reconcile_interval_s`` seconds (with
    a warehouse); keeps ``reconciled_at``. A failure is logged and retried at the next tick."""
    spec = view.spec
    if (spec.reconcile_interval_s is None or view.warehouse is None
            or view.now - view.previous.reconciled_at < spec.reconcile_interval_s):
        return cursor
    try:
        out.asset_events.append(reconcile_evaluation(spec, view.nats_res, view.warehouse,
                                                     timeout_s=RECONCILE_TIMEOUT_S))
    except Exception as e:  # reported, retried at the next tick
        view.log.warning(f"origin_reconciled not evaluated: {type(e).__name__}: {e}")
        return cursor
    return replace(cursor, reconciled_at=view.now)


OBSERVERS: tuple[BacklogObserver, ...] = (observe_lag, observe_dead_letters, observe_checks,
                                          observe_reconcile)
"""The observers a backlog tick calls, in this order (the order of its asset events)."""
