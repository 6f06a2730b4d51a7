"""Every asset check of a spec's asset, partitioned like it (``AssetCheckSpec(partitions_def=
...)``, Dagster 1.13: one result per partition). A check about an input is declared once per
input (:meth:`~cg_pipelines.dagster.spec.StreamAsset.per_input`: ``<check>__<input>`` on a
set, the plain name on a group asset).

Evaluated by each partition run (:func:`run_check_specs`, results :func:`run_check_results`,
:func:`failed_run_checks`):

- ``backlog_drained``: the run drained the backlog seen at its start (a failed run did not;
  its description starts with the cause);
- ``no_unexplained_fence_conflicts``: no commit refused by the watermark fence;
- ``no_new_dead_letters`` (per input): the run dead-lettered nothing (WARN).

Evaluated by the backlog sensor, and by hand (:func:`build_checks`):

- ``lag_within_objective`` (per input, with ``lag_objective_s``): the partition's oldest pending
  message is at most that old; each drain or rebuild run evaluates it too after its
  materialization (it is in those jobs' selection);
- ``partition_runs_succeeding`` (ERROR): the partition has not failed
  ``retry_max_failures`` runs in a row (then it is no longer retried until a run succeeds or
  new code is loaded).

A tick records only what changed (:func:`plan_partition_checks`): a first result run-less
(Dagster allows one per check and partition), a later change by a check-only run of the
partition (the ``<asset>_checks`` job). ``origin_reconciled`` (per input) is
:mod:`cg_pipelines.dagster.reconcile`'s.
"""


import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dagster import (
    AssetCheckEvaluation,
    AssetCheckExecutionContext,
    AssetCheckKey,
    AssetCheckResult,
    AssetChecksDefinition,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetMaterialization,
    AssetRecordsFilter,
    DagsterInstance,
    Failure,
    RunRequest,
    StaticPartitionsDefinition,
    asset_check,
)

from cg_pipelines.core.errors import ConfigError, exception_chain, one_line
from cg_pipelines.core.triggers import (
    PartitionBacklog,
    RetryPolicy,
    RetryWait,
    plan_backlog_runs,
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
from cg_pipelines.dagster.reading import Reading, read_inputs
from cg_pipelines.dagster.resources import NatsResource, PartitionRunsResource
from cg_pipelines.dagster.spec import (
    TICK_ERRORS,
    JoinInput,
    StreamAsset,
    asset_key_of,
    partitioned_checks_preview,
)
from cg_pipelines.sinks.base import FenceConflictError

__all__ = ["CHECKS_PER_TICK", "CHECK_RETRY_S", "CHECK_RUNS_PER_TICK", "DEAD_LETTER_CHECK",
           "DRAINED_CHECK", "EXCLUDED_RUNS", "FENCE_CHECK", "LAG_CHECK", "LOG_LINES",
           "RUNS_CHECK", "PartitionChecks", "build_checks", "evaluate_check",
           "failed_run_checks", "lag_evaluations", "partition_checks", "plan_partition_checks",
           "run_check_results", "run_check_specs", "runs_evaluations"]

DRAINED_CHECK = "backlog_drained"
FENCE_CHECK = "no_unexplained_fence_conflicts"
DEAD_LETTER_CHECK = "no_new_dead_letters"
LAG_CHECK = "lag_within_objective"
RUNS_CHECK = "partition_runs_succeeding"

LOG_LINES = 20
"""Per-partition log lines a tick writes at most (then one "... and <k> more")."""

CHECKS_PER_TICK = 400
"""First (run-less) results a tick records at most (failing first; ~15 ms each on SQLite);
the others are recorded by the next ticks."""

CHECK_RUNS_PER_TICK = 16
"""Check-only runs (one per partition whose results changed) a tick requests at most."""

CHECK_RETRY_S = 300.0
"""Seconds before a partition whose check-only run ended without its results gets another."""

EXCLUDED_RUNS = (MODE_TAG, ("rebuild", CHECK_MODE))
"""Runs that are not partition runs for the run history: rebuilds and check-only runs."""


# ------------------------------------------------------------------------- run checks

def run_check_specs(spec: StreamAsset, parts: StaticPartitionsDefinition
                    ) -> list[AssetCheckSpec]:
    """The checks each partition run evaluates (declared on the asset)."""
    key = asset_key_of(spec)
    return [
        AssetCheckSpec(DRAINED_CHECK, asset=key, partitions_def=parts,
                       description="The run drained the backlog of every input seen at its "
                       "start (a failed run did not; its description starts with the cause)."),
        AssetCheckSpec(FENCE_CHECK, asset=key, partitions_def=parts,
                       description="No commit of the run was refused by the watermark fence "
                       "(another holder took the partition over mid-run); a run that failed "
                       "for another reason passes."),
        *(AssetCheckSpec(spec.per_input(DEAD_LETTER_CHECK, i), asset=key, partitions_def=parts,
                         description=f"The run dead-lettered no message of {i.stream}."
                         f"{i.group} (a warning otherwise; cg dlq ls).") for i in spec.inputs)]


def run_check_results(spec: StreamAsset, status: str, detail: str, fence_conflicts: int,
                      dead: Mapping[str, int]) -> list[AssetCheckResult]:
    """A finished run's results: ``status`` (``drained``/``empty``/``rebuilt`` pass),
    ``fence_conflicts``, ``dead`` = dead letters by input name."""
    out = [
        AssetCheckResult(check_name=DRAINED_CHECK, passed=status in ("drained", "empty",
                                                                       "rebuilt"),
                         severity=AssetCheckSeverity.WARN,
                         description=f"{status}: {detail}" if detail else status,
                         metadata={"status": status, "detail": detail}),
        AssetCheckResult(check_name=FENCE_CHECK, passed=fence_conflicts == 0,
                         severity=AssetCheckSeverity.WARN,
                         description=f"{fence_conflicts} commit(s) refused by the fence: "
                         f"{detail}" if fence_conflicts else "no commit refused",
                         metadata={"fence_conflicts": fence_conflicts, "detail": detail})]
    for i in spec.inputs:
        n = dead.get(i.name, 0)
        out.append(AssetCheckResult(
            check_name=spec.per_input(DEAD_LETTER_CHECK, i), passed=n == 0,
            severity=AssetCheckSeverity.WARN,
            description=f"{n:,} message(s) dead-lettered (cg dlq ls)" if n else
            "none dead-lettered", metadata={"dead_lettered": n}))
    return out


def failed_run_checks(spec: StreamAsset, e: BaseException) -> list[AssetCheckResult]:
    """The results of a run that raised ``e``: ``backlog_drained`` fails (the cause);
    ``no_unexplained_fence_conflicts`` fails only for a fence conflict (a
    ``FenceConflictError`` in the chain, or a ``Failure`` whose metadata counts
    ``fence_conflicts``); ``no_new_dead_letters`` when a ``Failure``'s metadata counts the
    input's dead letters (a halted or held run), else left to Dagster (execution failed)."""
    md = dict(getattr(e, "metadata", None) or {})

    def count(name: str) -> int | None:
        v = md.get(name)
        v = getattr(v, "value", v)
        return int(v) if isinstance(v, int) else None

    cause = one_line(getattr(e, "description", None) or str(e)) or type(e).__name__
    fences = count("fence_conflicts") or 0
    fenced = fences > 0 or any(isinstance(x, FenceConflictError) for x in exception_chain(e))
    out = [
        AssetCheckResult(check_name=DRAINED_CHECK, passed=False, severity=AssetCheckSeverity.WARN,
                         description=cause, metadata={"error_type": type(e).__name__}),
        AssetCheckResult(check_name=FENCE_CHECK, passed=not fenced,
                         severity=AssetCheckSeverity.WARN,
                         description=f"fence conflict: {cause}" if fenced else
                         "the run failed, not for a fence conflict",
                         metadata={"fence_conflicts": fences, "run_failed": True})]
    for i in spec.inputs:
        dead = count(f"{spec.md_prefix(i)}dead_lettered")
        if dead is not None:
            out.append(AssetCheckResult(
                check_name=spec.per_input(DEAD_LETTER_CHECK, i), passed=dead == 0,
                severity=AssetCheckSeverity.WARN, metadata={"dead_lettered": dead},
                description=f"{dead} message(s) dead-lettered" if dead else "none dead-lettered"))
    return out


# ------------------------------------------------------------- the sensor's checks

def sensor_check_names(spec: StreamAsset) -> list[str]:
    """The partitioned checks the backlog sensor evaluates (lag per input, then runs)."""
    lag = [spec.per_input(LAG_CHECK, i) for i in spec.inputs] \
        if spec.lag_objective_s is not None else []
    return [*lag, RUNS_CHECK]


def lag_evaluations(spec: StreamAsset, inp: JoinInput, backlog: list[PartitionBacklog]
                    ) -> list[AssetCheckEvaluation]:
    """Input ``inp``'s ``lag_within_objective`` of each partition in ``backlog`` (none without
    an objective): fails while its oldest pending message is older than ``lag_objective_s``."""
    objective = spec.lag_objective_s
    if objective is None:
        return []
    out = []
    for b in backlog:
        late = b.pending > 0 and b.age_s > objective
        out.append(AssetCheckEvaluation(
            asset_key=asset_key_of(spec), check_name=spec.per_input(LAG_CHECK, inp),
            passed=not late, partition=spec.partition_key(b.partition),
            severity=AssetCheckSeverity.WARN,
            description=(f"oldest pending message {b.age_s:.0f} s old, more than the "
                         f"{objective:g} s objective ({b.pending} pending)") if late else
            f"oldest pending message under {objective:g} s old ({b.pending} pending)",
            metadata={"objective_s": objective, "pending": b.pending,
                      "oldest_pending_age_s": round(b.age_s, 1) if b.pending else 0.0}))
    return out


def runs_evaluations(spec: StreamAsset, partitions: list[int], exhausted: list[RetryWait],
                     policy: RetryPolicy) -> list[AssetCheckEvaluation]:
    """``partition_runs_succeeding`` of each of ``partitions``: fails while the partition's
    runs used up their retries (``exhausted``), naming its failures and last error."""
    gone = {w.partition: w for w in exhausted}
    out = []
    for p in partitions:
        key, w = spec.partition_key(p), gone.get(p)
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
    key)`` results to record run-less; ``rerun``, ``{partition key: why}`` of the partitions
    whose checks a check-only run records again; ``run_keys``, each one's run key."""

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
    those of them that were partition runs (not check-only runs); ``now``: Unix seconds (the
    retry's time bucket). Pure; raises nothing.

    - nothing recorded for (check, partition): a first result, recorded run-less;
    - the recorded outcome differs from the wanted one, or it fails and a newer
      materialization made it stale: a check-only run records the partition's checks again
      (run key: the partition and the newest storage id of its checks: one run per state);
    - planned only: nothing until its run ends; a check-only run that ended without a result
      is retried at most every :data:`CHECK_RETRY_S` seconds, a failed partition run's only
      while the wanted outcome is a failure;
    - anything else: nothing.

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


def _evaluations(spec: StreamAsset, reading: Reading, exhausted: list[RetryWait],
                 policy: RetryPolicy, keys: set[tuple[str, str]] | None
                 ) -> list[AssetCheckEvaluation]:
    """The served partitions' sensor checks (only ``keys`` when given)."""
    def kept(name: str, p: int) -> bool:
        return keys is None or (name, spec.partition_key(p)) in keys

    out = []
    for i in spec.inputs:
        name = spec.per_input(LAG_CHECK, i)
        out += lag_evaluations(spec, i, [b for b in reading.by_input[i.name]
                                         if kept(name, b.partition)])
    return out + runs_evaluations(spec, [p for p in sorted(reading.served)
                                         if kept(RUNS_CHECK, p)], exhausted, policy)


def partition_checks(spec: StreamAsset, reading: Reading, exhausted: list[RetryWait],
                     policy: RetryPolicy, instance: DagsterInstance | None, log: Any,
                     now: float, check_job: str | None
                     ) -> tuple[list[AssetCheckEvaluation], list[RunRequest]]:
    """The served partitions' sensor checks: without an instance, every evaluation (nothing
    recorded); with one, :func:`plan_partition_checks` from one check-state read: the first
    results recorded run-less (returned), one check-only run of ``check_job`` requested per
    partition whose results changed. Returns (evaluations, check run requests)."""
    if instance is None or not reading.served:
        return _evaluations(spec, reading, exhausted, policy, None), []
    given_up = {w.partition for w in exhausted}
    want: dict[tuple[str, str], bool] = {}
    if spec.lag_objective_s is not None:
        for i in spec.inputs:
            for b in reading.by_input[i.name]:
                want[(spec.per_input(LAG_CHECK, i), spec.partition_key(b.partition))] = not (
                    b.pending > 0 and b.age_s > spec.lag_objective_s)
    for p in sorted(reading.served):
        want[(RUNS_CHECK, spec.partition_key(p))] = p not in given_up
    states = check_states(instance, asset_key_of(spec), {n for n, _ in want})
    planned = {st.run_id for k, st in states.items() if k in want and st.passed is None}
    ended = finished_runs(instance, planned)
    todo = plan_partition_checks(spec.label, want, states, ended, now,
                                 partition_runs_of(instance, ended))
    out = _evaluations(spec, reading, exhausted, policy, set(todo.first))
    out = record_first_checks(instance, out, log) if out else []
    if check_job is None:
        return out, []
    for line in summary_lines([f"partition {k}: checks recorded again by a check run ({why})"
                               for k, why in todo.rerun.items()], LOG_LINES):
        log.info(line)
    # The checks only (no asset: nothing materialized), as the Checks tab's "Execute".
    selected = [AssetCheckKey(asset_key_of(spec), n) for n in sensor_check_names(spec)]
    return out, [RunRequest(run_key=todo.run_keys[k], partition_key=k, job_name=check_job,
                            asset_selection=[], asset_check_keys=selected,
                            tags={MODE_TAG: CHECK_MODE}) for k in todo.rerun]


def evaluate_check(spec: StreamAsset, name: str, partition_key: str, nats_res: NatsResource,
                   runs: PartitionRunsResource, instance: DagsterInstance,
                   now: float | None = None, *, any_owner: bool = False
                   ) -> AssetCheckEvaluation | None:
    """Sensor check ``name`` of one partition, computed as the backlog sensor does and nothing
    else (a check executed by hand, or by the partition's own drain run): one NATS session
    reading that partition; for ``partition_runs_succeeding`` also its run history. Nothing
    is written. ``now``: Unix seconds. ``any_owner``: whoever owns the partition now.

    Returns:
        The evaluation, or ``None`` when this deployment does not serve the partition (and
        not ``any_owner``), or a lag check without a lag objective.

    Raises:
        ConfigError: ``partition_key`` or ``name`` is not the asset's.
        GroupNotFoundError, JetStreamError, TimeoutError, OSError: reading fails.
    """
    if name not in sensor_check_names(spec):
        raise ConfigError("check", f"{name!r} is not one of "
                          f"{', '.join(sensor_check_names(spec))}")
    p = spec.partition_of(partition_key)
    reading = read_inputs(spec, nats_res, runs, only=[p], any_owner=any_owner)
    if p not in reading.served:
        return None
    for i in spec.inputs:
        if name == spec.per_input(LAG_CHECK, i):
            found = lag_evaluations(spec, i, reading.by_input[i.name])
            return found[0] if found else None
    policy, code = runs.retry_policy(), spec.current_code_version()
    pending = {b.partition: partition_key for b in reading.backlog if b.pending > 0}
    history = partition_runs(instance, pending, code, policy,
                             exclude_tag=EXCLUDED_RUNS) if pending else {}
    plan = plan_backlog_runs(spec.label, reading.backlog, history, policy,
                             time.time() if now is None else now, code=code,
                             min_pending=runs.min_pending, max_age_s=runs.max_age_s,
                             partitions=[p])
    return runs_evaluations(spec, [p], plan.exhausted, policy)[0]


def _this_runs_materialization(context: AssetCheckExecutionContext, spec: StreamAsset,
                               key: str) -> AssetMaterialization | None:
    """The partition's latest materialization when this run made it (the check runs in the
    partition's drain or rebuild run), else ``None`` (executed alone)."""
    records = context.instance.fetch_materializations(
        AssetRecordsFilter(asset_key=asset_key_of(spec), asset_partitions=[key]), limit=1).records
    if records and records[0].run_id == context.run.run_id:
        mat: AssetMaterialization | None = records[0].asset_materialization
        return mat
    return None


def _evaluate(context: AssetCheckExecutionContext, spec: StreamAsset, name: str
              ) -> AssetCheckResult:
    """Check ``name`` on the run's partition (:func:`evaluate_check`). In the partition's own
    drain or rebuild run a lag check never fails the run: it is evaluated whoever owns the
    partition now, and when the inputs cannot be read it is judged from the run's outcome.

    Raises:
        Failure: alone (by hand, a check-only run): the inputs cannot be read, or the
            partition is not served here.
    """
    res, key = context.resources, context.partition_key
    mat = _this_runs_materialization(context, spec, key) if name != RUNS_CHECK else None
    try:
        ev = evaluate_check(spec, name, key, getattr(res, spec.nats_resource_key),
                            getattr(res, spec.runs_resource_key), context.instance,
                            any_owner=mat is not None)
    except TICK_ERRORS as e:
        if mat is None:
            raise Failure(f"cannot evaluate {name} on {key}: {spec.title}: {e}") from e
        status = getattr(mat.metadata.get("status"), "value", None)
        return AssetCheckResult(
            passed=status in ("drained", "empty", "rebuilt"), severity=AssetCheckSeverity.WARN,
            description=f"backlog not readable after the run ({type(e).__name__}: "
            f"{one_line(str(e))[:200]}); judged from the run, which ended "
            f"{status or 'unknown'}; the backlog sensor evaluates it again at its next tick",
            metadata={"judged_from": "the run's outcome"})
    if ev is None:
        raise Failure(f"cannot evaluate {name} on {key}: the partition is not served by this "
                      "deployment")
    return AssetCheckResult(passed=ev.passed, severity=ev.severity,
                            description=ev.description, metadata=dict(ev.metadata))


def build_checks(spec: StreamAsset) -> list[AssetChecksDefinition]:
    """The partitioned sensor checks of ``spec``'s asset: ``lag_within_objective`` per input
    (with ``lag_objective_s``) and ``partition_runs_succeeding``."""
    keys = {spec.nats_resource_key, spec.runs_resource_key}
    parts = StaticPartitionsDefinition(spec.partition_keys())

    def make(name: str, description: str) -> AssetChecksDefinition:
        @asset_check(asset=asset_key_of(spec), name=name, required_resource_keys=keys,
                     partitions_def=parts, description=description)
        def _check(context: AssetCheckExecutionContext) -> AssetCheckResult:
            return _evaluate(context, spec, name)

        return _check

    with partitioned_checks_preview():
        lag = [make(spec.per_input(LAG_CHECK, i), f"The partition's freshness on {i.stream}."
                    f"{i.group}: its oldest pending message is at most "
                    f"{spec.lag_objective_s:g} s old (evaluated by each drain run after its "
                    "materialization, and by the backlog sensor).") for i in spec.inputs
               ] if spec.lag_objective_s is not None else []
        return [*lag, make(RUNS_CHECK, "The partition has not failed its runs so often in a "
                           "row that the backlog sensor stopped retrying it (evaluated by the "
                           "backlog sensor).")]
