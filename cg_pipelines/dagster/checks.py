"""Every asset check of an asset, partitioned like it; a check about an input once per input
(:meth:`~cg_pipelines.dagster.spec.StreamAsset.per_input`). Each run's
(:func:`run_check_specs`): ``backlog_drained``, ``no_unexplained_fence_conflicts``,
``no_new_dead_letters``. The backlog sensor's, executable by hand (:func:`build_checks`):
``lag_within_objective`` (each drain run evaluates it too) and ``partition_runs_succeeding``; a
tick records only what changed (:func:`plan_partition_checks`). ``origin_reconciled``
(:func:`build_reconcile_check`, Delta only): every origin message the input's filters match was
accounted for by a commit (the coverage it records; a set's commit one entry per input) or is
still queued, checked incrementally from a cursor beside the table
(``_cg_reconcile/<stream>.<group>.json``); a gap fails (ERROR, naming the partitions to
rebuild), a sourcing stall warns (docs/reconcile.md)."""

import asyncio
import concurrent.futures
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
    MetadataValue,
    RunRequest,
    StaticPartitionsDefinition,
    asset_check,
)
from nats.aio.client import Client

from cg_pipelines.core.coverage import ReconcileCursor
from cg_pipelines.core.errors import ConfigError, UsageError, exception_chain, one_line
from cg_pipelines.core.reconcile import ReconcileReport
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
from cg_pipelines.dagster.warehouse import Warehouse
from cg_pipelines.engine.coverage_log import DeltaLogCoverage
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.reconcile import (
    DEFAULT_MAX_VERSIONS,
    reconcile_group,
    sink_table_seqs,
)
from cg_pipelines.sinks.base import FenceConflictError
from cg_pipelines.sinks.storage import table_filesystem

__all__ = ["CHECKS_PER_TICK", "CHECK_RETRY_S", "CHECK_RUNS_PER_TICK", "DEAD_LETTER_CHECK",
           "DRAINED_CHECK", "EXCLUDED_RUNS", "FENCE_CHECK", "LAG_CHECK", "LOG_LINES",
           "RUNS_CHECK", "PartitionChecks", "build_checks", "evaluate_check",
           "failed_run_checks", "lag_evaluations", "partition_checks", "plan_partition_checks",
           "run_check_results", "run_check_specs", "runs_evaluations",
           "RECONCILE_CHECK", "build_reconcile_check", "reconcile_evaluation",
           "reconcile_group_report"]

DRAINED_CHECK = "backlog_drained"
FENCE_CHECK = "no_unexplained_fence_conflicts"
DEAD_LETTER_CHECK = "no_new_dead_letters"
LAG_CHECK = "lag_within_objective"
RUNS_CHECK = "partition_runs_succeeding"

LOG_LINES = 20
"""Per-partition log lines a tick writes at most (then one "... and <k> more")."""
CHECKS_PER_TICK = 400
"""First (run-less) results a tick records at most (failing first; ~15 ms each on SQLite)."""

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
    return [
        AssetCheckResult(check_name=DRAINED_CHECK, passed=status in ("drained", "empty",
                                                                       "rebuilt"),
                         severity=AssetCheckSeverity.WARN,
                         description=f"{status}: {detail}" if detail else status,
                         metadata={"status": status, "detail": detail}),
        AssetCheckResult(check_name=FENCE_CHECK, passed=fence_conflicts == 0,
                         severity=AssetCheckSeverity.WARN,
                         description=f"{fence_conflicts} commit(s) refused by the fence: "
                         f"{detail}" if fence_conflicts else "no commit refused",
                         metadata={"fence_conflicts": fence_conflicts, "detail": detail}),
        *_dead_letter_results(spec, dead)]


def _dead_letter_results(spec: StreamAsset, dead: Mapping[str, int | None]
                         ) -> list[AssetCheckResult]:
    """``no_new_dead_letters`` of each input whose count ``dead`` knows (by input name)."""
    return [AssetCheckResult(check_name=spec.per_input(DEAD_LETTER_CHECK, i), passed=n == 0,
                             severity=AssetCheckSeverity.WARN, metadata={"dead_lettered": n},
                             description=f"{n:,} message(s) dead-lettered (cg dlq ls)" if n
                             else "none dead-lettered")
            for i in spec.inputs if (n := dead.get(i.name)) is not None]


def failed_run_checks(spec: StreamAsset, e: BaseException) -> list[AssetCheckResult]:
    """The results of a run that raised ``e``: ``backlog_drained`` fails (the cause); the fence
    check fails only for a fence conflict (in the chain, or counted in a ``Failure``'s
    metadata); dead letters only where the metadata counts them (else Dagster's "failed")."""
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
    return out + _dead_letter_results(
        spec, {i.name: count(f"{spec.md_prefix(i)}dead_lettered") for i in spec.inputs})


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
    and what Dagster shows (``states``); ``ended``: the run ids of PLANNED states whose run
    ended, ``partition_runs`` those that were partition runs; ``now``: Unix seconds. Pure.
    Nothing recorded: a first result, run-less. A different outcome, or a failure a newer
    materialization made stale: a check-only run (run key: the partition and its checks'
    newest storage id). Planned only: nothing until its run ends, then a check-only run that
    left no result is retried every :data:`CHECK_RETRY_S` s, a failed partition run's only
    while the wanted outcome fails. At most :data:`CHECKS_PER_TICK` first results and
    :data:`CHECK_RUNS_PER_TICK` partitions, failing first.
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
    """The served partitions' sensor checks: (first results recorded run-less, check-only runs
    of ``check_job`` for partitions whose results changed) per :func:`plan_partition_checks`;
    without an instance every evaluation, nothing recorded."""
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
    """Sensor check ``name`` of one partition as the backlog sensor computes it (executed by
    hand, or by the partition's drain run): one NATS session, and for
    ``partition_runs_succeeding`` its run history; nothing written. ``now``: Unix seconds.
    ``any_owner``: whoever owns the partition now.

    Returns:
        The evaluation, or ``None`` when the partition is not served here (and not
        ``any_owner``).

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
    """The partition's latest materialization when this run made it, else ``None``."""
    records = context.instance.fetch_materializations(
        AssetRecordsFilter(asset_key=asset_key_of(spec), asset_partitions=[key]), limit=1).records
    if records and records[0].run_id == context.run.run_id:
        mat: AssetMaterialization | None = records[0].asset_materialization
        return mat
    return None


def _evaluate(context: AssetCheckExecutionContext, spec: StreamAsset, name: str
              ) -> AssetCheckResult:
    """Check ``name`` on the run's partition (:func:`evaluate_check`); in the partition's own
    drain run a lag check never fails the run (unreadable inputs: judged from the run).

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


RECONCILE_CHECK = "origin_reconciled"
"""The check's name."""

DEFAULT_CHECK_MESSAGES = 200_000
"""Origin messages one chunk of an evaluation reads at most."""

def _outside_loop(fn: Any, *args: Any, **kw: Any) -> Any:
    """``fn(*args, **kw)``, in a worker thread when this thread runs an event loop (the NATS
    session uses ``asyncio.run``, which refuses to run inside one)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return fn(*args, **kw)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args, **kw).result()


def table_coverage(spec: StreamAsset, warehouse: Warehouse, inp: JoinInput
                   ) -> DeltaLogCoverage:
    """The coverage reader (and cursor store) of input ``inp`` on ``spec``'s table.

    Raises:
        UsageError: the warehouse's table URI has no filesystem this library reads.
    """
    uri = warehouse.table_uri(spec.table_name)
    fs = table_filesystem(uri, warehouse.storage_options() or {})
    if fs is None:
        raise UsageError(f"cannot read the Delta log of {uri.split('?')[0]!r}: only local "
                         "paths and s3:// tables are supported")
    return DeltaLogCoverage(fs, inp.stream, inp.group)


def reconcile_group_report(
    spec: StreamAsset, nats: NatsResource, warehouse: Warehouse, *, inp: JoinInput | None = None,
    max_messages: int = DEFAULT_CHECK_MESSAGES, max_versions: int = DEFAULT_MAX_VERSIONS,
    seq_column: str | None = None, from_seq: int | None = None, timeout_s: float = 50.0,
    restart: bool = False,
) -> ReconcileReport:
    """Go on checking input ``inp`` (default the first) from the stored cursor, chunk after
    chunk while half of ``timeout_s`` lasts, all within ``timeout_s`` seconds (under
    Dagster's 60 s tick limit), and store the cursor.

    Args:
        seq_column: also count the table's rows' origin sequences in this column as covered
            (an append table written before coverage was recorded); ``None``: not read.
        from_seq: start a new cursor at this origin sequence (default: the stored cursor, or
            the origin's first message).
        restart: forget the stored cursor first.

    Raises:
        TimeoutError, NatsConnectError, JetStreamError, GroupNotFoundError, ConfigError,
        CoverageLogError, UsageError: see :func:`cg_pipelines.jetstream.reconcile.
        reconcile_group`.
    """
    inp = inp or spec.inputs[0]
    log = table_coverage(spec, warehouse, inp)
    seqs = (sink_table_seqs(warehouse.sink(spec.table_name), seq_column)
            if seq_column is not None else None)
    cursor = None if restart or from_seq is not None else log.load_cursor()
    if cursor is None:
        cursor = ReconcileCursor(origin_through=max(0, (from_seq or 1) - 1))

    async def go(nc: Client) -> ReconcileReport:
        js = nc.jetstream(timeout=nats.call_timeout_s)
        api = JetStreamAPI(nc, timeout=nats.call_timeout_s)
        t0 = time.monotonic()
        try:
            while True:
                rep = await reconcile_group(js, api, inp.stream, inp.group, coverage=log,
                                            cursor=cursor, table_seqs=seqs,
                                            max_messages=max_messages,
                                            max_versions=max_versions)
                if (not rep.partial or rep.stall is not None
                        or time.monotonic() - t0 > timeout_s / 2):
                    return rep
        finally:
            await api.close()

    rep: ReconcileReport = _outside_loop(nats.run, go, timeout_s=timeout_s)
    log.save_cursor(cursor)
    return rep


def _passed(rep: ReconcileReport) -> bool:
    """No gap and no stall (a stall fails with severity WARN)."""
    return rep.ok and rep.stall is None


def _description(spec: StreamAsset, rep: ReconcileReport) -> str:
    if rep.ok:
        return rep.text()
    return (f"{rep.text()}: run the {spec.name}_rebuild job for partition(s) "
            f"{', '.join(spec.partition_key(p) for p in rep.partitions)}")


def _result(spec: StreamAsset, rep: ReconcileReport) -> dict[str, Any]:
    """A check result's fields: ``passed``, ``severity``, ``description``, ``metadata``."""
    d = rep.as_dict()
    md: dict[str, Any] = {k: d[k] for k in ("from_seq", "to_seq", "origin_messages",
                                             "expected", "in_queue", "in_table", "in_dlq",
                                             "replayed", "missing", "not_yet_sourced",
                                             "source_lag", "partial", "versions_read")}
    md["sourcing"] = MetadataValue.text(rep.stall.text() if rep.stall is not None else "ok")
    md["partitions_to_rebuild"] = MetadataValue.text(
        ", ".join(spec.partition_key(p) for p in rep.partitions) or "none")
    md["gaps"] = MetadataValue.json(d["gaps"])
    return {"passed": _passed(rep), "description": _description(spec, rep), "metadata": md,
            "severity": AssetCheckSeverity.ERROR if not rep.ok else AssetCheckSeverity.WARN}


def reconcile_evaluation(
    spec: StreamAsset, nats: NatsResource, warehouse: Warehouse, *,
    inp: JoinInput | None = None, **kw: Any,
) -> AssetCheckEvaluation:
    """Input ``inp``'s (default the first) ``origin_reconciled`` evaluation for a sensor to
    emit (``SensorResult(asset_events=[...])``); ``kw`` as :func:`reconcile_group_report`.

    Raises:
        The errors of :func:`reconcile_group_report` (a tick reports them as its reason).
    """
    inp = inp or spec.inputs[0]
    rep = reconcile_group_report(spec, nats, warehouse, inp=inp, **kw)
    return AssetCheckEvaluation(asset_key=asset_key_of(spec),
                                check_name=spec.per_input(RECONCILE_CHECK, inp),
                                **_result(spec, rep))


def build_reconcile_check(
    spec: StreamAsset, *, inp: JoinInput | None = None,
    max_messages: int = DEFAULT_CHECK_MESSAGES, seq_column: str | None = None,
    timeout_s: float = 50.0,
) -> AssetChecksDefinition:
    """Input ``inp``'s (default the first) ``origin_reconciled`` check of ``spec``'s asset
    (see the module docstring). Needs the NATS and warehouse resources."""
    keys = {spec.nats_resource_key, spec.warehouse_resource_key}
    inp = inp or spec.inputs[0]

    @asset_check(asset=asset_key_of(spec), name=spec.per_input(RECONCILE_CHECK, inp),
                 required_resource_keys=keys,
                 description=f"Every origin message of {inp.stream}.{inp.group} (the whole "
                 "history, incrementally) reached the work queue and was accounted for by a "
                 "commit (processed, dead-lettered or filtered out), or is still queued; a "
                 "sourcing stall is a warning, never a gap.")
    def origin_reconciled(context: AssetCheckExecutionContext) -> AssetCheckResult:
        res = context.resources
        rep = reconcile_group_report(
            spec, getattr(res, spec.nats_resource_key),
            getattr(res, spec.warehouse_resource_key), inp=inp, max_messages=max_messages,
            seq_column=seq_column, timeout_s=timeout_s)
        return AssetCheckResult(**_result(spec, rep))

    return origin_reconciled
