"""Asset factory: one partitioned Dagster asset per consumer group, plus its job, sensors,
schedule and checks (glue only: the work is in ``cg_pipelines``).

Partitions are the group's partitions ``"0".."N-1"`` (N = max_members, declared here and checked
against the group's KV config at run time). Each run drains one partition through the ordered
engine. Runs carry the tag ``cg/partition = <stream>/<group>/<p>``; ``dagster.yaml`` limits it
to one run per unique value, and the engine's lease and fenced commit make a second holder
harmless anyway.
"""


from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import nats.errors
from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetKey,
    AssetObservation,
    AssetsDefinition,
    BackfillPolicy,
    DefaultScheduleStatus,
    DefaultSensorStatus,
    Failure,
    MaterializeResult,
    MetadataValue,
    PartitionedConfig,
    RunRequest,
    ScheduleDefinition,
    ScheduleEvaluationContext,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    StaticPartitionsDefinition,
    asset,
    define_asset_job,
    schedule,
    sensor,
)
from dagster._core.definitions.unresolved_asset_job_definition import (
    UnresolvedAssetJobDefinition,
)

from cg_pipelines.core.assignment import assignment, owners
from cg_pipelines.core.config import ElasticConfig
from cg_pipelines.core.errors import ConfigError, GroupNotFoundError
from cg_pipelines.core.triggers import (
    backlog_requests,
    decode_membership_cursor,
    encode_membership_cursor,
    gained_partitions,
    served_partitions,
)
from cg_pipelines.engine.model import Processor, RunResult
from cg_pipelines.engine.runner import run_partition
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.api import JetStreamAPI
from cg_pipelines.jetstream.backlog import partition_backlog
from cg_pipelines.jetstream.errors import JetStreamError
from cg_pipelines.jetstream.kv import Versioned
from resources.group import PartitionRunsResource
from resources.nats import NatsResource
from resources.spark import SparkResource
from resources.warehouse import WarehouseResource

PARTITION_TAG = "cg/partition"
GROUP_TAG = "cg/group"
# What a sensor tick reports as a skip reason instead of failing (no crash loop).
TICK_ERRORS = (GroupNotFoundError, ConfigError, JetStreamError, TimeoutError, OSError,
               nats.errors.Error, ValueError)


@dataclass(frozen=True)
class GroupAsset:
    """A consumer group materialized as a partitioned asset.

    Attributes:
        name: asset name (also the Delta table name under the warehouse root).
        stream, group: the origin stream and elastic group.
        max_members: the group's partition count (fixed for the group's life).
        processor: builds the processing step from the Spark resource.
        description: shown in the Dagster UI.
        sensor_interval_s: minimum seconds between sensor ticks.
        schedule_cron: cron of the drain-all schedule.
    """

    name: str
    stream: str
    group: str
    max_members: int
    processor: Callable[[SparkResource], Processor]
    description: str = ""
    sensor_interval_s: int = 30
    schedule_cron: str = "*/15 * * * *"

    def partition_tags(self, key: str) -> dict[str, str]:
        return {PARTITION_TAG: f"{self.stream}/{self.group}/{key}",
                GROUP_TAG: f"{self.stream}/{self.group}"}


@dataclass(frozen=True)
class GroupDefinitions:
    asset: AssetsDefinition
    job: UnresolvedAssetJobDefinition
    sensors: list[SensorDefinition]
    schedule: ScheduleDefinition


def _check_partitions(config: ElasticConfig, spec: GroupAsset) -> None:
    """Raise ``ConfigError`` unless the group's partition count is the one the code declares."""
    if config.max_members != spec.max_members:
        raise ConfigError("max_members", f"group {spec.stream}.{spec.group} has "
                          f"{config.max_members} partitions in KV but the code declares "
                          f"{spec.max_members}")


def _load_config(nats_res: NatsResource, spec: GroupAsset) -> Versioned[ElasticConfig]:
    """The group's config (one bounded NATS call); checks max_members against the code."""
    v = nats_res.run(lambda nc: admin.get_elastic(nc.jetstream(), spec.stream, spec.group,
                                                  timeout=nats_res.call_timeout_s))
    _check_partitions(v.config, spec)
    return v


def _metadata(result: RunResult, owner: str, revision: int) -> dict[str, Any]:
    return {
        "status": result.status,
        "first_seq": result.first_seq or 0,
        "last_seq": result.last_seq or 0,
        "messages": result.processed,
        "dead_lettered": result.dead_lettered,
        "duplicates_skipped": result.duplicates_skipped,
        "commits": result.commits,
        "fence_conflicts": result.fence_conflicts,
        "watermark": result.watermark,
        "seconds": MetadataValue.float(round(result.seconds, 3)),
        "messages_per_second": MetadataValue.float(round(result.messages_per_second, 1)),
        "owner_member": owner,
        "config_revision": revision,
        "detail": result.detail or "",
        "timings": MetadataValue.json({k: round(v, 3) for k, v in result.timings.items()}),
    }


def build_group_definitions(spec: GroupAsset) -> GroupDefinitions:
    """The asset, its partitioned job, membership and backlog sensors, and the schedule."""
    keys = [str(i) for i in range(spec.max_members)]
    partitions = StaticPartitionsDefinition(keys)
    checks = [
        # Not partitioned: AssetCheckSpec(partitions_def=...) is a preview feature in Dagster
        # 1.13 ("not ready for production"); each result carries the run's partition status in
        # its metadata instead.
        AssetCheckSpec("backlog_drained", asset=spec.name,
                       description="The run drained the partition's backlog seen at its start."),
        AssetCheckSpec("no_unexplained_fence_conflicts", asset=spec.name,
                       description="No commit was refused by the watermark fence (a refusal "
                       "means another holder took the partition over mid-run)."),
    ]

    @asset(
        name=spec.name,
        partitions_def=partitions,
        backfill_policy=BackfillPolicy.multi_run(1),
        check_specs=checks,
        description=spec.description or f"Consumer group {spec.group} on {spec.stream}.",
        kinds={"spark", "delta", "nats"},
        pool="spark",
        metadata={"stream": spec.stream, "group": spec.group,
                  "partitions": spec.max_members},
    )
    def _group_asset(
        context: AssetExecutionContext,
        nats: NatsResource,
        spark: SparkResource,
        warehouse: WarehouseResource,
        partition_runs: PartitionRunsResource,
    ) -> MaterializeResult:
        p = int(context.partition_key)
        try:
            v = _load_config(nats, spec)
        except TICK_ERRORS as e:
            raise Failure(f"cannot read consumer group {spec.stream}.{spec.group}: {e}") from e
        owner = owners(assignment(v.config)).get(p)
        served = partition_runs.served()
        if owner is None or (served is not None and owner not in served):
            raise Failure(
                f"partition {p} of {spec.stream}.{spec.group} is owned by "
                f"{owner or 'no member'}; this deployment serves "
                f"{', '.join(served) if served else 'every member'}")
        sink = warehouse.sink(spec.name)
        processor = spec.processor(spark)
        result = nats.run(
            lambda nc: run_partition(nc, spec.stream, spec.group, p, processor, sink,
                                     partition_runs.engine_options()),
            timeout_s=partition_runs.run_timeout_s)
        context.log.info(f"partition {p}: {result.status}, {result.processed} messages in "
                         f"{result.seconds:.1f} s ({result.messages_per_second:,.0f}/s); "
                         f"{result.detail}")
        md = _metadata(result, owner, v.revision)
        if result.status == "halted":
            raise Failure(f"partition {p} halted: {result.detail}", metadata=md)
        drained = result.status in ("drained", "empty")
        return MaterializeResult(
            metadata=md,
            check_results=[
                AssetCheckResult(
                    check_name="backlog_drained", passed=drained,
                    severity=AssetCheckSeverity.WARN,
                    metadata={"partition": p, "status": result.status,
                              "detail": result.detail}),
                AssetCheckResult(
                    check_name="no_unexplained_fence_conflicts",
                    passed=result.fence_conflicts == 0, severity=AssetCheckSeverity.WARN,
                    metadata={"partition": p, "fence_conflicts": result.fence_conflicts,
                              "detail": result.detail}),
            ],
        )

    job = define_asset_job(
        f"{spec.name}_job",
        selection=[spec.name],
        config=PartitionedConfig(partitions, run_config_for_partition_key_fn=lambda _k: {},
                                 tags_for_partition_key_fn=spec.partition_tags),
        description=f"Drain one partition of {spec.stream}.{spec.group} per run.",
    )

    def run_request(p: int, run_key: str) -> RunRequest:
        return RunRequest(run_key=run_key, partition_key=str(p), tags=spec.partition_tags(str(p)))

    @sensor(name=f"{spec.name}_membership", job=job,
            minimum_interval_seconds=spec.sensor_interval_s,
            default_status=DefaultSensorStatus.STOPPED,
            description="On a membership change (KV revision), runs the partitions this "
            "deployment's members gained.")
    def membership_sensor(context: SensorEvaluationContext, nats: NatsResource,
                          partition_runs: PartitionRunsResource) -> SensorResult | SkipReason:
        try:
            v = _load_config(nats, spec)
            rev, old = decode_membership_cursor(context.cursor)
        except TICK_ERRORS as e:
            return SkipReason(f"consumer group {spec.stream}.{spec.group}: {e}")
        if v.revision == rev:
            return SkipReason(f"no membership change (revision {rev})")
        new = assignment(v.config)
        gained = gained_partitions(old, new, partition_runs.served())
        events = []
        for p, (was, now) in gained.items():
            context.log.info(f"partition {p}: {was or 'unowned'} -> {now} (revision {v.revision})")
            events.append(AssetObservation(
                asset_key=AssetKey(spec.name), partition=str(p),
                metadata={"moved_from": was or "", "moved_to": now,
                          "config_revision": v.revision}))
        return SensorResult(
            run_requests=[run_request(p, f"{spec.group}:member:{v.revision}:{p}")
                          for p in sorted(gained)],
            asset_events=events,
            cursor=encode_membership_cursor(v.revision, new),
            skip_reason=None if gained else
            f"membership changed (revision {v.revision}); no partition gained by the members "
            f"served here",
        )

    def backlog_tick(nats_res: NatsResource, runs: PartitionRunsResource,
                     log: Any) -> list[RunRequest] | SkipReason:
        """One bounded NATS session: the group's config and every partition's backlog; one
        run request per served partition with backlog, or the reason for none."""

        async def read(nc: Any) -> Any:
            v = await admin.get_elastic(nc.jetstream(), spec.stream, spec.group,
                                        timeout=nats_res.call_timeout_s)
            async with JetStreamAPI(nc, timeout=nats_res.call_timeout_s) as api:
                return v, await partition_backlog(api, spec.stream, spec.group,
                                                  range(spec.max_members))

        try:
            v, backlog = nats_res.run(read)
            _check_partitions(v.config, spec)
        except TICK_ERRORS as e:
            return SkipReason(f"consumer group {spec.stream}.{spec.group}: {e}")
        served = served_partitions(assignment(v.config), runs.served())
        reqs = backlog_requests(spec.group, backlog, min_pending=runs.min_pending,
                                max_age_s=runs.max_age_s, partitions=served)
        for r in reqs:
            log.info(f"partition {r.partition}: {r.reason}")
        return [run_request(r.partition, r.run_key) for r in reqs] or SkipReason(
            "no partition with backlog")

    @sensor(name=f"{spec.name}_backlog", job=job,
            minimum_interval_seconds=spec.sensor_interval_s,
            default_status=DefaultSensorStatus.STOPPED,
            description="Runs each served partition whose backlog is above the threshold or "
            "older than the max age; one run per backlog (run key = first pending sequence).")
    def backlog_sensor(context: SensorEvaluationContext, nats: NatsResource,
                       partition_runs: PartitionRunsResource) -> SensorResult | SkipReason:
        got = backlog_tick(nats, partition_runs, context.log)
        return got if isinstance(got, SkipReason) else SensorResult(run_requests=got)

    @schedule(name=f"{spec.name}_drain", cron_schedule=spec.schedule_cron, job=job,
              default_status=DefaultScheduleStatus.STOPPED,
              description="Drains every served partition that has a backlog.")
    def drain_schedule(context: ScheduleEvaluationContext, nats: NatsResource,
                       partition_runs: PartitionRunsResource) -> list[RunRequest] | SkipReason:
        return backlog_tick(nats, partition_runs, context.log)

    return GroupDefinitions(_group_asset, job, [membership_sensor, backlog_sensor],
                            drain_schedule)
