"""A co-partitioned set of consumer groups as ONE partitioned Dagster asset: partition ``p`` of
every group in one run, one commit (:func:`cg_pipelines.engine.join.run_copartitioned`).

What a user declares: :class:`CoPartitionedAsset` (the inputs, their shared partition count, a
:class:`~cg_pipelines.engine.join_processor.JoinProcessor`). What it builds
(:func:`build_copartitioned_definitions`, or ``build_definitions(..., joins=[...])``):

- the partitioned asset (keys ``<prefix><p>``), each run draining partition ``p`` of every input
  and committing the output with every input's watermark at once; its metadata names each
  input's sequence range, messages, dead letters and watermark (``<input>/first_seq`` ...), and
  its checks say whether the run drained, was fenced, or dead-lettered;
- ``<name>_rebuild``: each run rebuilds its partition from every input's origin history
  (:func:`~cg_pipelines.engine.join_rebuild.rebuild_copartitioned`);
- ``<name>_job`` and the ``<name>_backlog`` sensor: a run for partition ``p`` is requested when
  ANY input has a backlog at ``p`` (with the group asset's retry rule, lost-run detection and
  repeat suppression, :mod:`cg_pipelines.core.triggers`), and each input's lag per partition is
  observed at a bounded rate (``<input>/pending``, ``<input>/oldest_pending_age_s``).

Every run first checks, from the groups' KV configs, that the set is still co-partitioned
(:func:`~cg_pipelines.core.copartition.check_copartitioned`) with the declared partition count.
Runs of one partition are exclusive as for a group asset (the ``dagster/partition`` tag limit,
:mod:`cg_pipelines.dagster.assets`); the leases and the fence on every input stay the last line.
"""

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetsDefinition,
    Failure,
    MaterializeResult,
    MetadataValue,
    SensorDefinition,
    StaticPartitionsDefinition,
    asset,
    define_asset_job,
)

from cg_pipelines.core.errors import ConfigError
from cg_pipelines.core.fingerprint import code_version
from cg_pipelines.core.lag import DEFAULT_LAG_PER_DAY, DEFAULT_LAG_REFRESH_S
from cg_pipelines.core.write import Append, Merge
from cg_pipelines.dagster.history import (
    CODE_TAG,
    MODE_TAG,
    run_worker_tags,
)
from cg_pipelines.dagster.join_sensor import build_join_sensor, set_configs
from cg_pipelines.dagster.partition_run import (
    DEAD_LETTER_CHECK,
    DRAINED_CHECK,
    FENCE_CHECK,
    PartitionRunConfig,
    failed_run_checks,
    run_failure,
    run_mode,
    table_metadata,
    trim_traceback,
    wait_for_earlier_runs,
)
from cg_pipelines.dagster.resources import (
    NatsResource,
    PartitionRunsResource,
    run_spark_session,
    stopping_foreign_spark,
)
from cg_pipelines.dagster.retention import build_run_retention_sensor
from cg_pipelines.dagster.spec import TICK_ERRORS, PartitionKeys, partitioned_checks_preview
from cg_pipelines.dagster.warehouse import Warehouse
from cg_pipelines.engine.join import JoinInput, JoinResult, run_copartitioned
from cg_pipelines.engine.join_processor import JoinProcessor
from cg_pipelines.engine.join_rebuild import rebuild_copartitioned
from cg_pipelines.sinks.maintenance import Maintenance

__all__ = [
    "CoPartitionedAsset",
    "JoinDefinitions",
    "build_copartitioned_asset",
    "build_copartitioned_definitions",
]


@dataclass(frozen=True)
class CoPartitionedAsset(PartitionKeys):
    """Several consumer groups, partitioned on the same key into the same number of
    partitions, materialized as one partitioned asset: one run per partition drains partition
    ``p`` of every group and commits once.

    Attributes:
        name: asset name; also the table's name under the warehouse root (``table``
            overrides).
        inputs: the set's inputs (:class:`~cg_pipelines.engine.join.JoinInput`: the
            processor's name for the input, its stream and elastic group); two or more.
        partitions: the shared partition count (every group's ``max_members``; checked
            against the KV configs at run time, with the rest of
            :func:`~cg_pipelines.core.copartition.check_copartitioned`).
        processor: the :class:`~cg_pipelines.engine.join_processor.JoinProcessor` (its
            ``inputs`` are the input names).
        write: :class:`~cg_pipelines.core.write.Append` or :class:`~cg_pipelines.core.write.
            Merge` (a Merge table keyed by the join key is the join state: see
            docs/joins.md).
        partition_key_prefix: partition keys are ``<prefix><p>`` (default ``"<name>-"``).
        sensor_interval_s: minimum seconds between the backlog sensor's ticks.
        lag_refresh_s: seconds; each partition's per-input lag is observed when the set's
            lag state there changes (caught up / behind, or stopped on a new message) and
            otherwise, while it has a backlog, this often (as a group asset's).
        lag_observations_per_day: the most lag observations one partition writes a day
            (as a group asset's).
        maintenance: the table upkeep after each run's commits (``None``: the warehouse's).
        description, table, key_prefix, group_name, kinds, pool, metadata, code_version,
        nats_resource_key, spark_resource_key, warehouse_resource_key, runs_resource_key,
        io_manager_key: as :class:`~cg_pipelines.dagster.ConsumerGroupAsset`.

    Raises:
        ConfigError: fewer than two inputs, duplicate input names or groups, names that are
            not the processor's inputs, ``partitions < 1``, a Merge key that is not the
            processor's state key.
    """

    name: str
    inputs: Sequence[JoinInput]
    partitions: int
    processor: JoinProcessor
    description: str = ""
    table: str | None = None
    partition_key_prefix: str | None = None
    key_prefix: str | Sequence[str] | None = None
    group_name: str | None = None
    kinds: frozenset[str] | None = None
    pool: str | None = None
    sensor_interval_s: int = 30
    lag_refresh_s: float = DEFAULT_LAG_REFRESH_S
    lag_observations_per_day: int = DEFAULT_LAG_PER_DAY
    code_version: str | None = None
    nats_resource_key: str = "nats"
    spark_resource_key: str = "spark"
    warehouse_resource_key: str = "warehouse"
    runs_resource_key: str = "partition_runs"
    io_manager_key: str = "cg_io_manager"
    metadata: Mapping[str, object] = field(default_factory=dict)
    write: Append | Merge = field(default_factory=Append)
    maintenance: Maintenance | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        if not self.name:
            raise ConfigError("name", "must not be empty")
        names = [i.name for i in self.inputs]
        if len(names) < 2:
            raise ConfigError("inputs", f"a co-partitioned asset needs two or more inputs, "
                              f"got {names}")
        if len(set(names)) != len(names):
            raise ConfigError("inputs", f"input names must be unique, got {names}")
        groups = [(i.stream, i.group) for i in self.inputs]
        if len(set(groups)) != len(groups):
            raise ConfigError("inputs", f"each input must be its own group, got {groups}")
        if set(names) != set(self.processor.inputs):
            raise ConfigError("inputs", f"input names {sorted(names)} are not the "
                              f"processor's inputs {sorted(self.processor.inputs)}")
        if isinstance(self.partitions, bool) or not isinstance(self.partitions, int) or \
                self.partitions < 1:
            raise ConfigError("partitions", f"must be an integer >= 1, got {self.partitions!r}")
        if self.sensor_interval_s < 1:
            raise ConfigError("sensor_interval_s", f"must be >= 1 second, got "
                              f"{self.sensor_interval_s!r}")
        if not self.lag_refresh_s > 0:
            raise ConfigError("lag_refresh_s", f"must be > 0 seconds, got "
                              f"{self.lag_refresh_s!r}")
        if isinstance(self.lag_observations_per_day, bool) or not isinstance(
                self.lag_observations_per_day, int) or self.lag_observations_per_day < 1:
            raise ConfigError("lag_observations_per_day", f"must be an integer >= 1, got "
                              f"{self.lag_observations_per_day!r}")
        if not isinstance(self.write, (Append, Merge)):
            raise ConfigError("write", f"must be Append() or Merge(key=...), got {self.write!r}")
        state = self.processor.state
        if isinstance(self.write, Merge) and state is not None and \
                (state.key,) != self.write.keys:
            raise ConfigError("write", f"the processor's KeyedState key {state.key!r} must be "
                              f"the merge key {self.write.key!r}")

    @property
    def uses_spark(self) -> bool:
        """Whether the processor runs on Spark (the asset then requires the Spark resource)."""
        return self.processor.uses_spark

    @property
    def table_name(self) -> str:
        return self.table or self.name

    @property
    def effective_partition_key_prefix(self) -> str:
        return f"{self.name}-" if self.partition_key_prefix is None \
            else self.partition_key_prefix

    def current_code_version(self) -> str:
        """``code_version`` when declared, else a digest of the processor and the inputs."""
        if self.code_version:
            return self.code_version
        return code_version(self.processor, [(i.name, i.stream, i.group) for i in self.inputs],
                            self.partitions)

    @property
    def run_key_group(self) -> str:
        """What the backlog sensor's run keys start with (the asset's name)."""
        return self.name


@dataclass(frozen=True)
class JoinDefinitions:
    """The Dagster parts of one co-partitioned asset: ``asset``, ``job`` (one partition per
    run), ``rebuild_job`` (each run rebuilds its partition from every input's origin history:
    backfill it to recompute), ``sensors`` (the backlog sensor, the run retention sensor)."""

    asset: AssetsDefinition
    job: Any
    rebuild_job: Any
    sensors: list[SensorDefinition]

    @property
    def jobs(self) -> list[Any]:
        return [self.job, self.rebuild_job]


# ------------------------------------------------------------------------------ the asset

def build_copartitioned_asset(spec: CoPartitionedAsset) -> AssetsDefinition:
    """The partitioned asset of ``spec`` with its three run checks (as a group asset's:
    ``backlog_drained``, ``no_unexplained_fence_conflicts``, ``no_new_dead_letters``)."""
    partitions = StaticPartitionsDefinition(spec.partition_keys())
    checks = [
        AssetCheckSpec(DRAINED_CHECK, asset=spec.name, partitions_def=partitions,
                       description="The run drained every input's backlog seen at its start."),
        AssetCheckSpec(FENCE_CHECK, asset=spec.name, partitions_def=partitions,
                       description="No joint commit of the run was refused by the fence of "
                       "any input."),
        AssetCheckSpec(DEAD_LETTER_CHECK, asset=spec.name, partitions_def=partitions,
                       description="The run dead-lettered no message of any input."),
    ]
    keys = {spec.nats_resource_key, spec.warehouse_resource_key, spec.runs_resource_key}
    if spec.uses_spark:
        keys.add(spec.spark_resource_key)
    kinds = set(spec.kinds) if spec.kinds is not None else (
        {"nats", "delta", "spark"} if spec.uses_spark else {"nats", "delta"})
    inputs = [{"name": i.name, "stream": i.stream, "group": i.group} for i in spec.inputs]

    @asset(
        name=spec.name, key_prefix=spec.key_prefix, group_name=spec.group_name,
        partitions_def=partitions, check_specs=checks, kinds=kinds, pool=spec.pool,
        description=spec.description or "Co-partitioned join of " + ", ".join(
            f"{i.stream}.{i.group}" for i in spec.inputs),
        required_resource_keys=keys, io_manager_key=spec.io_manager_key,
        metadata={"cg/inputs": MetadataValue.json(inputs), "cg/partitions": spec.partitions,
                  "cg/table": spec.table_name, "cg/write_mode": spec.write.name,
                  "cg/partition_key_prefix": spec.effective_partition_key_prefix,
                  **spec.metadata},
    )
    def _joined_asset(context: AssetExecutionContext, config: PartitionRunConfig
                      ) -> Iterator[MaterializeResult | AssetCheckResult]:
        try:
            if not spec.uses_spark:
                result = _materialize(context, spec, config)
            else:
                with stopping_foreign_spark(context, spec.spark_resource_key):
                    result = _materialize(context, spec, config)
        except Exception as e:
            yield from failed_run_checks(e)
            raise
        yield result

    return _joined_asset


def _materialize(context: AssetExecutionContext, spec: CoPartitionedAsset,
                 config: PartitionRunConfig) -> MaterializeResult:
    res = context.resources
    nats_res: NatsResource = getattr(res, spec.nats_resource_key)
    warehouse: Warehouse = getattr(res, spec.warehouse_resource_key)
    runs: PartitionRunsResource = getattr(res, spec.runs_resource_key)
    p = spec.partition_of(context.partition_key)
    context.instance.add_run_tags(context.run.run_id, {
        CODE_TAG: spec.current_code_version(), **run_worker_tags()})
    waited = wait_for_earlier_runs(context, runs.run_timeout_s)
    try:
        nats_res.run(lambda nc: set_configs(nc, spec, nats_res.call_timeout_s))
    except TICK_ERRORS as e:
        raise Failure(f"cannot use the co-partitioned set of {spec.name}: {e}") from e
    sink = warehouse.sink(spec.table_name, write=spec.write,
                          commit_metadata={"dagster_run_id": context.run.run_id},
                          maintenance=spec.maintenance)
    processor = spec.processor
    if spec.uses_spark:
        processor = processor.bind(run_spark_session(getattr(res, spec.spark_resource_key)))
    mode = run_mode(context.run.tags, config)
    try:
        if mode == "rebuild":
            result = nats_res.run(
                lambda nc: rebuild_copartitioned(nc, spec.inputs, p, processor, sink,
                                                 runs.engine_options(),
                                                 allow_partial=config.allow_partial),
                timeout_s=runs.run_timeout_s)
        else:
            result = nats_res.run(
                lambda nc: run_copartitioned(nc, spec.inputs, p, processor, sink,
                                             runs.engine_options()),
                timeout_s=runs.run_timeout_s)
    except Exception as e:
        first = spec.inputs[0]
        raise run_failure(e, first, p) from trim_traceback(e)
    context.log.info(join_summary(result))
    md = join_metadata(result, spec.inputs)
    md["mode"] = mode
    md["waited_for_runs"] = ", ".join(waited)
    if result.status == "held":
        raise Failure(f"partition {p} was not processed: {result.detail}; it is retried when "
                      "the holder lets go", metadata=md)
    md.update(table_metadata(sink, p, spec.table_name))
    dead = sum(r.dead_lettered for r in result.inputs.values())
    fenced = result.status == "fenced"
    return MaterializeResult(metadata=md, check_results=[
        AssetCheckResult(check_name=DRAINED_CHECK,
                         passed=result.status in ("drained", "empty", "rebuilt"),
                         severity=AssetCheckSeverity.WARN,
                         description=f"{result.status}: {result.detail}" if result.detail
                         else result.status),
        AssetCheckResult(check_name=FENCE_CHECK, passed=not fenced,
                         severity=AssetCheckSeverity.WARN,
                         description=result.detail if fenced else "no commit refused"),
        AssetCheckResult(check_name=DEAD_LETTER_CHECK, passed=dead == 0,
                         severity=AssetCheckSeverity.WARN,
                         description=f"{dead:,} message(s) dead-lettered" if dead else
                         "none dead-lettered",
                         metadata={f"{n}/dead_lettered": r.dead_lettered
                                   for n, r in result.inputs.items()}),
    ])


def join_summary(result: JoinResult) -> str:
    """The run's last log line: status, messages per input, rows, time, detail."""
    per = ", ".join(f"{n} {r.processed:,}" for n, r in result.inputs.items())
    line = (f"partition {result.partition}: {result.status}, {result.processed:,} messages "
            f"committed ({per}) as {result.rows_written:,} rows in {result.commits} joint "
            f"commit(s), {result.seconds:.1f} s")
    return f"{line}; {result.detail}" if result.detail else line


def join_metadata(result: JoinResult, inputs: Sequence[JoinInput]) -> dict[str, Any]:
    """The materialization's metadata: the run's figures, and per input (``<name>/...``) its
    stream, group, sequence range, messages, dead letters and watermark; ``lineage`` lists
    the same per input as one JSON value."""
    md: dict[str, Any] = {
        "status": result.status, "commits": result.commits,
        "rows_written": result.rows_written, "messages": result.processed,
        "seconds": MetadataValue.float(round(result.seconds, 3)),
        "detail": result.detail or "",
        "timings": MetadataValue.json({k: round(v, 3) for k, v in result.timings.items()}),
    }
    lineage = []
    for inp in inputs:
        r = result.inputs[inp.name]
        row = {"stream": inp.stream, "group": inp.group, "first_seq": r.first_seq or 0,
               "last_seq": r.last_seq or 0, "messages": r.processed,
               "dead_lettered": r.dead_lettered, "watermark": r.watermark}
        lineage.append({"input": inp.name, **row})
        md.update({f"{inp.name}/{k}": v for k, v in row.items()})
    md["lineage"] = MetadataValue.json(lineage)
    if result.maintenance:
        md["maintenance"] = MetadataValue.json(result.maintenance)
    return md


def build_copartitioned_definitions(spec: CoPartitionedAsset) -> JoinDefinitions:
    """The asset, ``<name>_job`` (one partition per run), ``<name>_rebuild``, the
    ``<name>_backlog`` sensor and the ``<name>_run_retention`` sensor (running by default, as a
    group asset's: :mod:`cg_pipelines.dagster.retention`) of one co-partitioned asset (or pass
    it to ``build_definitions(..., joins=[spec])``)."""
    with partitioned_checks_preview():
        asset_def = build_copartitioned_asset(spec)
    job = define_asset_job(f"{spec.name}_job", selection=[asset_def],
                           description=f"Drain partition p of every input of {spec.name} "
                           "per run, one commit for all.")
    rebuild = define_asset_job(
        f"{spec.name}_rebuild", selection=[asset_def],
        config={"ops": {asset_def.op.name: {"config": {"mode": "rebuild"}}}},
        tags={MODE_TAG: "rebuild"},
        description=f"Rebuild partition p of {spec.name} per run from every input's origin "
        "history, replacing its rows in one commit (backfill it to recompute).")
    retention = build_run_retention_sensor(
        spec.name, asset_def.key, spec.partition_keys(), [job.name, rebuild.name],
        sorted(k.name for k in asset_def.check_keys), spec.runs_resource_key)
    return JoinDefinitions(asset_def, job, rebuild, [build_join_sensor(spec, job), retention])
