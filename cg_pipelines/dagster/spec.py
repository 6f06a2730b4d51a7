"""What a user declares for one consumer group: :class:`ConsumerGroupAsset`; and what every
part of a group's Dagster definitions (asset, sensors, checks) reads it with:
:func:`load_group_config` and the errors a tick or a run reports, :data:`TICK_ERRORS`."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import nats.errors
from dagster import AssetKey, FreshnessPolicy, PreviewWarning

from cg_pipelines.core.config import ElasticConfig
from cg_pipelines.core.errors import ConfigError, GroupNotFoundError
from cg_pipelines.core.fingerprint import code_version
from cg_pipelines.core.lag import DEFAULT_LAG_PER_DAY, DEFAULT_LAG_REFRESH_S
from cg_pipelines.core.record import SEQ_COLUMN
from cg_pipelines.core.write import Append, Merge
from cg_pipelines.dagster.resources import NatsResource
from cg_pipelines.engine.processor import Processor, with_defaults
from cg_pipelines.jetstream import admin
from cg_pipelines.jetstream.errors import JetStreamError
from cg_pipelines.jetstream.kv import Versioned
from cg_pipelines.sinks.maintenance import Maintenance

__all__ = [
    "TICK_ERRORS",
    "ConsumerGroupAsset",
    "PartitionKeys",
    "asset_key_of",
    "check_partitions",
    "load_group_config",
    "partitioned_checks_preview",
]

TICK_ERRORS = (GroupNotFoundError, ConfigError, JetStreamError, TimeoutError, OSError,
               nats.errors.Error, ValueError)
"""What a sensor tick reports as a skip reason, and a run as a ``Failure``, instead of crashing."""


class PartitionKeys:
    """Dagster partition keys ``<prefix><p>`` of an asset with ``partitions`` consumer-group
    partitions: what a group asset and a co-partitioned asset share (each gives ``name``,
    ``partitions`` and its ``effective_partition_key_prefix``)."""

    name: str
    partitions: int

    @property
    def effective_partition_key_prefix(self) -> str:
        raise NotImplementedError

    def partition_key(self, partition: int) -> str:
        """Dagster partition key of partition ``partition``."""
        return f"{self.effective_partition_key_prefix}{partition}"

    def partition_keys(self) -> list[str]:
        """All partition keys, in partition order."""
        return [self.partition_key(p) for p in range(self.partitions)]

    def partition_of(self, key: str) -> int:
        """The partition of Dagster partition ``key``.

        Raises:
            ConfigError: not one of this asset's keys.
        """
        prefix = self.effective_partition_key_prefix
        tail = key[len(prefix):] if key.startswith(prefix) else ""
        if not tail.isdigit() or int(tail) >= self.partitions or str(int(tail)) != tail:
            raise ConfigError("partition_key", f"{key!r} is not a partition key of "
                              f"{self.name} ({self.partition_key(0)} .. "
                              f"{self.partition_key(self.partitions - 1)})")
        return int(tail)


@dataclass(frozen=True)
class ConsumerGroupAsset(PartitionKeys):
    """A consumer group materialized as a partitioned Dagster asset (one group partition per
    run), written to the table its warehouse resource makes (Delta or Iceberg).

    Attributes:
        name: asset name; also the table's name in the warehouse (``table`` overrides).
        stream: the origin stream.
        group: the elastic consumer group on it.
        partitions: the group's partition count (its ``max_members``, fixed for the group's
            life). Checked against the group's KV config at run time.
        processor: the processing step, e.g.
            :class:`cg_pipelines.spark.SparkProcessor` (gets the run's SparkSession from the
            Spark resource) or :class:`cg_pipelines.engine.ArrowProcessor` (needs no Spark
            resource). A processor that declares per-key state needs a warehouse whose sink
            serves it (:class:`~cg_pipelines.dagster.DeltaWarehouseResource` and
            :class:`~cg_pipelines.dagster.iceberg.IcebergWarehouseResource` do).
        description: shown in the Dagster UI.
        table: the table's name in the warehouse (default ``name``).
        partition_key_prefix: partition keys are ``<prefix><p>`` (default ``"<group>-"``, so
            keys say which group they belong to, and Dagster's ``dagster/partition`` run tag is
            unique per group partition: the run-concurrency limit that makes partition runs
            exclusive keys on it). ``""`` gives plain ``"0".."N-1"``.
        key_prefix: asset key prefix (a string or path components).
        group_name: Dagster asset group.
        kinds: Dagster kinds shown in the UI (default ``nats``, the table format (``delta``;
            ``build_definitions`` names its warehouse's, e.g. ``iceberg``), and ``spark`` when
            the processor uses Spark).
        pool: Dagster concurrency pool of the asset (``None``: none).
        sensor_interval_s: minimum seconds between the sensors' ticks. Publish-to-commit
            time under the backlog sensor is at most about this plus a run's start and drain
            time (lower it for fresher tables; each tick is one bounded NATS session).
        lag_objective_s: seconds; the ``lag_within_objective`` check fails while a served
            partition's oldest pending message is older (``None``: no lag check). It is the
            group's freshness, per partition: a drained partition with nothing pending passes
            (each drain run evaluates it for its partition), a stuck one fails within a tick
            (docs/signals.md, "Freshness").
        lag_refresh_s: seconds; the backlog sensor records a partition's lag (an asset
            observation: pending, oldest pending age and timestamp, state) when its state
            changes (caught up / behind / late, or stopped on a new message) and otherwise,
            while it has a backlog, at this slow cadence (default 15 minutes)
            (:func:`cg_pipelines.core.lag.lag_observations_due`).
        lag_observations_per_day: the most lag observations one partition writes a day,
            whatever its traffic (plus a burst of
            :data:`~cg_pipelines.core.lag.LAG_BURST`): with the defaults, 256 partitions
            write at most 47,104 a day, 24,576 under steady traffic
            (:func:`cg_pipelines.core.lag.lag_events_per_day`).
        freshness_policy: a Dagster ``FreshnessPolicy`` for the asset (``None``, the default:
            none). Dagster evaluates it per asset on the last materialization of any partition,
            so an idle, drained group reads stale and a stuck partition reads fresh while
            others materialize: the per-partition freshness is ``lag_within_objective``.
        origin_seq_column: the output column that holds each row's origin stream sequence
            (``_seq`` unless the transform renames it). The ``origin_reconciled`` check no
            longer reads it: it uses the coverage each commit records (docs/reconcile.md).
        reconcile_interval_s: seconds; when set, the backlog sensor evaluates the
            ``origin_reconciled`` check at most this often (it goes on from its cursor
            beside the table, in chunks of up to 200,000 origin messages, for at most half
            of its time budget). ``None`` (default): the check runs only when executed (UI,
            a schedule).
        code_version: the version of this asset's code, for the retry rule: a partition that
            keeps failing is not retried until a run succeeds or a new code version is loaded.
            ``None`` (default): derived from the processor's code and settings
            (:func:`~cg_pipelines.core.fingerprint.code_version`).
        schedule_cron: cron of the drain-all schedule (``None``: no schedule).
        nats_resource_key, spark_resource_key, warehouse_resource_key, runs_resource_key:
            the resource keys this asset, its sensors and schedule use.
        io_manager_key: the key of the IO manager that loads the table for downstream assets
            (:class:`~cg_pipelines.dagster.DeltaTableIOManager`).
        metadata: extra definition metadata.
        write: how output rows reach the table: :class:`~cg_pipelines.core.write.Append`
            (default: every row, the table is the history) or
            :class:`~cg_pipelines.core.write.Merge` (``Merge(key="device",
            delete_when=("op", "delete"))``: one current row per key, upserts and deletes,
            under the same fence). Downstream assets get the table as it is: the history, or
            the current rows.
        maintenance: the table upkeep each run of this group does after its commits
            (:class:`~cg_pipelines.sinks.maintenance.Maintenance`: compaction, state
            snapshots, VACUUM); ``None`` (default): the warehouse resource's settings.

    Raises:
        ConfigError: ``partitions < 1``, empty names, ``write`` not Append/Merge, or a
            processor whose declared state key is not the merge key.
    """

    name: str
    stream: str
    group: str
    partitions: int
    processor: Processor
    description: str = ""
    table: str | None = None
    partition_key_prefix: str | None = None
    key_prefix: str | Sequence[str] | None = None
    group_name: str | None = None
    kinds: frozenset[str] | None = None
    pool: str | None = None
    sensor_interval_s: int = 30
    lag_objective_s: float | None = 300.0
    lag_refresh_s: float = DEFAULT_LAG_REFRESH_S
    lag_observations_per_day: int = DEFAULT_LAG_PER_DAY
    freshness_policy: FreshnessPolicy | None = None
    code_version: str | None = None
    origin_seq_column: str = SEQ_COLUMN
    reconcile_interval_s: float | None = None
    schedule_cron: str | None = "*/15 * * * *"
    nats_resource_key: str = "nats"
    spark_resource_key: str = "spark"
    warehouse_resource_key: str = "warehouse"
    runs_resource_key: str = "partition_runs"
    io_manager_key: str = "cg_io_manager"
    metadata: Mapping[str, object] = field(default_factory=dict)
    write: Append | Merge = field(default_factory=Append)
    maintenance: Maintenance | None = None

    def __post_init__(self) -> None:
        for what in ("name", "stream", "group"):
            if not getattr(self, what):
                raise ConfigError(what, "must not be empty")
        if isinstance(self.partitions, bool) or not isinstance(self.partitions, int) or \
                self.partitions < 1:
            raise ConfigError("partitions", f"must be an integer >= 1, got {self.partitions!r}")
        if self.sensor_interval_s < 1:
            raise ConfigError("sensor_interval_s", f"must be >= 1 second, got "
                              f"{self.sensor_interval_s!r}")
        if self.reconcile_interval_s is not None and not self.reconcile_interval_s > 0:
            raise ConfigError("reconcile_interval_s", f"must be > 0 seconds (or None), got "
                              f"{self.reconcile_interval_s!r}")
        if not self.lag_refresh_s > 0:
            raise ConfigError("lag_refresh_s", f"must be > 0 seconds, got "
                              f"{self.lag_refresh_s!r}")
        if isinstance(self.lag_observations_per_day, bool) or not isinstance(
                self.lag_observations_per_day, int) or self.lag_observations_per_day < 1:
            raise ConfigError("lag_observations_per_day", f"must be an integer >= 1, got "
                              f"{self.lag_observations_per_day!r}")
        if self.lag_objective_s is not None and not self.lag_objective_s > 0:
            raise ConfigError("lag_objective_s", f"must be > 0 seconds (or None), got "
                              f"{self.lag_objective_s!r}")
        if self.maintenance is not None and not isinstance(self.maintenance, Maintenance):
            raise ConfigError("maintenance", f"must be a Maintenance, got {self.maintenance!r}")
        if not isinstance(self.write, (Append, Merge)):
            raise ConfigError("write", f"must be Append() or Merge(key=...), got {self.write!r}")
        state = with_defaults(self.processor).state
        if isinstance(self.write, Merge) and state is not None and \
                (state.key,) != self.write.keys:
            raise ConfigError("write", f"the processor's KeyedState key {state.key!r} must be "
                              f"the merge key {self.write.key!r}: in merge mode a key's state "
                              "is its current row")

    def current_code_version(self) -> str:
        """``code_version`` when declared, else a digest of the processor (its code and
        settings) and of this declaration's stream, group and partitions; the same in every
        process that loads the same definitions."""
        if self.code_version:
            return self.code_version
        return code_version(self.processor, self.stream, self.group, self.partitions)

    @property
    def uses_spark(self) -> bool:
        """Whether the processor runs on Spark (then the asset requires the Spark resource)."""
        return with_defaults(self.processor).uses_spark

    @property
    def table_name(self) -> str:
        """The table's name in the warehouse (under a Delta root; in an Iceberg namespace)."""
        return self.table or self.name

    @property
    def effective_partition_key_prefix(self) -> str:
        """The partition key prefix in effect (``"<group>-"`` unless given)."""
        return f"{self.group}-" if self.partition_key_prefix is None else self.partition_key_prefix



def check_partitions(config: ElasticConfig, spec: ConsumerGroupAsset) -> None:
    """Raise ``ConfigError`` unless the group's partition count is the one the code declares."""
    if config.max_members != spec.partitions:
        raise ConfigError("max_members", f"group {spec.stream}.{spec.group} has "
                          f"{config.max_members} partitions in KV but the code declares "
                          f"{spec.partitions}")


def load_group_config(nats_res: NatsResource, spec: ConsumerGroupAsset
                      ) -> Versioned[ElasticConfig]:
    """The group's config (one bounded NATS call), its partition count checked.

    Raises:
        GroupNotFoundError, ConfigError, JetStreamError, TimeoutError: as the call fails.
    """
    v = nats_res.run(lambda nc: admin.get_elastic(nc.jetstream(), spec.stream, spec.group,
                                                  timeout=nats_res.call_timeout_s))
    check_partitions(v.config, spec)
    return v


def asset_key_of(spec: ConsumerGroupAsset) -> AssetKey:
    """The asset key of ``spec`` (its ``key_prefix`` components, then its name)."""
    prefix = [spec.key_prefix] if isinstance(spec.key_prefix, str) else list(spec.key_prefix or [])
    return AssetKey([*prefix, spec.name])


@contextlib.contextmanager
def partitioned_checks_preview() -> Iterator[None]:
    """Silence, for the library's own definitions built inside, the ``PreviewWarning`` that
    Dagster 1.13 emits for each partitioned asset check (``AssetCheckSpec(...,
    partitions_def=...)``, ``@asset_check(partitions_def=...)``: "Specifying a partitions_def on
    an AssetCheckSpec is currently in preview"). The group asset's per-partition checks are
    that feature by design (one result per partition); a warning per check on every
    definitions load tells a user nothing they can act on. Only that warning, only inside
    this block (``warnings.catch_warnings`` restores the filters on exit): other warnings, and
    the same warning from the user's own definitions, still show."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"Specifying a partitions_def on an AssetCheckSpec",
            category=PreviewWarning)
        yield
