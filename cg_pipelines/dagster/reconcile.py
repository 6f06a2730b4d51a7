"""Origin <-> work-queue reconciliation of each input of an asset, as the asset check
``origin_reconciled`` (one per input: :meth:`~cg_pipelines.dagster.spec.StreamAsset.per_input`)
and as the evaluation a sensor emits.

Each input's check: every origin message its group's partitioning filters match reached the
work queue and was accounted for by a commit (processed, dead-lettered, filtered out: the
coverage each commit records, a set's joint commit one entry per input,
:mod:`cg_pipelines.engine.coverage_log`), or is still queued. Incremental: a cursor beside the
table (``_cg_reconcile/<stream>.<group>.json``) makes each evaluation read only what came since
the last one, in bounded chunks, for at most half of ``timeout_s`` (metadata ``partial``).

- A **gap** fails with severity ERROR, naming the origin sequence ranges, the partitions and
  the repair: run the ``<asset>_rebuild`` job for those partitions.
- A **sourcing stall** (the work queue's source removed, inactive or lagging) fails with
  severity WARN and passes again by itself once sourcing resumes.

:func:`~cg_pipelines.dagster.build_definitions` registers it on every asset of a Delta
warehouse (it reads the Delta log); the backlog sensor evaluates it every
``reconcile_interval_s``.
"""

import asyncio
import concurrent.futures
import time
from typing import Any, TypeVar

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

from cg_pipelines.core.coverage import ReconcileCursor
from cg_pipelines.core.errors import UsageError
from cg_pipelines.core.reconcile import ReconcileReport
from cg_pipelines.dagster.resources import NatsResource
from cg_pipelines.dagster.spec import JoinInput, StreamAsset, asset_key_of
from cg_pipelines.dagster.warehouse import Warehouse
from cg_pipelines.engine.coverage_log import DeltaLogCoverage
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.reconcile import (
    DEFAULT_MAX_VERSIONS,
    reconcile_group,
    sink_table_seqs,
)
from cg_pipelines.sinks.storage import table_filesystem

__all__ = ["RECONCILE_CHECK", "build_reconcile_check", "reconcile_evaluation",
           "reconcile_group_report", "reconcile_skip_reason"]

RECONCILE_CHECK = "origin_reconciled"
"""The check's name."""

DEFAULT_CHECK_MESSAGES = 200_000
"""Origin messages one chunk of an evaluation reads at most."""

T = TypeVar("T")


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


def _metadata(spec: StreamAsset, rep: ReconcileReport) -> dict[str, Any]:
    d = rep.as_dict()
    md: dict[str, Any] = {k: d[k] for k in ("from_seq", "to_seq", "origin_messages",
                                             "expected", "in_queue", "in_table", "in_dlq",
                                             "replayed", "missing", "not_yet_sourced",
                                             "source_lag", "partial", "versions_read")}
    md["sourcing"] = MetadataValue.text(rep.stall.text() if rep.stall is not None else "ok")
    md["partitions_to_rebuild"] = MetadataValue.text(
        ", ".join(spec.partition_key(p) for p in rep.partitions) or "none")
    md["gaps"] = MetadataValue.json(d["gaps"])
    return md


def _severity(rep: ReconcileReport) -> AssetCheckSeverity:
    return AssetCheckSeverity.ERROR if not rep.ok else AssetCheckSeverity.WARN


def _passed(rep: ReconcileReport) -> bool:
    """No gap and no stall (a stall fails with severity WARN, see the module docstring)."""
    return rep.ok and rep.stall is None


def _description(spec: StreamAsset, rep: ReconcileReport) -> str:
    if rep.ok:
        return rep.text()
    return (f"{rep.text()}: run the {spec.name}_rebuild job for partition(s) "
            f"{', '.join(spec.partition_key(p) for p in rep.partitions)}")


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
    return AssetCheckEvaluation(
        asset_key=asset_key_of(spec), check_name=spec.per_input(RECONCILE_CHECK, inp),
        passed=_passed(rep),
        severity=_severity(rep), description=_description(spec, rep),
        metadata=_metadata(spec, rep))


def reconcile_skip_reason(
    spec: StreamAsset, nats: NatsResource, warehouse: Warehouse,
    **kw: Any,
) -> str | None:
    """``None`` when the group reconciles, else one line for a sensor's skip reason (the gaps,
    the partitions and the repair, or the sourcing stall)."""
    rep = reconcile_group_report(spec, nats, warehouse, **kw)
    return None if _passed(rep) else _description(spec, rep)


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
        return AssetCheckResult(passed=_passed(rep), severity=_severity(rep),
                                description=_description(spec, rep),
                                metadata=_metadata(spec, rep))

    return origin_reconciled
