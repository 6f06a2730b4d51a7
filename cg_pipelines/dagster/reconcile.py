"""Origin <-> work-queue reconciliation in Dagster: an asset check, and the same evaluation for a
sensor to emit (or to put in its skip reason).

``origin_reconciled`` (severity ERROR on a gap): every origin message the group's partitioning
filters match, within the last ``max_messages`` origin sequences, reached the work queue — it is
still queued, committed to the table (its ``_seq``), or dead-lettered
(:mod:`cg_pipelines.core.reconcile`). A failing check names the origin sequence ranges and the
partitions, and the repair: run the ``<asset>_rebuild`` job for those partitions (a rebuild from
the origin stream, :func:`cg_pipelines.engine.rebuild.rebuild_partition`).

Register it (this module is not wired by :func:`~cg_pipelines.dagster.build_definitions`)::

    from cg_pipelines.dagster.reconcile import build_reconcile_check
    defs = Definitions.merge(build_definitions([spec], resources=...),
                             Definitions(asset_checks=[build_reconcile_check(spec)]))

Then "Execute" it on the asset's Checks tab, on a schedule (a job selecting
``AssetSelection.checks(check)``), or from a sensor with :func:`reconcile_evaluation`
(``SensorResult(asset_events=[evaluation])``; :func:`reconcile_skip_reason` for the tick's
reason). Keep it out of the partition runs' job selection, like the other operational checks.
"""

from typing import Any

from dagster import (
    AssetCheckEvaluation,
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetChecksDefinition,
    AssetCheckSeverity,
    MetadataValue,
    asset_check,
)
from nats.aio.client import Client

from cg_pipelines.core.reconcile import ReconcileReport
from cg_pipelines.dagster.assets import asset_key_of
from cg_pipelines.dagster.resources import DeltaWarehouseResource, NatsResource
from cg_pipelines.dagster.spec import ConsumerGroupAsset
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.reconcile import reconcile_group, sink_table_seqs

__all__ = ["RECONCILE_CHECK", "build_reconcile_check", "reconcile_evaluation",
           "reconcile_group_report", "reconcile_skip_reason"]

RECONCILE_CHECK = "origin_reconciled"
"""The check's name."""

DEFAULT_CHECK_MESSAGES = 200_000
"""Origin messages one evaluation reads by default (the most recent ones)."""


def reconcile_group_report(
    spec: ConsumerGroupAsset, nats: NatsResource, warehouse: DeltaWarehouseResource, *,
    max_messages: int = DEFAULT_CHECK_MESSAGES, seq_column: str = "_seq",
    from_seq: int | None = None, timeout_s: float = 50.0,
) -> ReconcileReport:
    """Reconcile ``spec``'s group over the last ``max_messages`` origin sequences (or from
    ``from_seq``), reading the table ``spec.table_name`` of ``warehouse`` (column
    ``seq_column``), all within ``timeout_s`` seconds (under Dagster's 60 s tick limit).

    Raises:
        TimeoutError, NatsConnectError, JetStreamError, GroupNotFoundError, ConfigError,
        ValueError (the table has no ``seq_column``): see
        :func:`cg_pipelines.jetstream.reconcile.reconcile_group`.
    """
    seqs = sink_table_seqs(warehouse.sink(spec.table_name), seq_column)

    async def go(nc: Client) -> ReconcileReport:
        js = nc.jetstream(timeout=nats.call_timeout_s)
        api = JetStreamAPI(nc, timeout=nats.call_timeout_s)
        try:
            return await reconcile_group(js, api, spec.stream, spec.group, table_seqs=seqs,
                                         from_seq=from_seq, max_messages=max_messages)
        finally:
            await api.close()

    return nats.run(go, timeout_s=timeout_s)


def _metadata(spec: ConsumerGroupAsset, rep: ReconcileReport) -> dict[str, Any]:
    d = rep.as_dict()
    md: dict[str, Any] = {k: d[k] for k in ("from_seq", "to_seq", "origin_messages",
                                             "expected", "in_queue", "in_table", "in_dlq",
                                             "replayed", "missing", "not_yet_sourced",
                                             "source_lag")}
    md["partitions_to_rebuild"] = MetadataValue.text(
        ", ".join(spec.partition_key(p) for p in rep.partitions) or "none")
    md["gaps"] = MetadataValue.json(d["gaps"])
    return md


def _description(spec: ConsumerGroupAsset, rep: ReconcileReport) -> str:
    if rep.ok:
        return rep.text()
    return (f"{rep.text()}: run the {spec.name}_rebuild job for partition(s) "
            f"{', '.join(spec.partition_key(p) for p in rep.partitions)}")


def reconcile_evaluation(
    spec: ConsumerGroupAsset, nats: NatsResource, warehouse: DeltaWarehouseResource,
    **kw: Any,
) -> AssetCheckEvaluation:
    """The ``origin_reconciled`` evaluation for a sensor to emit
    (``SensorResult(asset_events=[...])``); ``kw`` as :func:`reconcile_group_report`.

    Raises:
        The errors of :func:`reconcile_group_report` (a tick reports them as its reason).
    """
    rep = reconcile_group_report(spec, nats, warehouse, **kw)
    return AssetCheckEvaluation(
        asset_key=asset_key_of(spec), check_name=RECONCILE_CHECK, passed=rep.ok,
        severity=AssetCheckSeverity.ERROR, description=_description(spec, rep),
        metadata=_metadata(spec, rep))


def reconcile_skip_reason(
    spec: ConsumerGroupAsset, nats: NatsResource, warehouse: DeltaWarehouseResource,
    **kw: Any,
) -> str | None:
    """``None`` when the group reconciles, else one line for a sensor's skip reason (the gaps,
    the partitions and the repair)."""
    rep = reconcile_group_report(spec, nats, warehouse, **kw)
    return None if rep.ok else _description(spec, rep)


def build_reconcile_check(
    spec: ConsumerGroupAsset, *, max_messages: int = DEFAULT_CHECK_MESSAGES,
    seq_column: str = "_seq", timeout_s: float = 50.0,
) -> AssetChecksDefinition:
    """The ``origin_reconciled`` asset check of ``spec``'s asset (see the module docstring).
    Needs the group's NATS and warehouse resources."""
    keys = {spec.nats_resource_key, spec.warehouse_resource_key}

    @asset_check(asset=asset_key_of(spec), name=RECONCILE_CHECK, required_resource_keys=keys,
                 description=f"Every origin message of {spec.stream}.{spec.group} (last "
                 f"{max_messages:,} origin sequences) reached the work queue: queued, in the "
                 f"table ({seq_column}) or dead-lettered.")
    def origin_reconciled(context: AssetCheckExecutionContext) -> AssetCheckResult:
        res = context.resources
        rep = reconcile_group_report(
            spec, getattr(res, spec.nats_resource_key),
            getattr(res, spec.warehouse_resource_key), max_messages=max_messages,
            seq_column=seq_column, timeout_s=timeout_s)
        return AssetCheckResult(passed=rep.ok, severity=AssetCheckSeverity.ERROR,
                                description=_description(spec, rep),
                                metadata=_metadata(spec, rep))

    return origin_reconciled
