"""A consumer group's operational asset checks evaluated outside its runs, partitioned like the
group asset (``AssetCheckSpec(partitions_def=...)``, Dagster 1.13): one result per partition,
and the check page shows each partition's state.

- ``lag_within_objective`` (severity WARN, only with ``ConsumerGroupAsset.lag_objective_s``):
  the partition's oldest pending message is at most ``lag_objective_s`` seconds old: the
  partition's freshness. Each drain and rebuild run also evaluates it for its partition after
  its materialization (it is in those jobs' selection), so a drained partition passes against
  its latest materialization without a check-only run.
- ``partition_runs_succeeding`` (severity ERROR): the partition has not failed
  ``PartitionRunsResource.retry_max_failures`` runs in a row (such a partition is no longer
  retried until a run succeeds or new code is loaded; the check names it and its last error).

The backlog sensor evaluates both for every served partition at each tick and records only
what changed (:func:`cg_pipelines.dagster.partition_checks.plan_partition_checks`): a
partition's first result run-less (Dagster 1.13 allows one run-less result per check and
partition), a later change by a check-only run of that partition (the ``<asset>_checks`` job,
which executes these checks as "Execute" does). They can also be executed by hand (the
asset's Checks tab, "Execute", per partition): that computes the check of that partition only
(:func:`cg_pipelines.dagster.partition_checks.evaluate_check`), not a tick. The checks each run
evaluates (``backlog_drained``, ``no_unexplained_fence_conflicts``, ``no_new_dead_letters``)
are declared on the asset (:mod:`cg_pipelines.dagster.assets`).
"""

from dagster import (
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetChecksDefinition,
    AssetCheckSeverity,
    AssetMaterialization,
    AssetRecordsFilter,
    Failure,
    StaticPartitionsDefinition,
    asset_check,
)

from cg_pipelines.core.errors import one_line
from cg_pipelines.dagster.partition_checks import LAG_CHECK, RUNS_CHECK, evaluate_check
from cg_pipelines.dagster.spec import (
    TICK_ERRORS,
    ConsumerGroupAsset,
    asset_key_of,
    partitioned_checks_preview,
)

__all__ = ["build_group_checks"]


def _this_runs_materialization(context: AssetCheckExecutionContext, spec: ConsumerGroupAsset,
                               key: str) -> AssetMaterialization | None:
    """The partition's latest materialization when this run made it (the check runs in the
    partition's drain or rebuild run), else ``None`` (executed alone: by hand, or a check-only
    run). One indexed read of at most one record."""
    records = context.instance.fetch_materializations(
        AssetRecordsFilter(asset_key=asset_key_of(spec), asset_partitions=[key]), limit=1).records
    if records and records[0].run_id == context.run.run_id:
        mat: AssetMaterialization | None = records[0].asset_materialization
        return mat
    return None


def _evaluate(context: AssetCheckExecutionContext, spec: ConsumerGroupAsset,
              name: str) -> AssetCheckResult:
    """Evaluate check ``name`` on the run's partition, and only that
    (:func:`~cg_pipelines.dagster.partition_checks.evaluate_check`: no tick, no lost-run
    handling). In the partition's own drain or rebuild run, ``lag_within_objective`` never
    fails the run: it is evaluated whoever owns the partition now, and when the group cannot
    be read it is judged from the run's outcome (:func:`_lag_from_run`).

    Raises:
        Failure: alone (by hand, a check-only run): the group cannot be read, or the partition
            is not served here.
    """
    res = context.resources
    key = context.partition_key
    mat = _this_runs_materialization(context, spec, key) if name == LAG_CHECK else None
    try:
        ev = evaluate_check(spec, name, key, getattr(res, spec.nats_resource_key),
                            getattr(res, spec.runs_resource_key), context.instance,
                            any_owner=mat is not None)
    except TICK_ERRORS as e:
        if mat is not None:
            return _lag_from_run(mat, e)
        raise Failure(f"cannot evaluate {name} on {key}: consumer group "
                      f"{spec.stream}.{spec.group}: {e}") from e
    if ev is None:
        raise Failure(f"cannot evaluate {name} on {key}: the partition is not served by this "
                      "deployment")
    return AssetCheckResult(passed=ev.passed, severity=ev.severity,
                            description=ev.description, metadata=dict(ev.metadata))


def _lag_from_run(mat: AssetMaterialization, error: Exception) -> AssetCheckResult:
    """``lag_within_objective`` in a drain run that cannot read the group after its
    materialization ``mat``: passed when the run drained what it saw (``status`` ``drained``,
    ``empty`` or ``rebuilt``), failed otherwise; the description says so, and the backlog
    sensor compares it with the backlog at its next tick (a wrong outcome is recorded again by
    a check-only run)."""
    status = getattr(mat.metadata.get("status"), "value", None)
    return AssetCheckResult(
        passed=status in ("drained", "empty", "rebuilt"), severity=AssetCheckSeverity.WARN,
        description=f"backlog not readable after the run ({type(error).__name__}: "
        f"{one_line(str(error))[:200]}); judged from the run, which ended {status or 'unknown'}"
        "; the backlog sensor evaluates it again at its next tick",
        metadata={"judged_from": "the run's outcome"})


def build_group_checks(spec: ConsumerGroupAsset) -> list[AssetChecksDefinition]:
    """The partitioned ``lag_within_objective`` (when ``spec.lag_objective_s`` is set) and
    ``partition_runs_succeeding`` checks of ``spec``'s asset."""
    with partitioned_checks_preview():  # Dagster's preview warning for partitioned checks
        return _group_checks(spec)


def _group_checks(spec: ConsumerGroupAsset) -> list[AssetChecksDefinition]:
    keys = {spec.nats_resource_key, spec.runs_resource_key}
    key = asset_key_of(spec)
    parts = StaticPartitionsDefinition(spec.partition_keys())
    checks = []
    if spec.lag_objective_s is not None:
        @asset_check(asset=key, name=LAG_CHECK, required_resource_keys=keys,
                     partitions_def=parts,
                     description=f"The partition's freshness: its oldest pending message is "
                     f"at most {spec.lag_objective_s:g} s old (evaluated by each drain run after "
                     "its materialization, and by the backlog sensor).")
        def lag_within_objective(context: AssetCheckExecutionContext) -> AssetCheckResult:
            return _evaluate(context, spec, LAG_CHECK)

        checks.append(lag_within_objective)

    @asset_check(asset=key, name=RUNS_CHECK, required_resource_keys=keys, partitions_def=parts,
                 description="The partition has not failed its runs so often in a row that the "
                 "backlog sensor stopped retrying it (evaluated by the backlog sensor).")
    def partition_runs_succeeding(context: AssetCheckExecutionContext) -> AssetCheckResult:
        return _evaluate(context, spec, RUNS_CHECK)

    checks.append(partition_runs_succeeding)
    return checks
