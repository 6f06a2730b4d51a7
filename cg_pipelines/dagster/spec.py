"""What a user declares: ONE asset spec, :class:`StreamAsset`, whose inputs are one consumer
group or a co-partitioned set (constructor forms :class:`ConsumerGroupAsset` and
:class:`CoPartitionedAsset`; nothing downstream asks which made it); its partition keys and
per-input names, the errors a tick or run reports (:data:`TICK_ERRORS`) and the read of every
input's config (:func:`load_configs`)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import nats.errors
from dagster import AssetKey, FreshnessPolicy, PreviewWarning

from cg_pipelines.core.config import ElasticConfig
from cg_pipelines.core.errors import ConfigError, GroupNotFoundError
from cg_pipelines.core.lag import DEFAULT_LAG_PER_DAY, DEFAULT_LAG_REFRESH_S
from cg_pipelines.core.partitioning import partition_key, partition_keys, partition_of
from cg_pipelines.core.record import SEQ_COLUMN
from cg_pipelines.core.state import KeyedState
from cg_pipelines.core.write import Append, Merge
from cg_pipelines.dagster.resources import NatsResource
from cg_pipelines.engine.inputs import (
    check_spec_inputs,
    inputs_code_version,
    inputs_label,
    inputs_title,
    read_input_configs,
)
from cg_pipelines.engine.join import JoinInput
from cg_pipelines.engine.join_processor import JoinProcessor
from cg_pipelines.engine.processor import Processor, with_defaults
from cg_pipelines.jetstream.errors import JetStreamError
from cg_pipelines.jetstream.kv import Versioned
from cg_pipelines.sinks.maintenance import Maintenance

__all__ = ["TICK_ERRORS", "CoPartitionedAsset", "ConsumerGroupAsset", "JoinInput",
           "StreamAsset", "asset_key_of", "load_configs", "partitioned_checks_preview",
           "read_configs"]

TICK_ERRORS = (GroupNotFoundError, ConfigError, JetStreamError, TimeoutError, OSError,
               nats.errors.Error, ValueError)
"""What a sensor tick reports as a skip reason, and a run as a ``Failure``, instead of crashing."""


@dataclass(frozen=True)
class StreamAsset:
    """A partitioned Dagster asset fed by one consumer group or by a co-partitioned set of
    them: one run per partition ``p`` drains partition ``p`` of every input and commits once
    to the table its warehouse resource makes (Delta or Iceberg).

    Attributes:
        name: asset name; also the table's name in the warehouse (``table`` overrides).
        inputs: ``JoinInput(name, stream, group)`` s. One: a group asset. Several: a
            co-partitioned set (checked against the KV configs at each run and tick,
            :func:`~cg_pipelines.core.copartition.check_copartitioned`), whose processor is a
            ``JoinProcessor`` over these names.
        partitions: the partition count (every group's ``max_members``, fixed for its life).
        processor: an ``ArrowProcessor``/``SparkProcessor`` (one input) or a
            ``JoinProcessor``; declared per-key state needs a state-capable warehouse.
        description: shown in the Dagster UI.
        table: the table's name in the warehouse (default ``name``).
        partition_key_prefix: keys are ``<prefix><p>``; default the input groups (distinct,
            joined by ``+``) and ``-``, e.g. ``totals-3``: the ``dagster/partition`` run tag,
            which makes partition runs exclusive, names the group partition. ``""``: ``"0"``...
        key_prefix: asset key prefix (a string or path components).
        group_name: Dagster asset group.
        kinds: Dagster kinds (default ``nats``, the table format, ``spark`` if used).
        pool: Dagster concurrency pool (``None``: none).
        sensor_interval_s: minimum seconds between the sensors' ticks.
        lag_objective_s: seconds; ``lag_within_objective`` (per input) fails while a served
            partition's oldest pending message is older (``None``: no lag check).
        lag_refresh_s: seconds; a partition's lag is observed when its state changes, else
            this often while it has a backlog.
        lag_observations_per_day: the most lag observations a partition writes a day.
        freshness_policy: a Dagster ``FreshnessPolicy`` (per asset; ``None``: none).
        code_version: the code's version for the retry rule (``None``: a digest).
        origin_seq_column: the output column holding each row's origin sequence.
        reconcile_interval_s: seconds; the backlog sensor evaluates ``origin_reconciled``
            this often (``None``: only when executed).
        schedule_cron: cron of the drain-all schedule (``None``: no schedule).
        nats_resource_key, spark_resource_key, warehouse_resource_key, runs_resource_key,
        io_manager_key: the resource keys the asset, its sensors and schedule use.
        metadata: extra definition metadata.
        write: ``Append()`` (default: the history) or ``Merge(key=...)`` (current rows).
        maintenance: the table upkeep after each run (``None``: the warehouse's).

    Raises:
        ConfigError: no input, duplicate input names or groups, several inputs without a
            ``JoinProcessor`` over their names, a setting out of range, ``write`` not
            Append/Merge, or a declared state key that is not the merge key.
    """

    name: str
    inputs: Sequence[JoinInput]
    partitions: int
    processor: Processor | JoinProcessor
    _: KW_ONLY
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
        object.__setattr__(self, "inputs", tuple(self.inputs))
        if not self.name:
            raise ConfigError("name", "must not be empty")
        check_spec_inputs(self.inputs, self.processor)
        _positive_int("partitions", self.partitions)
        _positive_int("lag_observations_per_day", self.lag_observations_per_day)
        if self.sensor_interval_s < 1:
            raise ConfigError("sensor_interval_s", f"must be >= 1 second, got "
                              f"{self.sensor_interval_s!r}")
        for what, v in (("reconcile_interval_s", self.reconcile_interval_s),
                        ("lag_objective_s", self.lag_objective_s),
                        ("lag_refresh_s", self.lag_refresh_s or 0.0)):
            if v is not None and not v > 0:
                raise ConfigError(what, f"must be > 0 seconds (or None), got {v!r}")
        if self.maintenance is not None and not isinstance(self.maintenance, Maintenance):
            raise ConfigError("maintenance", f"must be a Maintenance, got {self.maintenance!r}")
        if not isinstance(self.write, (Append, Merge)):
            raise ConfigError("write", f"must be Append() or Merge(key=...), got {self.write!r}")
        state = self.state
        if isinstance(self.write, Merge) and state is not None and \
                (state.key,) != self.write.keys:
            raise ConfigError("write", f"the processor's KeyedState key {state.key!r} must be "
                              f"the merge key {self.write.key!r}: in merge mode a key's state "
                              "is its current row")

    @property
    def is_set(self) -> bool:
        """Whether the inputs are a co-partitioned set (several groups, one JoinProcessor)."""
        return isinstance(self.processor, JoinProcessor)

    @property
    def state(self) -> KeyedState | None:
        """The per-key state the processor declares, or None."""
        p = self.processor
        return p.state if isinstance(p, JoinProcessor) else with_defaults(p).state

    @property
    def uses_spark(self) -> bool:
        """Whether the processor runs on Spark (then the asset requires the Spark resource)."""
        p = self.processor
        return p.uses_spark if isinstance(p, JoinProcessor) else with_defaults(p).uses_spark

    @property
    def table_name(self) -> str:
        """The table's name in the warehouse (under a Delta root; in an Iceberg namespace)."""
        return self.table or self.name

    @property
    def title(self) -> str:
        """What messages call the inputs: ``consumer group <stream>.<group>`` or
        ``co-partitioned set <name> (<stream>.<group>, ...)``."""
        return inputs_title(self.inputs, self.name)

    @property
    def label(self) -> str:
        """The input groups, distinct, joined by ``+`` (run keys start with it)."""
        return inputs_label(self.inputs)

    @property
    def effective_partition_key_prefix(self) -> str:
        """The partition key prefix in effect (``"<label>-"`` unless given)."""
        return f"{self.label}-" if self.partition_key_prefix is None \
            else self.partition_key_prefix

    def partition_key(self, partition: int) -> str:
        """Dagster partition key of partition ``partition``."""
        return partition_key(self.effective_partition_key_prefix, partition)

    def partition_keys(self) -> list[str]:
        """All partition keys, in partition order."""
        return partition_keys(self.effective_partition_key_prefix, self.partitions)

    def partition_of(self, key: str) -> int:
        """The partition of Dagster partition ``key``.

        Raises:
            ConfigError: not one of this asset's keys.
        """
        return partition_of(self.effective_partition_key_prefix, key, self.partitions,
                            self.name)

    def per_input(self, check: str, inp: JoinInput) -> str:
        """The name of check ``check`` about input ``inp``: ``check`` itself for one input,
        ``<check>__<input name>`` for a set."""
        return f"{check}__{inp.name}" if len(self.inputs) > 1 else check

    def md_prefix(self, inp: JoinInput) -> str:
        """What metadata keys about input ``inp`` start with: ``""`` for one input,
        ``<input name>/`` for a set."""
        return f"{inp.name}/" if len(self.inputs) > 1 else ""

    def current_code_version(self) -> str:
        """``code_version`` when declared, else a digest of the processor (code and
        settings), the inputs and the partition count; the same in every process that loads
        the same definitions."""
        if self.code_version:
            return self.code_version
        return inputs_code_version(self.processor, self.inputs, self.partitions)


def _positive_int(what: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(what, f"must be an integer >= 1, got {v!r}")


@dataclass(frozen=True, init=False)
class ConsumerGroupAsset(StreamAsset):
    """The one-input form of :class:`StreamAsset`: ``ConsumerGroupAsset(name, stream, group,
    partitions, processor, **options)``, its one input named after the group; ``options``
    are :class:`StreamAsset`'s keyword attributes."""

    stream: str = ""
    group: str = ""
    inputs: Sequence[JoinInput] = field(init=False, default=())

    def __init__(self, name: str, stream: str, group: str, partitions: int,
                 processor: Processor, **options: Any) -> None:
        object.__setattr__(self, "stream", stream)
        object.__setattr__(self, "group", group)
        StreamAsset.__init__(self, name, (), partitions, processor, **options)

    def __post_init__(self) -> None:
        if not self.stream or not self.group:
            raise ConfigError("stream" if not self.stream else "group", "must not be empty")
        object.__setattr__(self, "inputs", (JoinInput(self.group, self.stream, self.group),))
        super().__post_init__()


@dataclass(frozen=True)
class CoPartitionedAsset(StreamAsset):
    """The set form of :class:`StreamAsset`: two or more ``inputs`` and a ``JoinProcessor``
    (docs/joins.md). Raises ``ConfigError`` for fewer, and what ``StreamAsset`` refuses."""

    def __post_init__(self) -> None:
        if len(tuple(self.inputs)) < 2:
            raise ConfigError("inputs", "a co-partitioned asset needs two or more inputs, got "
                              f"{[i.name for i in self.inputs]}")
        super().__post_init__()


async def read_configs(nc: Any, spec: StreamAsset, timeout: float
                       ) -> list[Versioned[ElasticConfig]]:
    """Every input's elastic config, the partition count (and a set's co-partitioning)
    checked (:func:`~cg_pipelines.engine.inputs.read_input_configs`).

    Raises:
        GroupNotFoundError, CoPartitionError, ConfigError, JetStreamError, TimeoutError.
    """
    return await read_input_configs(nc, spec.inputs, spec.partitions, name=spec.name,
                                    timeout=timeout)


def load_configs(nats_res: NatsResource, spec: StreamAsset) -> list[Versioned[ElasticConfig]]:
    """:func:`read_configs` in one bounded NATS session."""
    return nats_res.run(lambda nc: read_configs(nc, spec, nats_res.call_timeout_s))


def asset_key_of(spec: StreamAsset) -> AssetKey:
    """The asset key of ``spec`` (its ``key_prefix`` components, then its name)."""
    prefix = [spec.key_prefix] if isinstance(spec.key_prefix, str) else list(spec.key_prefix or [])
    return AssetKey([*prefix, spec.name])


@contextlib.contextmanager
def partitioned_checks_preview() -> Iterator[None]:
    """Silence, inside the block only, Dagster 1.13's ``PreviewWarning`` for partitioned asset
    checks (the library's checks are that feature by design)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"Specifying a partitions_def on an AssetCheckSpec",
            category=PreviewWarning)
        yield
