"""A consumer group's operational asset checks, evaluated by the backlog sensor on every change
and executable by hand (Dagster UI: the asset's Checks tab, "Execute"):

- ``lag_within_objective`` (severity WARN): every served partition's oldest pending message is
  at most ``ConsumerGroupAsset.lag_objective_s`` seconds old.
- ``partition_runs_succeeding`` (severity ERROR): no partition has failed
  ``PartitionRunsResource.retry_max_failures`` runs in a row (such a partition is no longer
  retried until a run succeeds or new code is loaded; the check names it and its last error).

Both are checks of the whole asset (not partitioned: partitioned checks are a preview feature
in Dagster 1.13); their metadata name the partitions concerned.
"""

from dagster import (
    AssetCheckEvaluation,
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetChecksDefinition,
    Failure,
    asset_check,
)

from cg_pipelines.dagster.assets import asset_key_of
from cg_pipelines.dagster.sensors import LAG_CHECK, RUNS_CHECK, backlog_tick
from cg_pipelines.dagster.spec import ConsumerGroupAsset

__all__ = ["build_group_checks"]


def _result(ev: AssetCheckEvaluation) -> AssetCheckResult:
    return AssetCheckResult(passed=ev.passed, severity=ev.severity, description=ev.description,
                            metadata=dict(ev.metadata))


def _evaluate(context: AssetCheckExecutionContext, spec: ConsumerGroupAsset,
              name: str) -> AssetCheckResult:
    res = context.resources
    tick = backlog_tick(spec, getattr(res, spec.nats_resource_key),
                        getattr(res, spec.runs_resource_key), context.log,
                        instance=context.instance, observe=True)
    for ev in tick.asset_events:
        if isinstance(ev, AssetCheckEvaluation) and ev.check_name == name:
            return _result(ev)
    raise Failure(f"cannot evaluate {name}: {tick.skip_reason or 'no reading'}")


def build_group_checks(spec: ConsumerGroupAsset) -> list[AssetChecksDefinition]:
    """The ``lag_within_objective`` (when ``spec.lag_objective_s`` is set) and
    ``partition_runs_succeeding`` checks of ``spec``'s asset."""
    keys = {spec.nats_resource_key, spec.runs_resource_key}
    key = asset_key_of(spec)
    checks = []
    if spec.lag_objective_s is not None:
        @asset_check(asset=key, name=LAG_CHECK, required_resource_keys=keys,
                     description=f"Every served partition's oldest pending message is at most "
                     f"{spec.lag_objective_s:g} s old (evaluated by the backlog sensor).")
        def lag_within_objective(context: AssetCheckExecutionContext) -> AssetCheckResult:
            return _evaluate(context, spec, LAG_CHECK)

        checks.append(lag_within_objective)

    @asset_check(asset=key, name=RUNS_CHECK, required_resource_keys=keys,
                 description="No partition has failed its runs so often in a row that the "
                 "backlog sensor stopped retrying it (evaluated by the backlog sensor).")
    def partition_runs_succeeding(context: AssetCheckExecutionContext) -> AssetCheckResult:
        return _evaluate(context, spec, RUNS_CHECK)

    checks.append(partition_runs_succeeding)
    return checks
