"""What a user declares for a co-partitioned asset: :class:`CoPartitionedAsset` (the inputs,
their shared partition count, a :class:`~cg_pipelines.engine.join_processor.JoinProcessor`).
:mod:`cg_pipelines.dagster.joins` builds the asset and its jobs from it and
:mod:`cg_pipelines.dagster.join_sensor` its backlog sensor; both import it from here (it is
also importable from :mod:`cg_pipelines.dagster.joins` and :mod:`cg_pipelines.dagster`)."""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from cg_pipelines.core.errors import ConfigError
from cg_pipelines.core.fingerprint import code_version
from cg_pipelines.core.lag import DEFAULT_LAG_PER_DAY, DEFAULT_LAG_REFRESH_S
from cg_pipelines.core.write import Append, Merge
from cg_pipelines.dagster.spec import PartitionKeys
from cg_pipelines.engine.join import JoinInput
from cg_pipelines.engine.join_processor import JoinProcessor
from cg_pipelines.sinks.maintenance import Maintenance

__all__ = ["CoPartitionedAsset"]


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
